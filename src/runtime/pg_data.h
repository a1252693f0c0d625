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
 * Every error message starts with the file it is about. */
#ifndef PG_DATA_H
#define PG_DATA_H

#include <stddef.h>
#include <stdint.h>

#define PG_SHARD_MAGIC 20240520
#define PG_SHARD_MAGIC_U32 20240801 /* llm.c's magic for its version 7 (uint32) shards */
#define PG_SHARD_HEADER_INTS 256
#define PG_SHARD_HEADER_BYTES (PG_SHARD_HEADER_INTS * 4)

/* An open, validated shard: the file is mapped read-only. */
typedef struct pg_shard {
  char *path;
  int version;      /* 1 or 7 */
  int64_t ntokens;
  const uint8_t *tokens; /* into the mapping, after the header */
  void *map;
  size_t map_bytes;
} pg_shard;

/* Opens and validates `path`: readable regular file, full header, magic,
 * version, size == header + count * token size. When vocab > 0, every token
 * must be below it (one scan; the first offender is named). Tokens must also
 * fit an int32 (only a version 7 file can break that). On failure the shard
 * is left closed. */
int pg_shard_open(pg_shard *s, const char *path, int64_t vocab);
void pg_shard_close(pg_shard *s);

static inline uint32_t pg_shard_token(const pg_shard *s, int64_t i) {
  /* Byte-wise so that the format is little-endian on any host. */
  if (s->version == 1) {
    const uint8_t *p = s->tokens + 2 * i;
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
  }
  const uint8_t *p = s->tokens + 4 * i;
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* out[0..n) = tokens [start, start+n) of the shard. */
int pg_shard_read(const pg_shard *s, int64_t start, int64_t n, int32_t *out);

/* Header only (plus the size check): version and token count. */
int pg_shard_info(const char *path, int *version, int64_t *ntokens);

/* Writes `n` tokens atomically: to "path.tmp.<pid>", fsync, rename. version 0
 * picks 1 when every token is below 65536, else 7; 1 or 7 forces it (a token
 * that does not fit is an error). Negative tokens are an error. */
int pg_shard_write(const char *path, const int32_t *tokens, int64_t n, int version);

/* Expands a shell glob into a sorted list (malloc'd strings in a malloc'd
 * array; free with pg_data_free_paths). No match is an error naming it. */
int pg_data_glob(const char *pattern, char ***paths, int *n);
void pg_data_free_paths(char **paths, int n);
/* Whether `s` has glob characters (* ? [). */
int pg_data_is_glob(const char *s);

/* A 64-bit hash of bytes under a seed (documents to train/val splits). */
uint64_t pg_data_hash(const void *bytes, size_t n, uint64_t seed);

typedef struct pg_loader_config {
  int64_t batch;   /* global rows per step */
  int64_t seq_len; /* tokens per row */
  uint64_t seed;
  int shuffle;
  int dp_rank, dp_size; /* this rank's share; 0, 1 when not data-parallel */
  int64_t vocab;        /* > 0: validate tokens against it */
} pg_loader_config;

typedef struct pg_loader {
  pg_loader_config cfg;
  int nfiles;
  pg_shard *files;
  int64_t *first_window; /* nfiles + 1 cumulative window counts */
  int64_t nwindows, batches_per_epoch;
  int64_t *order;      /* nwindows window ids: this epoch's visiting order */
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
 * returns its first batch); PG_ERR on failure. */
int pg_loader_next(pg_loader *ld, int32_t *inputs, int32_t *targets);

/* Back to the first batch of the current epoch. */
void pg_loader_reset(pg_loader *ld);

/* Moves to (epoch, index); 0 <= index <= batches_per_epoch. */
int pg_loader_seek(pg_loader *ld, int64_t epoch, int64_t index);

#endif
