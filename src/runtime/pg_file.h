/* pg_file: binary files — reading arrays at offsets, writing atomically.
 *
 * Writes go to "<path>.tmp.<pid>", are fsynced, then renamed over <path>, and
 * the directory is fsynced: a crash leaves either the old file or the new
 * one, never a torn one. Errors name the file and what went wrong. */
#ifndef PG_FILE_H
#define PG_FILE_H

#include <stddef.h>
#include <stdint.h>

/* Size of a file in bytes (PG_ERR if it cannot be stat'ed). */
int pg_file_size(const char *path, int64_t *size);
/* Reads exactly `bytes` at `offset` into buf; fails on a short file, naming sizes. */
int pg_file_read_at(const char *path, int64_t offset, void *buf, size_t bytes);

/* A file being written atomically. */
typedef struct pg_file_writer {
  char *path, *tmp;
  void *fp; /* FILE* */
  uint32_t crc;
  int64_t bytes;
} pg_file_writer;

int pg_file_writer_open(pg_file_writer *w, const char *path);
int pg_file_writer_write(pg_file_writer *w, const void *data, size_t bytes);
/* fsync, rename into place, fsync the directory. */
int pg_file_writer_commit(pg_file_writer *w);
/* Drops the temporary file (after an error). */
void pg_file_writer_abort(pg_file_writer *w);

/* CRC-32 (zlib's polynomial) of a buffer, continuing from crc (0 to start). */
uint32_t pg_crc32(uint32_t crc, const void *data, size_t bytes);
/* CRC-32 and size of a whole file. */
int pg_file_crc32(const char *path, uint32_t *crc, int64_t *size);
/* fsync a directory (after renames inside it). */
int pg_fsync_dir(const char *dir);

/* Creates path exclusively (O_EXCL) holding `bytes` of data, fsynced; when
 * the file already exists nothing is written and *exists = 1 (PG_OK). */
int pg_file_create_exclusive(const char *path, const void *data, size_t bytes, int *exists);
/* The absolute path with every symbolic link and ".." resolved (realpath(3));
 * out holds PATH_MAX bytes. */
int pg_file_realpath(const char *path, char *out);

#endif
