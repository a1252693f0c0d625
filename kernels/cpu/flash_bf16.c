/* Flash attention on bf16 q|k|v, the CPU twin (kernels.h's pg_flash_bf16_*): q|k|v widened to float32 (exact)
 * and the block attention of one block holding every key (pg_attention_block_*, float32 throughout), so the
 * CPU gives the device's tensor-core kernels (kernels/cuda/flash_bf16.cu) their reference on the same bf16
 * inputs, with the same lse. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "pg_size.h"

/* The one rule of the shapes both backends take (the device kernels' tiles: WMMA 16x16 rows, heads of 64 or
 * 128 in registers; the grid's y and z dimensions). */
const char *pg_flash_bf16_unsupported(int B, int T, int NH, int NKV, int HS) {
  if (HS != 64 && HS != 128) return "the head size is not 64 or 128";
  if (T <= 0 || T % 16) return "T is not a positive multiple of 16";
  if (B <= 0 || B > 65535) return "B is not in 1 .. 65535";
  if (NH <= 0 || NH > 65535 || NKV <= 0 || NH % NKV) return "NKV does not divide NH (1 .. 65535 heads)";
  return NULL;
}

/* n floats, or NULL (too many, or out of memory) */
static float *floats(int nsizes, const int64_t *sizes) {
  const int64_t n = pg_size_product(nsizes, sizes);
  int64_t bytes = 0;
  if (n < 0 || pg_mul_overflows(n, (int64_t)sizeof(float), &bytes) || (uint64_t)bytes > SIZE_MAX) return NULL;
  return malloc(bytes ? (size_t)bytes : 1);
}

int pg_flash_bf16_forward(float *out, uint16_t *out16, float *lse, const uint16_t *qkv, const float *slopes, int B,
                          int T, int NH, int NKV, int HS) {
  if (pg_flash_bf16_unsupported(B, T, NH, NKV, HS)) return 1;
  const int64_t W = (int64_t)(NH + 2 * NKV) * HS;
  const int64_t n_qkv[] = {B, T, W}, n_acc[] = {B, T, NH, HS}, n_row[] = {2, B, NH, T};
  float *x = floats(3, n_qkv), *acc = floats(4, n_acc), *mx = floats(4, n_row);
  if (!x || !acc || !mx) {
    free(x), free(acc), free(mx);
    return 1;
  }
  const int64_t nrow = (int64_t)B * NH * T;
  float *sm = mx + nrow;
  pg_bf16_to_f32(x, qkv, (int64_t)B * T * W);
  memset(acc, 0, (size_t)B * T * NH * HS * sizeof(float));
  for (int64_t i = 0; i < nrow; i++) mx[i] = -INFINITY, sm[i] = 0.0f;
  pg_attention_block_forward(acc, mx, sm, x, W, x + (int64_t)NH * HS, x + (int64_t)(NH + NKV) * HS, W, slopes, B, T,
                             T, NH, NKV, HS, 0, 0);
  pg_attention_block_finish(out, (int64_t)NH * HS, lse, acc, mx, sm, B, T, NH, HS);
  if (out16) pg_bf16_from_f32(out16, out, (int64_t)B * T * NH * HS);
  free(x), free(acc), free(mx);
  return 0;
}

int pg_flash_bf16_backward(float *dqkv, uint16_t *dqkv16, float *delta, const uint16_t *dout, const float *out,
                           const uint16_t *qkv, const float *lse, const float *slopes, int B, int T, int NH, int NKV,
                           int HS) {
  if (pg_flash_bf16_unsupported(B, T, NH, NKV, HS) || (!dqkv && !dqkv16)) return 1;
  const int64_t W = (int64_t)(NH + 2 * NKV) * HS, C = (int64_t)NH * HS;
  const int64_t n_qkv[] = {B, T, W}, n_out[] = {B, T, C};
  float *x = floats(3, n_qkv), *g = floats(3, n_out), *own = dqkv ? NULL : floats(3, n_qkv);
  if (!x || !g || (!dqkv && !own)) {
    free(x), free(g), free(own);
    return 1;
  }
  if (!dqkv) dqkv = own; /* the float32 sums, rounded into dqkv16 at the end */
  pg_bf16_to_f32(x, qkv, (int64_t)B * T * W);
  pg_bf16_to_f32(g, dout, (int64_t)B * T * C);
  memset(dqkv, 0, (size_t)B * T * W * sizeof(float)); /* the block backward accumulates */
  pg_attention_block_delta(delta, g, C, out, C, B, T, NH, HS);
  pg_attention_block_backward(dqkv, W, dqkv + (int64_t)NH * HS, dqkv + (int64_t)(NH + NKV) * HS, W, x, W,
                              x + (int64_t)NH * HS, x + (int64_t)(NH + NKV) * HS, W, g, C, lse, delta, slopes, B, T,
                              T, NH, NKV, HS, 0, 0);
  if (dqkv16) pg_bf16_from_f32(dqkv16, dqkv, (int64_t)B * T * W);
  free(x), free(g), free(own);
  return 0;
}
