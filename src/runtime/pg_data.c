#define _POSIX_C_SOURCE 200809L
#include "pg_data.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pg_error.h"
#include "pg_rng.h"

static int32_t le32(const uint8_t *p) {
  return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

static void put_le32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

/* Header checks shared by open and info: magic, version, and the file size
 * against the token count. */
static int check_header(const char *path, const uint8_t *hdr, long long file_bytes, int *version, int64_t *n) {
  int32_t magic = le32(hdr), ver = le32(hdr + 4), count = le32(hdr + 8);
  /* llm.c itself writes its uint32 (version 7) shards with a later magic: read both. */
  if (magic != PG_SHARD_MAGIC && !(magic == PG_SHARD_MAGIC_U32 && ver == 7))
    return pg_fail("%s: bad magic number %d (expected %d): not an llm.c token shard (for a headerless file of raw "
                   "ids such as nanoGPT's train.bin, give dtype = \"uint16\" or \"uint32\")",
                   path, magic, PG_SHARD_MAGIC);
  if (ver != 1 && ver != 7)
    return pg_fail("%s: unknown version %d (expected 1 for uint16 tokens or 7 for uint32 tokens)", path, ver);
  if (count < 0) return pg_fail("%s: bad header: negative token count %d", path, count);
  long long tsize = ver == 1 ? 2 : 4, want = (long long)count * tsize, have = file_bytes - PG_SHARD_HEADER_BYTES;
  if (have < want)
    return pg_fail("%s: truncated: header says %d tokens (%lld bytes) but the file has %lld bytes after the header", path,
                   count, want, have);
  if (have > want)
    return pg_fail("%s: trailing bytes: header says %d tokens (%lld bytes) but the file has %lld bytes after the header",
                   path, count, want, have);
  *version = ver;
  *n = count;
  return PG_OK;
}

/* Opens path read-only and checks it is a regular file of at least min_bytes
 * (room for a header; 1 for a headerless file). st: its fstat. */
static int open_checked(const char *path, struct stat *st, long long min_bytes) {
  /* O_NONBLOCK: opening a FIFO for reading would wait for a writer (a hang, not "not a regular file");
   * a regular file's reads ignore it */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return pg_fail("%s: cannot open: %s", path, strerror(errno));
  if (fstat(fd, st)) {
    int e = errno;
    close(fd);
    return pg_fail("%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(st->st_mode)) {
    close(fd);
    return pg_fail("%s: not a regular file", path);
  }
  if (st->st_size < min_bytes) {
    close(fd);
    if (min_bytes < PG_SHARD_HEADER_BYTES) return pg_fail("%s: empty: a headerless token file needs ids", path);
    return pg_fail("%s: too small for a token shard: %lld bytes, but the header alone is %d bytes (for a headerless "
                   "file of raw ids, give dtype = \"uint16\" or \"uint32\")",
                   path, (long long)st->st_size, PG_SHARD_HEADER_BYTES);
  }
  return fd;
}

/* Reads exactly n bytes at off; a short read is the file having shrunk. */
static int read_at(const pg_shard *s, void *buf, size_t n, int64_t off) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t got = pread(s->fd, p, n, (off_t)off);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return pg_fail("%s: cannot read: %s", s->path, strerror(errno));
    if (got == 0)
      return pg_fail("%s: changed while open: it ends at byte %lld, but it had %lld bytes when opened (a token shard "
                     "must not be rewritten while a loader reads it)",
                     s->path, (long long)off, (long long)s->file_bytes);
    p += got, off += got, n -= (size_t)got;
  }
  return PG_OK;
}

