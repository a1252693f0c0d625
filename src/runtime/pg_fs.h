/* pg_fs: directories and the process's terminal, for the library's Lua code
 * (checkpoints, metrics, callbacks) so that nothing shells out: a path with a
 * quote, a space or a leading dash is just a path.
 *
 * Errors name the path and the system's reason (PG_ERR + pg_error()). */
#ifndef PG_FS_H
#define PG_FS_H

/* 1 when something exists at path (a dangling link counts), else 0. */
int pg_fs_exists(const char *path);
/* What is at path, without following a link: 'f' regular file, 'l' link,
 * 'd' directory, 'o' other, 0 nothing (or not readable). */
char pg_fs_kind(const char *path);
/* 1 when path is a directory (following links), else 0. */
int pg_fs_is_dir(const char *path);
/* Creates path and its missing parents (mode 0777 & ~umask); an existing directory is fine. */
int pg_fs_mkdir_p(const char *path);
/* Removes path and everything below it, not following links; a missing path is fine.
 * Refuses "", "/", "." and ".." (and paths ending in "/." or "/.."). */
int pg_fs_remove_tree(const char *path);
/* The names in directory dir (no "." or ".."), sorted bytewise: *names is a
 * malloc'd array of malloc'd strings, *n its length; pg_fs_free_list frees it. */
int pg_fs_list(const char *dir, char ***names, int *n);
void pg_fs_free_list(char **names, int n);
/* Swaps what is at paths a and b (both must exist) in one step: Linux's
 * renameat2 with RENAME_EXCHANGE, so that a crash leaves one or the other at
 * each path, never neither. PG_ERR where the system or the file system
 * cannot (the caller falls back to two renames). */
int pg_fs_exchange(const char *a, const char *b);
/* 1 when the file descriptor is a terminal. */
int pg_fs_isatty(int fd);
/* 1 when this process's parent has a terminal on its descriptor fd (Linux's
 * /proc/<ppid>/fd; 0 where that cannot be told). Under Open MPI's mpirun on
 * one node the parent is mpirun, whose stdout is the user's: the rank's own
 * stdout is a pseudo-terminal of Open MPI's whatever mpirun writes to. */
int pg_fs_parent_isatty(int fd);

#endif
