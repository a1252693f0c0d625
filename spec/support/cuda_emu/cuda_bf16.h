/* cuda_emu/cuda_bf16.h — the emulator's __nv_bfloat16: the upper 16 bits of a float32 (as kernels.h's bf16),
 * with the two conversions of cuda_bf16.h the kernels may use. float -> bf16 rounds to nearest, ties to even,
 * as __float2bfloat16_rn (a NaN stays a quiet NaN); bf16 -> float is exact. Not the real header (see
 * cuda_runtime.h). */
#ifndef PG_CUDA_EMU_BF16_H
#define PG_CUDA_EMU_BF16_H

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  unsigned short __x;
};

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.__x << 16); }

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = __float_as_uint(f);
  __nv_bfloat16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) h.__x = (unsigned short)((u >> 16) | 0x40u);
  else h.__x = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return h;
}

#endif