int pg_shard_check(const pg_shard *s) {
  if (s->fd < 0) return pg_fail("the token shard is closed");
  struct stat st;
  if (fstat(s->fd, &st)) return pg_fail("%s: cannot stat: %s", s->path, strerror(errno));
  static const char hint[] = "a token shard must not be rewritten while a loader reads it";
  if ((int64_t)st.st_size != s->file_bytes)
    return pg_fail("%s: changed while open: it has %lld bytes, but had %lld when opened (%s)", s->path,
                   (long long)st.st_size, (long long)s->file_bytes, hint);
  if ((int64_t)st.st_mtim.tv_sec != s->mtime_sec || (int64_t)st.st_mtim.tv_nsec != s->mtime_nsec)
    return pg_fail("%s: changed while open: it was modified after it was opened (%s)", s->path, hint);
  /* a rename onto the path leaves our descriptor on the old file: the path's inode tells */
  if (stat(s->path, &st))
    return pg_fail("%s: changed while open: it is gone (%s; %s)", s->path, strerror(errno), hint);
  if ((uint64_t)st.st_dev != s->dev || (uint64_t)st.st_ino != s->ino)
    return pg_fail("%s: changed while open: another file was put in its place (%s)", s->path, hint);
  return PG_OK;
}

/* Token bytes to ids: width 2 (version 1) or 4, little-endian on any host. */
static void decode_tokens(const uint8_t *p, int version, int64_t n, int32_t *out) {
  if (version == 1)
    for (int64_t i = 0; i < n; i++) out[i] = (int32_t)((uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8);
  else
    for (int64_t i = 0; i < n; i++) out[i] = le32(p + 4 * i);
}

/* The ids of [start, start + n), read in pieces of CHUNK ids; no range or change check. */
enum { CHUNK = 4096 };
static int read_tokens(const pg_shard *s, int64_t start, int64_t n, int32_t *out) {
  uint8_t buf[CHUNK * 4];
  int64_t tsize = s->version == 1 ? 2 : 4;
  for (int64_t done = 0; done < n;) {
    int64_t m = n - done < CHUNK ? n - done : CHUNK;
    if (read_at(s, buf, (size_t)(m * tsize), s->header + (start + done) * tsize)) return PG_ERR;
    decode_tokens(buf, s->version, m, out + done);
    done += m;
  }
  return PG_OK;
}

/* Opens path; raw_version 0 checks an llm.c header, 1 or 7 takes the whole
 * file as headerless ids of that width. Then the vocab / int32 scan. */
static int shard_open(pg_shard *s, const char *path, int raw_version, int64_t vocab) {
  memset(s, 0, sizeof *s);
  s->fd = -1;
  if (raw_version != 0 && raw_version != 1 && raw_version != 7)
    return pg_fail("%s: unknown id width %d (expected 1 for uint16 or 7 for uint32)", path, raw_version);
  struct stat st;
  int fd = open_checked(path, &st, raw_version ? 1 : PG_SHARD_HEADER_BYTES);
  if (fd < 0) return PG_ERR;
  s->path = strdup(path);
  if (!s->path) {
    close(fd);
    return pg_fail("%s: out of memory", path);
  }
  s->fd = fd;
  s->file_bytes = (int64_t)st.st_size;
  s->mtime_sec = (int64_t)st.st_mtim.tv_sec, s->mtime_nsec = (int64_t)st.st_mtim.tv_nsec;
  s->dev = (uint64_t)st.st_dev, s->ino = (uint64_t)st.st_ino;
  long long bytes = (long long)st.st_size;
  if (raw_version) {
    long long tsize = raw_version == 1 ? 2 : 4;
    if (bytes % tsize) {
      pg_fail("%s: %lld bytes are not a whole number of %s ids (%lld bytes each)", path, bytes,
              raw_version == 1 ? "uint16" : "uint32", tsize);
      pg_shard_close(s);
      return PG_ERR;
    }
    s->version = raw_version, s->ntokens = bytes / tsize, s->header = 0;
  } else {
    uint8_t hdr[PG_SHARD_HEADER_BYTES];
    int version;
    int64_t n;
    if (read_at(s, hdr, sizeof hdr, 0) || check_header(path, hdr, bytes, &version, &n)) {
      pg_shard_close(s);
      return PG_ERR;
    }
    s->version = version, s->ntokens = n, s->header = PG_SHARD_HEADER_BYTES;
  }
  /* One scan for the vocabulary, and for int32 range: tokens reach Lua and
   * the model as int32, so a uint32 token of 2^31 or more cannot be used. */
  int64_t limit = vocab > 0 ? vocab : 0;
  if (s->version == 7 && (limit == 0 || limit > INT32_MAX)) limit = (int64_t)INT32_MAX + 1;
  if (s->version == 1 && limit > 65535) limit = 0; /* a uint16 cannot reach it */
  if (limit > 0) {
    int32_t ids[CHUNK];
    for (int64_t i0 = 0; i0 < s->ntokens; i0 += CHUNK) {
      int64_t m = s->ntokens - i0 < CHUNK ? s->ntokens - i0 : CHUNK;
      if (read_tokens(s, i0, m, ids)) {
        pg_shard_close(s);
        return PG_ERR;
      }
      for (int64_t k = 0; k < m; k++) {
        /* an id read as int32 is negative exactly when its uint32 is 2^31 or more */
        int64_t t = ids[k] < 0 ? (int64_t)(uint32_t)ids[k] : ids[k];
        if (t >= limit) {
          if (vocab > 0 && t >= vocab)
            pg_fail("%s: token %lld at position %lld (counting from 0) is not below the vocabulary size %lld", path,
                    (long long)t, (long long)(i0 + k), (long long)vocab);
          else
            pg_fail("%s: token %lld at position %lld (counting from 0) does not fit an int32", path, (long long)t,
                    (long long)(i0 + k));
          pg_shard_close(s);
          return PG_ERR;
        }
      }
    }
  }
  return PG_OK;
}

int pg_shard_open(pg_shard *s, const char *path, int64_t vocab) { return shard_open(s, path, 0, vocab); }

int pg_shard_open_raw(pg_shard *s, const char *path, int version, int64_t vocab) {
  if (version != 1 && version != 7) {
    memset(s, 0, sizeof *s);
    s->fd = -1;
    return pg_fail("%s: unknown id width %d (expected 1 for uint16 or 7 for uint32)", path, version);
  }
  return shard_open(s, path, version, vocab);
}

void pg_shard_close(pg_shard *s) {
  if (s->fd >= 0) close(s->fd);
  free(s->path);
  memset(s, 0, sizeof *s);
  s->fd = -1;
}

/* pg_shard_read without pg_shard_check: for a caller that checked the file already */
static int shard_read_unchecked(const pg_shard *s, int64_t start, int64_t n, int32_t *out) {
  if (s->fd < 0) return pg_fail("the token shard is closed");
  if (start < 0 || n < 0 || start > s->ntokens || n > s->ntokens - start) /* start + n could wrap */
    return pg_fail("%s: %lld tokens from %lld are out of range (the shard has %lld)", s->path, (long long)n,
                   (long long)start, (long long)s->ntokens);
  return read_tokens(s, start, n, out);
}

int pg_shard_read(const pg_shard *s, int64_t start, int64_t n, int32_t *out) {
  if (s->fd >= 0 && pg_shard_check(s)) return PG_ERR;
  return shard_read_unchecked(s, start, n, out);
}

int pg_shard_info(const char *path, int *version, int64_t *ntokens) {
  struct stat st;
  int fd = open_checked(path, &st, PG_SHARD_HEADER_BYTES);
  if (fd < 0) return PG_ERR;
  long long bytes = (long long)st.st_size;
  uint8_t hdr[PG_SHARD_HEADER_BYTES];
  ssize_t got = pread(fd, hdr, sizeof hdr, 0);
  int e = errno;
  close(fd);
  if (got != (ssize_t)sizeof hdr) return pg_fail("%s: cannot read the header: %s", path, got < 0 ? strerror(e) : "short read");
  return check_header(path, hdr, bytes, version, ntokens);
}

static int write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

enum { WRITER_BUF = 1 << 16 };

int pg_shard_writer_open(pg_shard_writer *w, const char *path, int version) {
  memset(w, 0, sizeof *w);
  w->fd = -1;
  if (version != 1 && version != 7)
    return pg_fail("%s: unknown version %d (expected 1 for uint16 tokens or 7 for uint32 tokens)", path, version);
  size_t tlen = strlen(path) + 32;
  w->path = strdup(path);
  w->tmp = malloc(tlen);
  w->buf = malloc(WRITER_BUF);
  if (!w->path || !w->tmp || !w->buf) {
    free(w->path), free(w->tmp), free(w->buf);
    memset(w, 0, sizeof *w);
    w->fd = -1;
    return pg_fail("%s: out of memory", path);
  }
  snprintf(w->tmp, tlen, "%s.tmp.%ld", path, (long)getpid());
  w->version = version;
  w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    pg_fail("%s: cannot create %s: %s", path, w->tmp, strerror(errno));
    pg_shard_writer_abort(w);
    return PG_ERR;
  }
  /* the header's count is 0 until close: a file left by a crash reads as a shard of 0 tokens, never a wrong one */
  uint8_t hdr[PG_SHARD_HEADER_BYTES] = {0};
  put_le32(hdr, version == 1 ? PG_SHARD_MAGIC : PG_SHARD_MAGIC_U32);
  put_le32(hdr + 4, (uint32_t)version);
  if (write_all(w->fd, hdr, sizeof hdr)) {
    pg_fail("%s: cannot write %s: %s", path, w->tmp, strerror(errno));
    pg_shard_writer_abort(w);
    return PG_ERR;
  }
  return PG_OK;
}

