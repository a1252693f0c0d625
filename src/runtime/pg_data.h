/* pg_data: token shards (llm.c's file format) and the training data loader.
 *
 * Shard format (little-endian): a header of 256 int32 — [0] the magic number
 * 20240520, [1] the version (1: tokens are uint16, 7: tokens are uint32),
 * [2] the token count — followed by exactly that many tokens.
 *
 * The loader cuts every file into non-overlapping windows of seq_len + 1
 * tokens (windows never cross files; a file's last tokens that do not fill a
 * window are unused). Window w gives one row: inputs = its first seq_len
 * tokens, targets = the same shifted by one. An epoch visits every window
 * once, in file order or in a seeded shuffle that is a pure function of
 * (seed, epoch). Global batch b of an epoch is windows [b*batch, (b+1)*batch)
 * of that order (a last partial batch is dropped); data rank d of D reads rows
 * [d*batch/D, (d+1)*batch/D) of it, so every D sees the same global batches.
 *
 * stride_llmc reads as llm.c's DataLoader does: global batch u of a file is
 * the span of batch * seq_len + 1 tokens from u * batch * seq_len (spans
 * overlap by one token; a file has (ntokens - 1) / (batch * seq_len) of them,
 * never crossing files); data rank d takes the local * seq_len + 1 tokens from
 * d * local * seq_len into it (local = batch / D, as llm.c's process_rank
 * offset), row r = tokens [r * seq_len, (r + 1) * seq_len) of that, targets
 * shifted by one. An epoch visits the spans in file order, or shuffled as the
 * windows are.
 *
 * Every error message starts with the file it is about. */
#ifndef PG_DATA_H
#define PG_DATA_H

#include <stddef.h>
#include <stdint.h>

#define PG_SHARD_MAGIC 20240520
#define PG_SHARD_MAGIC_U32 20240801 /* llm.c's magic for its version 7 (uint32) shards */
#define PG_SHARD_HEADER_INTS 256
#define PG_SHARD_HEADER_BYTES (PG_SHARD_HEADER_INTS * 4)

/* An open, validated shard. It is read with pread, never mapped: a file
 * truncated under a mapping would raise SIGBUS in the reader, and the loader
 * reads a few KiB per row, which pread serves as fast. The identity of the
 * file at open (size, mtime, device and inode) is kept, and every read checks
 * it first (pg_shard_check): a shard rewritten in place, truncated, extended
 * or replaced by a rename while it is open is an error naming it, not
 * tokens from another file. */
typedef struct pg_shard {
  char *path;
  int fd;           /* -1: closed */
  int version;      /* 1 or 7 */
  int64_t ntokens;
  int64_t header;   /* bytes before the first token: PG_SHARD_HEADER_BYTES, or 0 for a headerless file */
  int64_t file_bytes;
  int64_t mtime_sec, mtime_nsec;
  uint64_t dev, ino;
} pg_shard;

/* Opens and validates `path`: readable regular file, full header, magic,
 * version, size == header + count * token size. When vocab > 0, every token
 * must be below it (one scan; the first offender is named). Tokens must also
 * fit an int32 (only a version 7 file can break that). On failure the shard
 * is left closed. */
int pg_shard_open(pg_shard *s, const char *path, int64_t vocab);
void pg_shard_close(pg_shard *s);

/* PG_OK while the file at s->path is still the one opened, unchanged (same
 * device and inode, size and modification time); else an error naming it and
 * what changed. */
int pg_shard_check(const pg_shard *s);

/* out[0..n) = tokens [start, start+n) of the shard (pg_shard_check first;
 * a short read is the file having changed, and named so). */
int pg_shard_read(const pg_shard *s, int64_t start, int64_t n, int32_t *out);

/* A headerless file of raw little-endian ids (nanoGPT's train.bin: uint16;
 * version names the width as in a header, 1 = uint16, 7 = uint32). The size
 * must be a whole number of ids; the vocab and int32 checks are
 * pg_shard_open's. */
int pg_shard_open_raw(pg_shard *s, const char *path, int version, int64_t vocab);

/* Header only (plus the size check): version and token count. */
int pg_shard_info(const char *path, int *version, int64_t *ntokens);

/* A shard written as it grows: the header with count 0 goes to
 * "path.tmp.<pid>", appended ids follow (buffered), and close rewrites the
 * count, fsyncs and renames onto path, so path is only ever a whole shard.
 * version 1 (uint16) or 7 (uint32) is fixed at open; an id that does not fit
 * it, a negative id, or more than INT32_MAX ids is an error naming path and
 * the position. After any failure, and on abort, the temporary file is gone. */
