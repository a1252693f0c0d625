/* Runs pg_cuda_selftest (src/backend/pg_cuda.c) against the emulator: prints the
 * report, exits 0 when every check passed. */
#include <stdio.h>

#include "pg_cuda.h"
#include "pg_error.h"

int main(void) {
  static char report[65536];
  int rc = pg_cuda_selftest(report, sizeof report);
  fputs(report, stdout);
  if (rc != PG_OK) fprintf(stderr, "%s\n", pg_error());
  return rc == PG_OK ? 0 : 1;
}