static int writer_flush(pg_shard_writer *w) {
  if (w->nbuf && write_all(w->fd, w->buf, w->nbuf)) {
    pg_fail("%s: cannot write %s: %s", w->path, w->tmp, strerror(errno));
    pg_shard_writer_abort(w);
    return PG_ERR;
  }
  w->nbuf = 0;
  return PG_OK;
}

int pg_shard_writer_append(pg_shard_writer *w, const int32_t *ids, int64_t n) {
  if (w->fd < 0) return pg_fail("the shard writer is closed");
  if (n < 0 || n > INT32_MAX - w->ntokens)
    return pg_fail("%s: %lld more tokens do not fit one shard (at most %d, it has %lld)", w->path, (long long)n,
                   INT32_MAX, (long long)w->ntokens);
  size_t tsize = w->version == 1 ? 2 : 4;
  for (int64_t i = 0; i < n; i++) {
    int32_t v = ids[i];
    if (v < 0 || (tsize == 2 && v > 65535)) {
      pg_fail("%s: token %d at position %lld (counting from 0) %s", w->path, v, (long long)(w->ntokens + i),
              v < 0 ? "is negative" : "does not fit version 1 (uint16)");
      return PG_ERR; /* the shard is still whole up to here: the caller decides */
    }
  }
  for (int64_t i = 0; i < n; i++) {
    if (w->nbuf + tsize > WRITER_BUF && writer_flush(w)) return PG_ERR;
    uint8_t *p = w->buf + w->nbuf;
    uint32_t v = (uint32_t)ids[i];
    if (tsize == 2) {
      p[0] = (uint8_t)v;
      p[1] = (uint8_t)(v >> 8);
    } else {
      put_le32(p, v);
    }
    w->nbuf += tsize;
  }
  w->ntokens += n;
  return PG_OK;
}

