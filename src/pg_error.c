#include "pg_error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char pg_error_message[2048];

const char *pg_error(void) { return pg_error_message; }

int pg_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pg_error_message, sizeof pg_error_message, fmt, ap);
  va_end(ap);
  return PG_ERR;
}

void *pg_fail_null(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pg_error_message, sizeof pg_error_message, fmt, ap);
  va_end(ap);
  return NULL;
}
