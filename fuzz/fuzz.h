/* Fuzz targets: one function per file format a user can hand pipegoose.
 * Each takes the bytes of a whole file and must return (errors are fine:
 * they are Lua errors or PG_ERR) — a crash, a sanitizer report, a hang or
 * an allocation the size of a lie in the header is the bug. The same
 * targets run under libFuzzer (`make fuzz`, fuzz/main_libfuzzer.c) and as a
 * replay of the seed corpus in every test run (fuzz/main_replay.c,
 * spec/unit/fuzz_spec.lua). */
#ifndef PG_FUZZ_H
#define PG_FUZZ_H

#include <stddef.h>
#include <stdint.h>

/* The target chosen at build time (-DPG_FUZZ_TARGET=fuzz_<name>). */
int fuzz_safetensors(const uint8_t *data, size_t size);
int fuzz_manifest(const uint8_t *data, size_t size);
int fuzz_shard(const uint8_t *data, size_t size);
int fuzz_llmc(const uint8_t *data, size_t size);
int fuzz_tokenizer(const uint8_t *data, size_t size);
int fuzz_tokenizer_encode(const uint8_t *data, size_t size);

/* A scratch file holding data (one per process, rewritten each call); its path. */
const char *fuzz_file(const uint8_t *data, size_t size, const char *name);
/* Runs a Lua chunk with the file's path as `...` in a state that has
 * pipegoose loaded (created once); a Lua error is an accepted outcome. */
void fuzz_lua(const char *chunk, const char *path);

#endif