int pg_shard_writer_close(pg_shard_writer *w) {
  if (w->fd < 0) return pg_fail("the shard writer is closed");
  if (writer_flush(w)) return PG_ERR;
  uint8_t count[4];
  put_le32(count, (uint32_t)w->ntokens);
  int failed = pwrite(w->fd, count, 4, 8) != 4;
  if (!failed) failed = fsync(w->fd);
  int e = errno;
  if (close(w->fd) && !failed) failed = 1, e = errno;
  w->fd = -1;
  if (!failed && rename(w->tmp, w->path)) failed = 1, e = errno;
  if (failed) {
    pg_fail("%s: cannot write: %s", w->path, strerror(e));
    pg_shard_writer_abort(w);
    return PG_ERR;
  }
  free(w->path), free(w->tmp), free(w->buf);
  memset(w, 0, sizeof *w);
  w->fd = -1;
  return PG_OK;
}

void pg_shard_writer_abort(pg_shard_writer *w) {
  if (w->fd >= 0) close(w->fd);
  if (w->tmp) unlink(w->tmp);
  free(w->path), free(w->tmp), free(w->buf);
  memset(w, 0, sizeof *w);
  w->fd = -1;
}

int pg_shard_write(const char *path, const int32_t *tokens, int64_t n, int version) {
  if (n < 0 || n > INT32_MAX)
    return pg_fail("%s: %lld tokens do not fit one shard (at most %d)", path, (long long)n, INT32_MAX);
  if (version != 0 && version != 1 && version != 7)
    return pg_fail("%s: unknown version %d (expected 1 for uint16 tokens or 7 for uint32 tokens)", path, version);
  if (version == 0) {
    version = 1;
    for (int64_t i = 0; i < n && version == 1; i++)
      if (tokens[i] > 65535) version = 7;
  }
  pg_shard_writer w;
  if (pg_shard_writer_open(&w, path, version)) return PG_ERR;
  if (pg_shard_writer_append(&w, tokens, n)) {
    pg_shard_writer_abort(&w);
    return PG_ERR;
  }
  return pg_shard_writer_close(&w);
}

