/* pg_error: how the library reports failure.
 *
 * The library never prints and never exits. A function that can fail returns
 * PG_ERR (or NULL) and leaves a message here; the caller (the Lua bindings)
 * turns it into a Lua error. The message is per thread, like errno. */
#ifndef PG_ERROR_H
#define PG_ERROR_H

#define PG_OK 0
#define PG_ERR (-1)

/* The last message set on this thread ("" when none). */
const char *pg_error(void);

/* Set the message (printf format) and return PG_ERR, so callers can write
 * `return pg_fail("...")`. */
int pg_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Same, returning NULL for functions that return pointers. */
void *pg_fail_null(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
