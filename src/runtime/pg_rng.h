/* pg_rng: counter-based random numbers.
 *
 * Every random value is a pure function of (key, index): there is no stream
 * state to carry, so any shard of a tensor can compute exactly its slice of
 * the serial tensor, and any rank can recompute any value. Keys are derived
 * from the user's seed and a name with pg_rng_key(). */
#ifndef PG_RNG_H
#define PG_RNG_H

#include <stdint.h>

/* A strong 64-bit mixing function (splitmix64's finaliser). */
uint64_t pg_mix64(uint64_t x);

/* FNV-1a hash of a string, mixed. */
uint64_t pg_hash_string(const char *s);

/* Key for a named stream under a seed: pg_rng_key(seed, "blocks.0.attn.qkv.weight"). */
uint64_t pg_rng_key(uint64_t seed, const char *name);

/* Combine a key with an integer (a rank, an epoch...). */
uint64_t pg_rng_subkey(uint64_t key, uint64_t n);

/* Uniform in [0, 1) with 24 random bits (exact in float). */
float pg_uniform_at(uint64_t key, uint64_t index);

/* Standard normal (Box-Muller over two independent uniforms). */
float pg_normal_at(uint64_t key, uint64_t index);

/* A uniform 64-bit integer. */
uint64_t pg_u64_at(uint64_t key, uint64_t index);

#endif
