/* Rotary position embeddings, transformers' rotate_half convention (kernels.h). */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "pg_cpu.h"

#define PI 3.14159265358979323846 /* math.pi (M_PI is not ISO C) */

int pg_rope_type_of(const char *name) {
  static const char *const names[] = {[PG_ROPE_PLAIN] = "default", [PG_ROPE_LINEAR] = "linear",
                                      [PG_ROPE_DYNAMIC] = "dynamic", [PG_ROPE_LLAMA3] = "llama3"};
  for (int k = 0; k < (int)(sizeof names / sizeof names[0]); k++)
    if (!strcmp(name, names[k])) return k;
  return -1;
}

/* inv_freq[i] (kernels.h: pg_rope_inv_freq): every type scales each frequency on its own */
static float inv_freq_at(int i, int HS, double theta, const pg_rope_scaling *scaling) {
  /* float32 steps as transformers takes them: arange(0, HS, 2).float() / HS, base ** that, 1 / that */
  float expo = (float)(2 * i) / (float)HS;
  float f = 1.0f / powf((float)theta, expo);
  if (!scaling) return f;
  if (scaling->type == PG_ROPE_LINEAR) return f / (float)scaling->factor;
  if (scaling->type != PG_ROPE_LLAMA3) return f; /* PG_ROPE_DYNAMIC: the plain ones up to max_position_embeddings */
  /* _compute_llama3_parameters: python floats meet float32 tensors as float32 scalars;
   * `scalar / tensor` is tensor.reciprocal() * scalar; each operation rounded to float32 */
  float factor = (float)scaling->factor, low = (float)scaling->low_freq_factor, old = (float)scaling->original_max;
  float low_wavelen = (float)(scaling->original_max / scaling->low_freq_factor);
  float high_wavelen = (float)(scaling->original_max / scaling->high_freq_factor);
  float span = (float)(scaling->high_freq_factor - scaling->low_freq_factor);
  float wavelen = (1.0f / f) * (float)(2 * PI);
  float scaled = wavelen > low_wavelen ? f / factor : f;
  if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) { /* the middle band, smoothed */
    float smooth = ((1.0f / wavelen) * old - low) / span;
    float a = (1.0f - smooth) * scaled / factor, b = smooth * scaled;
    scaled = a + b;
  }
  return scaled;
}

void pg_rope_inv_freq(float *inv_freq, int HS, double theta, const pg_rope_scaling *scaling) {
  for (int i = 0; i < HS / 2; i++) inv_freq[i] = inv_freq_at(i, HS, theta, scaling);
}

void pg_rope_table(float *cos_t, float *sin_t, int max_T, int HS, double theta, const pg_rope_scaling *scaling) {
  const int half = HS / 2;
  for (int i = 0; i < half; i++) {
    float inv_freq = inv_freq_at(i, HS, theta, scaling);
    for (int t = 0; t < max_T; t++) {
      float angle = (float)t * inv_freq;
      cos_t[(int64_t)t * half + i] = (float)cos((double)angle);
      sin_t[(int64_t)t * half + i] = (float)sin((double)angle);
    }
  }
}

/* pg_rope_forward on bf16 rows: the same products and sums of the widened values, rounded once */
void pg_rope_bf16_forward(uint16_t *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld) {
  if (N <= 0 || T <= 0 || heads <= 0 || HS < 2) return;
  const int half = HS / 2;
#pragma omp parallel for schedule(static) if ((int64_t)N * heads * HS > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *c = cos_t + (int64_t)(n % T) * half, *s = sin_t + (int64_t)(n % T) * half;
    for (int h = 0; h < heads; h++) {
      uint16_t *v = x + (int64_t)n * ld + (int64_t)h * HS;
      for (int i = 0; i < half; i++) {
        float a = pg_bf16_value(v[i]), b = pg_bf16_value(v[i + half]), sn = s[i];
        v[i] = pg_bf16_round(a * c[i] - b * sn);
        v[i + half] = pg_bf16_round(b * c[i] + a * sn);
      }
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
