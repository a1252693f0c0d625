/* bfloat16 and float16 conversions (kernels.h). The bf16 GEMMs are the CPU backend's
 * (src/backend/cpu_bf16_gemm.c): they probe the CPU and keep oneDNN's state
 * and scratch, which kernels do not. */
#include <stdint.h>

#include "kernels.h"
#include "pg_cpu.h"

void pg_bf16_from_f32(uint16_t *dst, const float *src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) dst[i] = pg_bf16_round(src[i]);
}

void pg_bf16_to_f32(float *dst, const uint16_t *src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) dst[i] = pg_bf16_value(src[i]);
}

void pg_f16_to_f32(float *dst, const uint16_t *src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) dst[i] = pg_f16_value(src[i]);
}
