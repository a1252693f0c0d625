/* AdamW update and the deterministic sum of squares (gradient norms). */
#include <math.h>

#include "kernels.h"
#include "pg_cpu.h"

void pg_adamw_update(float *param, const float *grad, float *m, float *v, int64_t n, float lr, float beta1,
                     float beta2, float eps, float weight_decay, int step, float grad_scale) {
  /* The scalar factors in double and then rounded once, as torch computes
   * them with Python floats before handing them to its float kernels. */
  const double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
  const float decay = (float)(1.0 - (double)lr * weight_decay);
  const float step_size = (float)((double)lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  const float one_b1 = (float)(1.0 - beta1), one_b2 = (float)(1.0 - beta2);
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float g = grad[i] * grad_scale;
    float p = param[i] * decay;
    float mi = beta1 * m[i] + one_b1 * g;
    float vi = beta2 * v[i] + one_b2 * g * g;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    param[i] = p - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}

void pg_adamw_update_pieces(const pg_adamw_piece *pieces, int npieces, float lr, float beta1, float beta2, float eps,
                            float weight_decay, int step, float grad_scale) {
  for (int k = 0; k < npieces; k++) {
    const pg_adamw_piece *pc = &pieces[k];
    pg_adamw_update(pc->param, pc->grad, pc->m, pc->v, pc->n, lr, beta1, beta2, eps, pc->decay ? weight_decay : 0.0f,
                    step, grad_scale);
  }
}

#define PG_SUMSQ_CHUNKS 64
#define PG_SUMSQ_LANES 8

double pg_sum_squares(const float *x, int64_t n) {
  /* 64 chunks fixed by n alone, 8 explicit lanes inside each, partials added
   * in chunk order: the same bits for any thread count and vector width. */
  double part[PG_SUMSQ_CHUNKS];
#pragma omp parallel for schedule(static) if (n > PG_PAR_MIN)
  for (int k = 0; k < PG_SUMSQ_CHUNKS; k++) {
    int64_t i0 = n * k / PG_SUMSQ_CHUNKS, i1 = n * (k + 1) / PG_SUMSQ_CHUNKS, i = i0;
    double lane[PG_SUMSQ_LANES] = {0};
    for (; i + PG_SUMSQ_LANES <= i1; i += PG_SUMSQ_LANES)
      for (int j = 0; j < PG_SUMSQ_LANES; j++) lane[j] += (double)x[i + j] * x[i + j];
    for (; i < i1; i++) lane[0] += (double)x[i] * x[i];
    double s = 0;
    for (int j = 0; j < PG_SUMSQ_LANES; j++) s += lane[j];
    part[k] = s;
  }
  double total = 0;
  for (int k = 0; k < PG_SUMSQ_CHUNKS; k++) total += part[k];
  return total;
}
