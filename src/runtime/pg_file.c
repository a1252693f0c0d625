#define _DEFAULT_SOURCE /* realpath */
#include "pg_file.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "pg_error.h"
#include "pg_size.h"

int pg_file_size(const char *path, int64_t *size) {
  struct stat st;
  if (stat(path, &st) != 0) return pg_fail("%s: %s", path, strerror(errno));
  *size = (int64_t)st.st_size;
  return PG_OK;
}

int pg_file_read_at(const char *path, int64_t offset, void *buf, size_t bytes) {
  int64_t end;
  if (offset < 0 || bytes > (size_t)INT64_MAX || pg_add_overflows(offset, (int64_t)bytes, &end))
    return pg_fail("%s: %zu bytes at offset %lld are past any file's end", path, bytes, (long long)offset);
  int fd = open(path, O_RDONLY);
  if (fd < 0) return pg_fail("%s: %s", path, strerror(errno));
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = pread(fd, (char *)buf + done, bytes - done, (off_t)(offset + (int64_t)done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int64_t size = 0;
      struct stat st;
      if (fstat(fd, &st) == 0) size = st.st_size;
      close(fd);
      if (n < 0) return pg_fail("%s: %s", path, strerror(errno));
      return pg_fail("%s: truncated: needs %lld bytes at offset %lld, but the file has %lld bytes", path,
                     (long long)bytes, (long long)offset, (long long)size);
    }
    done += (size_t)n;
  }
  close(fd);
  return PG_OK;
}

uint32_t pg_crc32(uint32_t crc, const void *data, size_t bytes) {
  const unsigned char *p = data;
  while (bytes > 0) { /* zlib takes uInt lengths */
    uInt n = bytes > (1u << 30) ? (1u << 30) : (uInt)bytes;
    crc = (uint32_t)crc32(crc, p, n);
    p += n;
    bytes -= n;
  }
  return crc;
}

int pg_file_crc32(const char *path, uint32_t *crc, int64_t *size) {
  FILE *f = fopen(path, "rb");
  if (!f) return pg_fail("%s: %s", path, strerror(errno));
  static const size_t chunk = 1 << 20;
  unsigned char *buf = malloc(chunk);
  if (!buf) {
    fclose(f);
    return pg_fail("out of memory");
  }
  uint32_t c = 0;
  int64_t total = 0;
  size_t n;
  while ((n = fread(buf, 1, chunk, f)) > 0) {
    c = pg_crc32(c, buf, n);
    total += (int64_t)n;
  }
  int bad = ferror(f);
  free(buf);
  fclose(f);
  if (bad) return pg_fail("%s: read error", path);
  *crc = c;
  *size = total;
  return PG_OK;
}

int pg_fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY);
  if (fd < 0) return pg_fail("%s: %s", dir, strerror(errno));
  int rc = fsync(fd);
  close(fd);
  return rc == 0 || errno == EINVAL ? PG_OK : pg_fail("%s: fsync: %s", dir, strerror(errno));
}

int pg_file_writer_open(pg_file_writer *w, const char *path) {
  memset(w, 0, sizeof *w);
  size_t n = strlen(path) + 32;
  w->path = strdup(path);
  w->tmp = malloc(n);
  if (!w->path || !w->tmp) {
    free(w->path);
    free(w->tmp);
    return pg_fail("out of memory");
  }
  snprintf(w->tmp, n, "%s.tmp.%ld", path, (long)getpid());
  w->fp = fopen(w->tmp, "wb");
  if (!w->fp) {
    int rc = pg_fail("%s: cannot create: %s", w->tmp, strerror(errno));
    free(w->path);
    free(w->tmp);
    w->path = w->tmp = NULL;
    return rc;
  }
  return PG_OK;
}

int pg_file_writer_write(pg_file_writer *w, const void *data, size_t bytes) {
  if (bytes && fwrite(data, 1, bytes, w->fp) != bytes) return pg_fail("%s: write failed: %s", w->tmp, strerror(errno));
  w->crc = pg_crc32(w->crc, data, bytes);
  w->bytes += (int64_t)bytes;
  return PG_OK;
}

void pg_file_writer_abort(pg_file_writer *w) {
  if (w->fp) fclose(w->fp);
  if (w->tmp) unlink(w->tmp);
  free(w->path);
  free(w->tmp);
  memset(w, 0, sizeof *w);
}

int pg_file_writer_commit(pg_file_writer *w) {
  FILE *f = w->fp;
  if (fflush(f) != 0 || fsync(fileno(f)) != 0) {
    int rc = pg_fail("%s: flush failed: %s", w->tmp, strerror(errno));
    pg_file_writer_abort(w);
    return rc;
  }
  fclose(f);
  w->fp = NULL;
  if (rename(w->tmp, w->path) != 0) {
    int rc = pg_fail("%s: cannot rename into place: %s", w->path, strerror(errno));
    pg_file_writer_abort(w);
    return rc;
  }
  char *d = strdup(w->path);
  int rc = d ? pg_fsync_dir(dirname(d)) : PG_OK;
  free(d);
  free(w->path);
  free(w->tmp);
  memset(w, 0, sizeof *w);
  return rc;
}

/* Lock files need O_EXCL, which C's fopen and Lua's io.open do not offer:
 * the file either did not exist and is now ours, or it existed and is left
 * untouched (*exists = 1, no error). The text is fsynced before returning so
 * that a reader after a crash sees the whole record or an empty file. */
int pg_file_create_exclusive(const char *path, const void *data, size_t bytes, int *exists) {
  *exists = 0;
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) {
      *exists = 1;
      return PG_OK;
    }
    return pg_fail("%s: cannot create: %s", path, strerror(errno));
  }
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = write(fd, (const char *)data + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int rc = pg_fail("%s: write failed: %s", path, strerror(errno));
      close(fd);
      unlink(path);
      return rc;
    }
    done += (size_t)n;
  }
  if (fsync(fd) != 0) {
    int rc = pg_fail("%s: fsync: %s", path, strerror(errno));
    close(fd);
    unlink(path);
    return rc;
  }
  close(fd);
  return PG_OK;
}

/* realpath(3) into out (PATH_MAX bytes): every link and ".." resolved, so
 * that a checkpoint's file can be confined to its directory. */
int pg_file_realpath(const char *path, char *out) {
  if (!realpath(path, out)) return pg_fail("%s: %s", path, strerror(errno));
  return PG_OK;
}
