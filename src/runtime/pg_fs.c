#define _XOPEN_SOURCE 700 /* nftw */
#define _GNU_SOURCE       /* syscall (renameat2 for pg_fs_exchange) */
#include "pg_fs.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <dirent.h>
#include <unistd.h>

#include "pg_error.h"

int pg_fs_exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

char pg_fs_kind(const char *path) {
  struct stat st;
  if (lstat(path, &st)) return 0;
  if (S_ISLNK(st.st_mode)) return 'l';
  if (S_ISREG(st.st_mode)) return 'f';
  if (S_ISDIR(st.st_mode)) return 'd';
  return 'o';
}

int pg_fs_is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int pg_fs_mkdir_p(const char *path) {
  size_t n = strlen(path);
  if (n == 0) return pg_fail("mkdir: empty path");
  char *p = malloc(n + 1);
  if (!p) return pg_fail("out of memory");
  memcpy(p, path, n + 1);
  /* each prefix ending before a '/', then the whole path */
  for (size_t i = 1; i <= n; i++) {
    if (i < n && p[i] != '/') continue;
    char c = p[i];
    p[i] = '\0';
    if (mkdir(p, 0777) != 0 && errno != EEXIST) {
      int e = errno;
      p[i] = c;
      free(p);
      return pg_fail("mkdir %s: %s", path, strerror(e));
    }
    p[i] = c;
  }
  free(p);
  return pg_fs_is_dir(path) ? PG_OK : pg_fail("mkdir %s: exists and is not a directory", path);
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
  (void)st;
  (void)type;
  (void)ftw;
  return remove(path) == 0 || errno == ENOENT ? 0 : errno;
}

/* "", "/", ".", "..", or ending in "/." or "/..": never removed (a bug upstream, not a request). */
static int refused(const char *path) {
  size_t n = strlen(path);
  while (n > 1 && path[n - 1] == '/') n--;
  if (n == 0 || (n == 1 && path[0] == '/')) return 1;
  const char *last = path + n;
  const char *slash = last;
  while (slash > path && slash[-1] != '/') slash--;
  size_t len = (size_t)(last - slash);
  return (len == 1 && slash[0] == '.') || (len == 2 && slash[0] == '.' && slash[1] == '.');
}

int pg_fs_remove_tree(const char *path) {
  if (refused(path)) return pg_fail("remove_tree: refusing to remove '%s'", path);
  if (!pg_fs_exists(path)) return PG_OK;
  /* depth first, links themselves rather than their targets */
  int rc = nftw(path, remove_entry, 32, FTW_DEPTH | FTW_PHYS);
  if (rc != 0) return pg_fail("remove_tree %s: %s", path, strerror(rc > 0 ? rc : errno));
  return PG_OK;
}

static int by_bytes(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

void pg_fs_free_list(char **names, int n) {
  for (int i = 0; i < n; i++) free(names[i]);
  free(names);
}

int pg_fs_list(const char *dir, char ***names, int *n) {
  *names = NULL;
  *n = 0;
  DIR *d = opendir(dir);
  if (!d) return pg_fail("list %s: %s", dir, strerror(errno));
  int cap = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    if (*n == cap) {
      cap = cap ? 2 * cap : 16;
      char **grown = realloc(*names, (size_t)cap * sizeof *grown);
      if (!grown) goto oom;
      *names = grown;
    }
    if (!((*names)[*n] = strdup(e->d_name))) goto oom;
    (*n)++;
  }
  closedir(d);
  if (*n) qsort(*names, (size_t)*n, sizeof **names, by_bytes);
  return PG_OK;
oom:
  closedir(d);
  pg_fs_free_list(*names, *n);
  *names = NULL;
  *n = 0;
  return pg_fail("out of memory");
}

int pg_fs_isatty(int fd) { return isatty(fd) == 1; }

int pg_fs_parent_isatty(int fd) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%ld/fd/%d", (long)getppid(), fd);
  struct stat st;
  /* only a character device is opened (never a pipe or a file of the parent's), and never as a controlling tty */
  if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode)) return 0;
  int f = open(path, O_RDONLY | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
  if (f < 0) return 0;
  int tty = isatty(f) == 1;
  close(f);
  return tty;
}

int pg_fs_exchange(const char *a, const char *b) {
#ifdef SYS_renameat2
  /* RENAME_EXCHANGE (linux/fs.h: 1 << 1), spelt here so that no kernel header is needed */
  if (syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, 1u << 1) == 0) return PG_OK;
  return pg_fail("exchange %s and %s: %s", a, b, strerror(errno));
#else
  return pg_fail("exchange %s and %s: renameat2 is not available here", a, b);
#endif
}
