#include "pg_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char pg_error_message[2048];

const char *pg_error(void) { return pg_error_message; }

/* Formatted into a scratch buffer first: a caller may add context to the
 * message already there (pg_fail("loading %s: %s", name, pg_error())). */
static void set_message(const char *fmt, va_list ap) {
  char next[sizeof pg_error_message];
  vsnprintf(next, sizeof next, fmt, ap);
  memcpy(pg_error_message, next, sizeof next);
}

int pg_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(fmt, ap);
  va_end(ap);
  return PG_ERR;
}

void *pg_fail_null(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(fmt, ap);
  va_end(ap);
  return NULL;
}
