/* pg_cpu_bf16_gemm: the CPU backend's bf16 GEMMs (src/backend/cpu_bf16_gemm.c). */
#ifndef PG_CPU_BF16_GEMM_H
#define PG_CPU_BF16_GEMM_H

#include <stdint.h>

/* bf16 GEMMs with float32 accumulation and float32 results. Two paths with
 * the same result kind (products of bf16 inputs summed in float32; the order
 * of the sums differs):
 *   onednn    oneDNN's matmul primitive (bf16 x bf16 -> f32), chosen when
 *             oneDNN's ISA reaches avx512_core_bf16 and the CPU has AMX-BF16,
 *             or AVX512_BF16 dot products that outrun float32 FMA by 1.25x
 *             (measured once, ~3 ms: some cores issue them at half the FMA's
 *             flops, and oneDNN's matmul then runs at half of sgemm's rate);
 *   fallback  the bf16 inputs widened to float32 (exact) in blocks, and
 *             OpenBLAS sgemm.
 * pg_bf16_gemm_path() names the path in use and *why (a sentence); the
 * selection is made once, at the first call. pg_bf16_gemm_select("auto" |
 * "onednn" | "fallback") overrides it (tests run both paths): PG_OK, or
 * PG_ERR when the name is unknown or oneDNN cannot run here (*why says so).
 * The GEMMs return 0, or -1 when out of memory or oneDNN fails (*why of
 * pg_bf16_gemm_path then names the failure). Scratch is allocated inside
 * (the fallback's two 8 MiB panels, kept; oneDNN's own). */
const char *pg_bf16_gemm_path(const char **why);
int pg_bf16_gemm_select(const char *name, const char **why);
const char *pg_bf16_gemm_error(void);
/* out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias[OC] if not NULL). */
int pg_matmul_bf16_forward(float *out, const uint16_t *inp, const uint16_t *weight, const float *bias, int N, int C,
                           int OC);
/* dinp[N,C] = dout @ weight (overwritten, NULL: skip); dweight[OC,C] += dout^T @ inp (NULL: skip).
 * The bias gradient is pg_bias_backward's (on the float32 dout). */
int pg_matmul_bf16_backward(float *dinp, float *dweight, const uint16_t *dout, const uint16_t *inp,
                            const uint16_t *weight, int N, int C, int OC);


#endif