int pg_data_is_glob(const char *s) { return strpbrk(s, "*?[") != NULL; }

int pg_data_glob(const char *pattern, char ***paths, int *n) {
  *paths = NULL;
  *n = 0;
  glob_t g;
  int rc = glob(pattern, 0, NULL, &g);
  if (rc == GLOB_NOMATCH) {
    globfree(&g);
    return pg_fail("%s: no files match", pattern);
  }
  if (rc != 0) {
    globfree(&g);
    return pg_fail("%s: cannot expand the pattern (glob error %d)", pattern, rc);
  }
  char **out = calloc(g.gl_pathc, sizeof *out);
  if (!out) {
    globfree(&g);
    return pg_fail("%s: out of memory", pattern);
  }
  for (size_t i = 0; i < g.gl_pathc; i++) {
    out[i] = strdup(g.gl_pathv[i]);
    if (!out[i]) {
      pg_data_free_paths(out, (int)i);
      globfree(&g);
      return pg_fail("%s: out of memory", pattern);
    }
  }
  *paths = out;
  *n = (int)g.gl_pathc;
  globfree(&g);
  return PG_OK;
}

void pg_data_free_paths(char **paths, int n) {
  for (int i = 0; i < n; i++) free(paths[i]);
  free(paths);
}

uint64_t pg_data_hash(const void *bytes, size_t n, uint64_t seed) {
  const uint8_t *p = bytes;
  uint64_t h = 0xcbf29ce484222325ULL ^ pg_mix64(seed);
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return pg_mix64(h ^ (uint64_t)n);
}

double pg_data_hash_unit(const void *bytes, size_t n, uint64_t seed) {
  return (double)(pg_data_hash(bytes, n, seed) >> 11) * (1.0 / 9007199254740992.0);
}

size_t pg_data_utf8_invalid_at(const void *bytes, size_t n) {
  const uint8_t *p = bytes;
  size_t i = 0;
  while (i < n) {
    /* ASCII runs 8 bytes at a time: the common case of text */
    while (i + 8 <= n) {
      uint64_t w;
      memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= n) break;
    uint8_t c = p[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t len;
    uint32_t lo = 0x80, hi = 0xBF; /* the allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0; /* no overlong forms */
      if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F; /* nothing above U+10FFFF */
    } else
      return i;
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; k++)
      if ((p[i + k] & 0xC0) != 0x80) return i;
    i += len;
  }
  return n;
}

/* ---- the loader ---- */

