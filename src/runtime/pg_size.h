/* pg_size: checked arithmetic on sizes, in one place.
 *
 * Sizes that come from users (tensor shapes, views, file offsets and counts,
 * model widths) are multiplied and added before anything is allocated or
 * indexed; a product that wraps around gives a small buffer and then writes
 * far past it (`pg.zeros{1<<32, 1<<32}` once made a tensor of 0 elements that
 * `set(3000, 7, 1)` wrote into). Every such product or sum goes through these
 * helpers, and a result that does not fit is an error at the caller, never a
 * wrapped value.
 *
 * PG_MAX_NUMEL bounds the elements of a tensor or runtime buffer: 8 bytes per
 * element (the widest dtype) times PG_MAX_NUMEL still fits int64 and size_t
 * with room for rounding up to alignments, so byte counts computed from a
 * checked element count cannot overflow either. */
#ifndef PG_SIZE_H
#define PG_SIZE_H

#include <stdint.h>

#define PG_MAX_NUMEL ((int64_t)1 << 59)

/* Nonzero when a * b (a + b) does not fit int64; *out is the product (sum)
 * otherwise. GCC's and clang's builtins: no division, no undefined behaviour. */
static inline int pg_mul_overflows(int64_t a, int64_t b, int64_t *out) { return __builtin_mul_overflow(a, b, out); }
static inline int pg_add_overflows(int64_t a, int64_t b, int64_t *out) { return __builtin_add_overflow(a, b, out); }

/* The product of n sizes (each >= 0), or -1 when it exceeds PG_MAX_NUMEL.
 * Zero sizes do not hide the others: the product of the nonzero sizes must fit
 * too, because loops over the dimensions before and after one of size 0
 * (outer x len x inner) multiply them on their own. */
static inline int64_t pg_size_product(int n, const int64_t *v) {
  int64_t all = 1, nonzero = 1;
  for (int i = 0; i < n; i++) {
    if (v[i] < 0) return -1;
    if (v[i] == 0) {
      all = 0;
      continue;
    }
    if (pg_mul_overflows(nonzero, v[i], &nonzero) || nonzero > PG_MAX_NUMEL) return -1;
  }
  return all ? nonzero : 0;
}

#endif
