#define _POSIX_C_SOURCE 200809L
#include "pg_data.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
    return pg_fail("%s: bad magic number %d (expected %d): not an llm.c token shard", path, magic, PG_SHARD_MAGIC);
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

/* Opens path read-only and checks it is a regular file with room for a header. */
static int open_checked(const char *path, long long *bytes) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return pg_fail("%s: cannot open: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st)) {
    int e = errno;
    close(fd);
    return pg_fail("%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return pg_fail("%s: not a regular file", path);
  }
  if (st.st_size < PG_SHARD_HEADER_BYTES) {
    close(fd);
    return pg_fail("%s: too small for a token shard: %lld bytes, but the header alone is %d bytes", path,
                   (long long)st.st_size, PG_SHARD_HEADER_BYTES);
  }
  *bytes = (long long)st.st_size;
  return fd;
}

int pg_shard_open(pg_shard *s, const char *path, int64_t vocab) {
  memset(s, 0, sizeof *s);
  long long bytes;
  int fd = open_checked(path, &bytes);
  if (fd < 0) return PG_ERR;
  void *map = mmap(NULL, (size_t)bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int e = errno;
  close(fd); /* the mapping keeps the file */
  if (map == MAP_FAILED) return pg_fail("%s: cannot map: %s", path, strerror(e));
  int version;
  int64_t n;
  if (check_header(path, map, bytes, &version, &n)) {
    munmap(map, (size_t)bytes);
    return PG_ERR;
  }
  s->map = map;
  s->map_bytes = (size_t)bytes;
  s->version = version;
  s->ntokens = n;
  s->tokens = (const uint8_t *)map + PG_SHARD_HEADER_BYTES;
  /* One scan for the vocabulary, and for int32 range: tokens reach Lua and
   * the model as int32, so a uint32 token of 2^31 or more cannot be used. */
  int64_t limit = vocab > 0 ? vocab : 0;
  if (version == 7 && (limit == 0 || limit > INT32_MAX)) limit = (int64_t)INT32_MAX + 1;
  if (version == 1 && limit > 65535) limit = 0; /* a uint16 cannot reach it */
  if (limit > 0) {
    for (int64_t i = 0; i < n; i++) {
      uint32_t t = pg_shard_token(s, i);
      if ((int64_t)t >= limit) {
        if (vocab > 0 && (int64_t)t >= vocab)
          pg_fail("%s: token %u at position %lld (counting from 0) is not below the vocabulary size %lld", path, t,
                  (long long)i, (long long)vocab);
        else
          pg_fail("%s: token %u at position %lld (counting from 0) does not fit an int32", path, t, (long long)i);
        munmap(map, (size_t)bytes);
        memset(s, 0, sizeof *s);
        return PG_ERR;
      }
    }
  }
  s->path = strdup(path);
  if (!s->path) {
    munmap(map, (size_t)bytes);
    memset(s, 0, sizeof *s);
    return pg_fail("%s: out of memory", path);
  }
  return PG_OK;
}

void pg_shard_close(pg_shard *s) {
  if (s->map) munmap(s->map, s->map_bytes);
  free(s->path);
  memset(s, 0, sizeof *s);
}

int pg_shard_read(const pg_shard *s, int64_t start, int64_t n, int32_t *out) {
  if (start < 0 || n < 0 || start > s->ntokens || n > s->ntokens - start) /* start + n could wrap */
    return pg_fail("%s: %lld tokens from %lld are out of range (the shard has %lld)", s->path, (long long)n,
                   (long long)start, (long long)s->ntokens);
  for (int64_t i = 0; i < n; i++) out[i] = (int32_t)pg_shard_token(s, start + i);
  return PG_OK;
}

int pg_shard_info(const char *path, int *version, int64_t *ntokens) {
  long long bytes;
  int fd = open_checked(path, &bytes);
  if (fd < 0) return PG_ERR;
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

int pg_shard_write(const char *path, const int32_t *tokens, int64_t n, int version) {
  if (n < 0 || n > INT32_MAX)
    return pg_fail("%s: %lld tokens do not fit one shard (at most %d)", path, (long long)n, INT32_MAX);
  if (version != 0 && version != 1 && version != 7)
    return pg_fail("%s: unknown version %d (expected 1 for uint16 tokens or 7 for uint32 tokens)", path, version);
  int64_t first_wide = -1; /* first token that needs uint32 */
  for (int64_t i = 0; i < n; i++) {
    if (tokens[i] < 0)
      return pg_fail("%s: token %d at position %lld (counting from 0) is negative", path, tokens[i], (long long)i);
    if (tokens[i] > 65535 && first_wide < 0) first_wide = i;
  }
  if (version == 0) version = first_wide < 0 ? 1 : 7;
  if (version == 1 && first_wide >= 0)
    return pg_fail("%s: token %d at position %lld (counting from 0) does not fit version 1 (uint16)", path,
                   tokens[first_wide], (long long)first_wide);

  size_t tlen = strlen(path) + 32;
  char *tmp = malloc(tlen);
  if (!tmp) return pg_fail("%s: out of memory", path);
  snprintf(tmp, tlen, "%s.tmp.%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    pg_fail("%s: cannot create %s: %s", path, tmp, strerror(errno));
    free(tmp);
    return PG_ERR;
  }
  uint8_t hdr[PG_SHARD_HEADER_BYTES] = {0};
  put_le32(hdr, PG_SHARD_MAGIC);
  put_le32(hdr + 4, (uint32_t)version);
  put_le32(hdr + 8, (uint32_t)n);
  int failed = write_all(fd, hdr, sizeof hdr);
  /* Tokens go out in chunks, converted to the file's width and byte order. */
  enum { CHUNK = 1 << 15 };
  uint8_t *buf = malloc(CHUNK * 4);
  if (!buf) failed = 1, errno = ENOMEM;
  size_t tsize = version == 1 ? 2 : 4;
  for (int64_t i = 0; i < n && !failed; i += CHUNK) {
    int64_t m = n - i < CHUNK ? n - i : CHUNK;
    for (int64_t k = 0; k < m; k++) {
      uint32_t v = (uint32_t)tokens[i + k];
      if (tsize == 2) {
        buf[2 * k] = (uint8_t)v;
        buf[2 * k + 1] = (uint8_t)(v >> 8);
      } else {
        put_le32(buf + 4 * k, v);
      }
    }
    failed = write_all(fd, buf, (size_t)m * tsize);
  }
  free(buf);
  if (!failed) failed = fsync(fd);
  int e = errno;
  if (close(fd) && !failed) failed = 1, e = errno;
  if (!failed && rename(tmp, path)) failed = 1, e = errno;
  if (failed) {
    unlink(tmp);
    pg_fail("%s: cannot write: %s", path, strerror(e));
    free(tmp);
    return PG_ERR;
  }
  free(tmp);
  return PG_OK;
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
  if (!ld->files || !ld->first_window) {
    pg_loader_destroy(ld);
    return pg_fail("out of memory opening %d token files", nfiles);
  }
  ld->nfiles = nfiles;
  int64_t window = cfg->seq_len + 1, need = cfg->batch * window;
  for (int i = 0; i < nfiles; i++) {
    if (pg_shard_open(&ld->files[i], paths[i], cfg->vocab)) {
      pg_loader_destroy(ld);
      return PG_ERR;
    }
    int64_t have = ld->files[i].ntokens;
    if (have < need) {
      pg_fail("%s: too short for one batch: it has %lld tokens, but one batch of %lld rows of seq_len + 1 = %lld "
              "tokens needs %lld",
              paths[i], (long long)have, (long long)cfg->batch, (long long)window, (long long)need);
      pg_loader_destroy(ld);
      return PG_ERR;
    }
    ld->first_window[i + 1] = ld->first_window[i] + have / window;
  }
  ld->nwindows = ld->first_window[nfiles];
  ld->batches_per_epoch = ld->nwindows / cfg->batch;
  ld->order = malloc((size_t)ld->nwindows * sizeof *ld->order);
  if (!ld->order) {
    pg_loader_destroy(ld);
    return pg_fail("out of memory for the order of %lld windows", (long long)ld->nwindows);
  }
  return PG_OK;
}

void pg_loader_destroy(pg_loader *ld) {
  for (int i = 0; i < ld->nfiles; i++) pg_shard_close(&ld->files[i]);
  free(ld->files);
  free(ld->first_window);
  free(ld->order);
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
  int64_t row0 = ld->index * ld->cfg.batch + (int64_t)ld->cfg.dp_rank * local;
  for (int64_t r = 0; r < local; r++) {
    int64_t w = ld->order[row0 + r];
    int f = file_of(ld, w);
    const pg_shard *s = &ld->files[f];
    int64_t off = (w - ld->first_window[f]) * (L + 1);
    int32_t *in = inputs + r * L, *tg = targets + r * L;
    int32_t prev = (int32_t)pg_shard_token(s, off);
    for (int64_t t = 0; t < L; t++) {
      int32_t next = (int32_t)pg_shard_token(s, off + t + 1);
      in[t] = prev;
      tg[t] = next;
      prev = next;
    }
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
