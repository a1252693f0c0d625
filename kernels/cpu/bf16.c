/* bfloat16 and float16 conversions, and the int8 block coding (kernels.h). The bf16 GEMMs are the CPU backend's
 * (src/backend/cpu_bf16_gemm.c): they probe the CPU and keep oneDNN's state
 * and scratch, which kernels do not. */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

void pg_int8_encode(uint32_t *words, const float *src, int64_t nblocks, int64_t block) {
  for (int64_t b = 0; b < nblocks; b++) {
    const float *v = src + b * block;
    uint32_t *o = words + b * (1 + block / 4);
    float amax = 0;
    for (int64_t i = 0; i < block; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    float sc = amax / 127.0f;
    memcpy(&o[0], &sc, 4);
    for (int64_t i = 0; i < block; i += 4) {
      uint32_t word = 0;
      for (int j = 0; j < 4; j++) {
        long q = sc > 0 ? lrintf(v[i + j] / sc) : 0;
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        word |= (uint32_t)(uint8_t)(int8_t)q << (8 * j);
      }
      o[1 + i / 4] = word;
    }
  }
}

void pg_int8_decode(float *dst, const uint32_t *words, int64_t nblocks, int64_t block) {
  for (int64_t b = 0; b < nblocks; b++) {
    const uint32_t *o = words + b * (1 + block / 4);
    float sc;
    memcpy(&sc, &o[0], 4);
    for (int64_t i = 0; i < block; i++)
      dst[b * block + i] = (float)(int8_t)(uint8_t)(o[1 + i / 4] >> (8 * (i % 4))) * sc;
  }
}
