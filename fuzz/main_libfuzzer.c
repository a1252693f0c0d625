/* libFuzzer's entry point for the target picked with -DPG_FUZZ_TARGET. */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return PG_FUZZ_TARGET(data, size); }
