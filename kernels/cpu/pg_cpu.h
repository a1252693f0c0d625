/* pg_cpu.h — helpers shared by the CPU kernels (private to kernels/cpu).
 *
 * The inline math here is written so that GCC vectorises the loops that call
 * it (no calls, no data-dependent branches; the Makefile builds the kernels
 * with -fno-trapping-math -fno-math-errno so that selects become blends and
 * sqrtf an instruction). ISO C mode (-std=c11) keeps FMA contraction off, so
 * the arithmetic is the same on every x86-64 vector width. Sums use a fixed number
 * of explicit lanes, so their rounding does not depend on the vector width the
 * compiler picks: the same bits on every machine running the same code. */
#ifndef PG_CPU_H
#define PG_CPU_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Below this many elements of work a parallel region costs more than it saves.
 * On a combined "parallel for simd" the guard must be written
 * if (parallel : ...): a bare if clause applies to every constituent
 * construct (OpenMP 5.0), so a false condition also turns off the simd and
 * GCC runs the scalar loop (AdamW and GELU ran 4-7x slower per element at
 * n = 32768 than at 32769). */
#define PG_PAR_MIN 32768

/* Columns [*c0, *c1) of C that thread tid of nth owns, in whole 16-float
 * (64-byte) blocks so that no two threads write the same cache line. Used by
 * the row reductions: each thread sums all rows, in order, for its columns,
 * so the result does not depend on the thread count at all. */
static inline void pg_cpu_cols(int C, int tid, int nth, int *c0, int *c1) {
  int64_t blocks = (C + 15) / 16;
  int64_t b0 = blocks * tid / nth, b1 = blocks * (tid + 1) / nth;
  *c0 = (int)(b0 * 16 < C ? b0 * 16 : C);
  *c1 = (int)(b1 * 16 < C ? b1 * 16 : C);
}

static inline int pg_cpu_min(int a, int b) { return a < b ? a : b; }

/* e^x in float, within about 1.2 ulp of the exact value on [-87.3, 88]
 * (checked against double exp on every float there); 0 below -87.3 (true
 * value < 1.2e-38), +inf above 88, NaN stays NaN. glibc's expf does not
 * vectorise here and costs ~20 ns; this does. Method: x = k ln2 + r with
 * |r| <= ln2/2 (ln2 split in two parts so k ln2 is exact), e^r by its
 * degree-7 Taylor polynomial (truncation < 6e-9), 2^k built in the exponent
 * bits. The 1.5 * 2^23 shift rounds x log2(e) to the integer k and leaves k
 * in the low mantissa bits. */
static inline float pg_cpu_expf(float x) {
  const float shift = 12582912.0f;
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.0f ? 88.0f : xc;
  float t = xc * 1.44269504088896341f + shift;
  float kf = t - shift;
  float r = xc - kf * 0.693359375f; /* ln2 = 0.693359375 - 2.12194440e-4 */
  r = r + kf * 2.12194440e-4f;
  float p = 1.0f / 5040.0f + r * (1.0f / 40320.0f);
  p = 1.0f / 720.0f + r * p;
  p = 1.0f / 120.0f + r * p;
  p = 1.0f / 24.0f + r * p;
  p = 1.0f / 6.0f + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  uint32_t bits;
  memcpy(&bits, &t, sizeof bits);
  bits = (bits - 0x4B400000u + 127u) << 23; /* (k + 127) in the exponent field; k in [-126, 127] */
  float s;
  memcpy(&s, &bits, sizeof s);
  float y = p * s;
  y = x < -87.3f ? 0.0f : y;
  y = x > 88.0f ? INFINITY : y;
  return y;
}

#define PG_LANES 8

/* Sum of n floats with 8 float lanes added in a fixed order. */
static inline float pg_cpu_sumf(const float *x, int n) {
  float lane[PG_LANES] = {0};
  int i = 0;
  for (; i + PG_LANES <= n; i += PG_LANES)
    for (int j = 0; j < PG_LANES; j++) lane[j] += x[i + j];
  for (; i < n; i++) lane[0] += x[i];
  float s = 0.0f;
  for (int j = 0; j < PG_LANES; j++) s += lane[j];
  return s;
}

/* Dot product of n floats, 8 float lanes, fixed order. */
static inline float pg_cpu_dotf(const float *a, const float *b, int n) {
  float lane[PG_LANES] = {0};
  int i = 0;
  for (; i + PG_LANES <= n; i += PG_LANES)
    for (int j = 0; j < PG_LANES; j++) lane[j] += a[i + j] * b[i + j];
  for (; i < n; i++) lane[0] += a[i] * b[i];
  float s = 0.0f;
  for (int j = 0; j < PG_LANES; j++) s += lane[j];
  return s;
}

/* Largest of n >= 1 floats (exact in any order). */
static inline float pg_cpu_maxf(const float *x, int n) {
  float m = x[0];
#pragma omp simd reduction(max : m)
  for (int i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

#endif