int pg_loader_init(pg_loader *ld, const char *const *paths, int nfiles, const pg_loader_config *cfg) {
  memset(ld, 0, sizeof *ld);
  ld->cfg = *cfg;
  ld->order_epoch = -1;
  if (nfiles < 1) return pg_fail("no token files given");
  if (cfg->seq_len < 1 || cfg->seq_len > INT32_MAX)
    return pg_fail("seq_len must be a positive integer below 2^31, got %lld", (long long)cfg->seq_len);
  if (cfg->batch < 1 || cfg->batch > INT32_MAX)
    return pg_fail("batch must be a positive integer below 2^31, got %lld", (long long)cfg->batch);
  if (cfg->dp_size < 1 || cfg->dp_rank < 0 || cfg->dp_rank >= cfg->dp_size)
    return pg_fail("data-parallel rank %d is out of range for size %d", cfg->dp_rank, cfg->dp_size);
  if (cfg->batch % cfg->dp_size)
    return pg_fail("batch %lld is not divisible by the data-parallel size %d (each data rank takes batch / %d rows)",
                   (long long)cfg->batch, cfg->dp_size, cfg->dp_size);
  ld->files = calloc((size_t)nfiles, sizeof *ld->files);
  ld->first_window = calloc((size_t)nfiles + 1, sizeof *ld->first_window);
  ld->checked = calloc((size_t)nfiles, sizeof *ld->checked);
  if (!ld->files || !ld->first_window || !ld->checked) {
    pg_loader_destroy(ld);
    return pg_fail("out of memory opening %d token files", nfiles);
  }
  for (int i = 0; i < nfiles; i++) ld->files[i].fd = -1;
  ld->nfiles = nfiles;
  /* a unit: a window of seq_len + 1 tokens, or (llm.c) a span of batch * seq_len tokens plus the last target */
  /* batch and seq_len are below 2^31 (checked above): their products fit an int64 */
  int64_t window = cfg->seq_len + 1, need = cfg->stride_llmc ? cfg->batch * cfg->seq_len + 1 : cfg->batch * window;
  int64_t step = cfg->stride_llmc ? cfg->batch * cfg->seq_len : window;
  for (int i = 0; i < nfiles; i++) {
    int rc = cfg->raw_version ? pg_shard_open_raw(&ld->files[i], paths[i], cfg->raw_version, cfg->vocab)
                              : pg_shard_open(&ld->files[i], paths[i], cfg->vocab);
    if (rc) {
      pg_loader_destroy(ld);
      return PG_ERR;
    }
    int64_t have = ld->files[i].ntokens;
    if (have < need) {
      if (cfg->stride_llmc)
        pg_fail("%s: too short for one batch: it has %lld tokens, but one batch of %lld rows of seq_len %lld "
                "(llm.c's stride) needs %lld",
                paths[i], (long long)have, (long long)cfg->batch, (long long)cfg->seq_len, (long long)need);
      else
        pg_fail("%s: too short for one batch: it has %lld tokens, but one batch of %lld rows of seq_len + 1 = %lld "
                "tokens needs %lld",
                paths[i], (long long)have, (long long)cfg->batch, (long long)window, (long long)need);
      pg_loader_destroy(ld);
      return PG_ERR;
    }
    /* windows: have / window; spans: every span needs one token past it, the next span's first */
    ld->first_window[i + 1] = ld->first_window[i] + (cfg->stride_llmc ? (have - 1) / step : have / window);
  }
  ld->nwindows = ld->first_window[nfiles];
  ld->batches_per_epoch = cfg->stride_llmc ? ld->nwindows : ld->nwindows / cfg->batch;
  ld->order = malloc((size_t)ld->nwindows * sizeof *ld->order);
  /* local * seq_len + 1 <= batch * seq_len + 1: fits (both below 2^31) */
  int64_t row_ids = cfg->stride_llmc ? cfg->batch / cfg->dp_size * cfg->seq_len + 1 : window;
  ld->row = malloc((size_t)row_ids * sizeof *ld->row);
  if (!ld->order || !ld->row) {
    pg_loader_destroy(ld);
    return pg_fail("out of memory for the order of %lld windows", (long long)ld->nwindows);
  }
  return PG_OK;
}

