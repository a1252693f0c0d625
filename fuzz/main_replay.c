/* Runs the target picked with -DPG_FUZZ_TARGET once on every file named on
 * the command line (the seed corpus, in every test run): exit 0 when all
 * returned, whatever they thought of the files. */
#include <stdio.h>
#include <stdlib.h>

#include "fuzz.h"

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    FILE *f = fopen(argv[i], "rb");
    if (!f) {
      fprintf(stderr, "replay: cannot open %s\n", argv[i]);
      return 2;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
      fprintf(stderr, "replay: cannot read %s\n", argv[i]);
      return 2;
    }
    fclose(f);
    PG_FUZZ_TARGET(buf, (size_t)n);
    free(buf);
  }
  printf("replayed %d inputs\n", argc - 1);
  return 0;
}
