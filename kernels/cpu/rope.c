/* Rotary position embeddings, transformers' rotate_half convention (kernels.h). */
#include <math.h>

#include "kernels.h"
#include "pg_cpu.h"

void pg_rope_table(float *cos_t, float *sin_t, int max_T, int HS, double theta) {
  const int half = HS / 2;
  for (int i = 0; i < half; i++) {
    /* float32 steps as transformers takes them: arange(0, HS, 2).float() / HS,
     * base ** that, 1 / that; then position * inv_freq, cos and sin. */
    float expo = (float)(2 * i) / (float)HS;
    float inv_freq = 1.0f / powf((float)theta, expo);
    for (int t = 0; t < max_T; t++) {
      float angle = (float)t * inv_freq;
      cos_t[(int64_t)t * half + i] = (float)cos((double)angle);
      sin_t[(int64_t)t * half + i] = (float)sin((double)angle);
    }
  }
}

/* sign = +1: rotate by the angle; -1: by its opposite (the transpose). */
static void rope_apply(float *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld,
                       float sign) {
  const int half = HS / 2;
#pragma omp parallel for schedule(static) if ((int64_t)N * heads * HS > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *c = cos_t + (int64_t)(n % T) * half, *s = sin_t + (int64_t)(n % T) * half;
    for (int h = 0; h < heads; h++) {
      float *v = x + (int64_t)n * ld + (int64_t)h * HS;
#pragma omp simd
      for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half], sn = sign * s[i];
        v[i] = a * c[i] - b * sn;
        v[i + half] = b * c[i] + a * sn;
      }
    }
  }
}

void pg_rope_forward(float *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld) {
  if (N <= 0 || T <= 0 || heads <= 0 || HS < 2) return;
  rope_apply(x, cos_t, sin_t, N, T, heads, HS, ld, 1.0f);
}

void pg_rope_backward(float *dx, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld) {
  if (N <= 0 || T <= 0 || heads <= 0 || HS < 2) return;
  rope_apply(dx, cos_t, sin_t, N, T, heads, HS, ld, -1.0f);
}