void pg_loader_destroy(pg_loader *ld) {
  for (int i = 0; i < ld->nfiles; i++) pg_shard_close(&ld->files[i]);
  free(ld->files);
  free(ld->first_window);
  free(ld->checked);
  free(ld->order);
  free(ld->row);
  memset(ld, 0, sizeof *ld);
  ld->order_epoch = -1;
}

/* The visiting order of `epoch`: identity, or a Fisher-Yates shuffle whose
 * every swap is drawn from (seed, epoch, step), so any rank, and any resumed
 * run, rebuilds the same order without carrying generator state. */
static void make_order(pg_loader *ld, int64_t epoch) {
  if (ld->order_epoch == epoch) return;
  int64_t n = ld->nwindows;
  for (int64_t i = 0; i < n; i++) ld->order[i] = i;
  if (ld->cfg.shuffle) {
    uint64_t key = pg_rng_subkey(pg_rng_key(ld->cfg.seed, "pg.data.TokenShards"), (uint64_t)epoch);
    for (int64_t i = n - 1; i > 0; i--) {
      int64_t j = (int64_t)(pg_u64_at(key, (uint64_t)i) % (uint64_t)(i + 1));
      int64_t t = ld->order[i];
      ld->order[i] = ld->order[j];
      ld->order[j] = t;
    }
  }
  ld->order_epoch = epoch;
}

/* The file holding window w: the last file whose first window is <= w. */
static int file_of(const pg_loader *ld, int64_t w) {
  int lo = 0, hi = ld->nfiles - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (ld->first_window[mid] <= w) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

int pg_loader_next(pg_loader *ld, int32_t *inputs, int32_t *targets) {
  if (!ld->files) return pg_fail("the token loader is closed");
  if (ld->index >= ld->batches_per_epoch) {
    ld->epoch++;
    ld->index = 0;
    return 0;
  }
  make_order(ld, ld->epoch);
  int64_t L = ld->cfg.seq_len, local = ld->cfg.batch / ld->cfg.dp_size;
  int32_t *row = ld->row;
  /* every file this batch reads is checked once (pg_shard_check: two stats), not once per row */
  ld->calls++;
  if (ld->cfg.stride_llmc) {
    int64_t u = ld->order[ld->index];
    int f = file_of(ld, u);
    int64_t off = (u - ld->first_window[f]) * ld->cfg.batch * L + (int64_t)ld->cfg.dp_rank * local * L;
    if (pg_shard_check(&ld->files[f]) || shard_read_unchecked(&ld->files[f], off, local * L + 1, row)) return PG_ERR;
    memcpy(inputs, row, (size_t)(local * L) * sizeof *row);
    memcpy(targets, row + 1, (size_t)(local * L) * sizeof *row);
    ld->index++;
    return 1;
  }
  int64_t row0 = ld->index * ld->cfg.batch + (int64_t)ld->cfg.dp_rank * local;
  for (int64_t r = 0; r < local; r++) {
    int64_t w = ld->order[row0 + r];
    int f = file_of(ld, w);
    if (ld->checked[f] != ld->calls) {
      if (pg_shard_check(&ld->files[f])) return PG_ERR;
      ld->checked[f] = ld->calls;
    }
    if (shard_read_unchecked(&ld->files[f], (w - ld->first_window[f]) * (L + 1), L + 1, row)) return PG_ERR;
    memcpy(inputs + r * L, row, (size_t)L * sizeof *row);
    memcpy(targets + r * L, row + 1, (size_t)L * sizeof *row);
  }
  ld->index++;
  return 1;
}

void pg_loader_reset(pg_loader *ld) { ld->index = 0; }

int pg_loader_seek(pg_loader *ld, int64_t epoch, int64_t index) {
  if (epoch < 0) return pg_fail("epoch %lld is negative", (long long)epoch);
  if (index < 0 || index > ld->batches_per_epoch)
    return pg_fail("batch index %lld is out of range: an epoch has %lld batches", (long long)index,
                   (long long)ld->batches_per_epoch);
  ld->epoch = epoch;
  ld->index = index;
  return PG_OK;
}
