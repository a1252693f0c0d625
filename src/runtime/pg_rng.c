#include "pg_rng.h"

#include <math.h>

uint64_t pg_mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t pg_hash_string(const char *s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (; *s; s++) {
    h ^= (unsigned char)*s;
    h *= 0x100000001b3ULL;
  }
  return pg_mix64(h);
}

uint64_t pg_rng_key(uint64_t seed, const char *name) {
  return pg_mix64(pg_mix64(seed) ^ pg_hash_string(name));
}

uint64_t pg_rng_subkey(uint64_t key, uint64_t n) { return pg_mix64(key ^ pg_mix64(n + 0x51ed27ULL)); }

uint64_t pg_u64_at(uint64_t key, uint64_t index) { return pg_mix64(key ^ pg_mix64(index)); }

float pg_uniform_at(uint64_t key, uint64_t index) {
  return (float)(pg_u64_at(key, index) >> 40) * (1.0f / 16777216.0f);
}

float pg_normal_at(uint64_t key, uint64_t index) {
  /* Two uniforms from disjoint counters; u1 in (0, 1] so log() is finite. */
  uint64_t a = pg_u64_at(key, 2 * index), b = pg_u64_at(key, 2 * index + 1);
  double u1 = ((double)(a >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  double u2 = (double)(b >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