typedef struct pg_shard_writer {
  char *path, *tmp;
  int fd;          /* -1: closed */
  int version;
  int64_t ntokens; /* appended so far */
  uint8_t *buf;
  size_t nbuf;
} pg_shard_writer;

int pg_shard_writer_open(pg_shard_writer *w, const char *path, int version);
int pg_shard_writer_append(pg_shard_writer *w, const int32_t *ids, int64_t n);
int pg_shard_writer_close(pg_shard_writer *w);
void pg_shard_writer_abort(pg_shard_writer *w);

/* Writes `n` tokens atomically (a pg_shard_writer). version 0 picks 1 when
 * every token is below 65536, else 7; 1 or 7 forces it (a token that does not
 * fit is an error). Negative tokens are an error. */
int pg_shard_write(const char *path, const int32_t *tokens, int64_t n, int version);

/* Expands a shell glob into a sorted list (malloc'd strings in a malloc'd
 * array; free with pg_data_free_paths). No match is an error naming it. */
int pg_data_glob(const char *pattern, char ***paths, int *n);
void pg_data_free_paths(char **paths, int n);
/* Whether `s` has glob characters (* ? [). */
int pg_data_is_glob(const char *s);

/* A 64-bit hash of bytes under a seed (documents to train/val splits). */
uint64_t pg_data_hash(const void *bytes, size_t n, uint64_t seed);
/* pg_data_hash as a number in [0, 1): its top 53 bits. */
double pg_data_hash_unit(const void *bytes, size_t n, uint64_t seed);

/* The offset of the first byte that is not part of valid UTF-8 (RFC 3629: no
 * overlong forms, surrogates or code points above U+10FFFF), or n when all is. */
size_t pg_data_utf8_invalid_at(const void *bytes, size_t n);

typedef struct pg_loader_config {
  int64_t batch;   /* global rows per step */
  int64_t seq_len; /* tokens per row */
  uint64_t seed;
  int shuffle;
  int dp_rank, dp_size; /* this rank's share; 0, 1 when not data-parallel */
  int64_t vocab;        /* > 0: validate tokens against it */
  int raw_version;      /* 0: llm.c shards with a header; 1 / 7: headerless uint16 / uint32 ids */
  int stride_llmc;      /* 0: windows of seq_len + 1; 1: llm.c's DataLoader spans (below) */
} pg_loader_config;

typedef struct pg_loader {
  pg_loader_config cfg;
  int nfiles;
  pg_shard *files;
  int64_t *first_window; /* nfiles + 1 cumulative unit counts */
  /* The units an epoch orders: windows (one row each), or with stride_llmc
   * spans of batch * seq_len + 1 tokens (one global batch each). */
  int64_t nwindows, batches_per_epoch;
  int64_t *order;      /* nwindows unit ids: this epoch's visiting order */
  uint64_t calls;      /* pg_loader_next calls so far */
  uint64_t *checked;   /* per file: the call that last ran pg_shard_check on it */
  int32_t *row;        /* one read's tokens: seq_len + 1, or with stride_llmc (batch / dp_size) * seq_len + 1 */
  int64_t order_epoch; /* which epoch `order` holds; -1: none yet */
  /* The position of the next batch: its epoch and index within the epoch.
   * index == batches_per_epoch means the epoch is used up. */
  int64_t epoch, index;
} pg_loader;

/* Opens every file (validated) and checks the configuration: batch and
 * seq_len positive, batch divisible by dp_size, each file long enough for one
 * global batch. On failure nothing is left open. */
int pg_loader_init(pg_loader *ld, const char *const *paths, int nfiles, const pg_loader_config *cfg);
void pg_loader_destroy(pg_loader *ld);

/* Fills this rank's rows of the next global batch: inputs and targets are
 * [batch/dp_size, seq_len] int32, row-major. Returns 1 with a batch; 0 at the
 * end of an epoch, having moved to the start of the next one (the next call
 * returns its first batch); PG_ERR on failure, among them a file that changed
 * since init (pg_shard_check); the position is then unchanged. */
int pg_loader_next(pg_loader *ld, int32_t *inputs, int32_t *targets);

/* Back to the first batch of the current epoch. */
void pg_loader_reset(pg_loader *ld);

/* Moves to (epoch, index); 0 <= index <= batches_per_epoch. */
int pg_loader_seek(pg_loader *ld, int64_t epoch, int64_t index);

#endif
