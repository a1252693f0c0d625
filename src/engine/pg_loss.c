#include "pg_loss.h"

#include <math.h>
#include <stdlib.h>

#include "pg_comm.h"
#include "pg_error.h"

/* This rank's real columns: the local ones before the padding. */
static int real_columns(const pg_loss_columns *c) {
  int64_t n = c->size - c->first;
  if (n < 0) n = 0;
  return n < c->count ? (int)n : c->count;
}

static int reduce(pg_context *ctx, double *buf, int64_t n, pg_reduce_op op) {
  if (!ctx || ctx->tensor <= 1) return PG_OK;
  return pg_all_reduce_buf(ctx, PG_MODE_TENSOR, buf, n, PG_FLOAT64, op);
}

static int check_columns(const pg_loss_columns *c, int64_t N) {
  if (N < 0 || c->count < 1 || c->size < 1 || c->first < 0)
    return pg_fail("loss: bad columns (rows %lld, size %lld, first %lld, count %d)", (long long)N, (long long)c->size,
                   (long long)c->first, c->count);
  return PG_OK;
}

int pg_loss_cross_entropy(pg_context *ctx, const float *logits, const int32_t *targets, int64_t N,
                          const pg_loss_columns *cols, const pg_ce_opts *o, float *dlogits, pg_ce_result *r) {
  if (check_columns(cols, N)) return PG_ERR;
  if (!(o->label_smoothing >= 0 && o->label_smoothing <= 1))
    return pg_fail("cross_entropy: label_smoothing must be in [0, 1], not %g", o->label_smoothing);
  if (!(o->z_loss >= 0 && isfinite(o->z_loss)))
    return pg_fail("cross_entropy: z_loss must be a finite number >= 0, not %g", o->z_loss);
  for (int64_t i = 0; i < N; i++)
    if (targets[i] != o->ignore_index && (targets[i] < 0 || targets[i] >= cols->size))
      return pg_fail("cross_entropy: target %d at row %lld is outside [0, %lld) (and is not ignore_index %d)",
                     targets[i], (long long)i + 1, (long long)cols->size, o->ignore_index);
  const int W = cols->count, R = real_columns(cols);
  /* per row: max, then (sum of exp, target logit, sum of logits), all global */
  double *st = malloc((size_t)(N > 0 ? N : 1) * 4 * sizeof(double));
  if (!st) return pg_fail("cross_entropy: out of memory for %lld rows", (long long)N);
  double *mx = st, *sums = st + N; /* sums: [N][3] */
  for (int64_t i = 0; i < N; i++) {
    double m = -INFINITY;
    for (int c = 0; c < R; c++) m = fmax(m, logits[i * W + c]);
    mx[i] = m;
  }
  int rc = reduce(ctx, mx, N, PG_REDUCE_MAX);
  for (int64_t i = 0; i < N && !rc; i++) {
    const float *z = logits + i * W;
    double se = 0, zt = 0, zs = 0;
    for (int c = 0; c < R; c++) {
      se += exp(z[c] - mx[i]);
      zs += z[c];
    }
    int64_t t = targets[i] - cols->first;
    if (targets[i] != o->ignore_index && t >= 0 && t < R) zt = z[t];
    sums[3 * i] = se, sums[3 * i + 1] = zt, sums[3 * i + 2] = zs;
  }
  if (!rc) rc = reduce(ctx, sums, 3 * N, PG_REDUCE_SUM);
  if (rc) {
    free(st);
    return PG_ERR;
  }
  const double ls = o->label_smoothing, C = (double)cols->size;
  int64_t count = 0;
  for (int64_t i = 0; i < N; i++) count += targets[i] != o->ignore_index;
  double scale = o->sum ? 1.0 : (count > 0 ? 1.0 / (double)count : 0.0);
  double nll = 0, smooth = 0, zsq = 0;
  for (int64_t i = 0; i < N; i++) {
    float *d = dlogits ? dlogits + i * W : NULL;
    if (targets[i] == o->ignore_index) {
      for (int c = 0; d && c < W; c++) d[c] = 0;
      continue;
    }
    double lse = mx[i] + log(sums[3 * i]);
    nll += lse - sums[3 * i + 1];
    smooth += lse - sums[3 * i + 2] / C;
    zsq += lse * lse;
    if (!d) continue;
    /* d/dz_c: p_c (1 + 2 z_loss lse) - (1 - ls) [c = t] - ls / C */
    const float *z = logits + i * W;
    double pc_scale = 1 + 2 * o->z_loss * lse;
    int64_t t = targets[i] - cols->first;
    for (int c = 0; c < W; c++) {
      if (c >= R) {
        d[c] = 0;
        continue;
      }
      double g = exp(z[c] - lse) * pc_scale - ls / C - (c == t ? 1 - ls : 0);
      d[c] = (float)(g * scale);
    }
  }
  free(st);
  r->count = count;
  r->nll = nll * scale;
  r->z = zsq * scale;
  r->loss = ((1 - ls) * nll + ls * smooth + o->z_loss * zsq) * scale;
  return PG_OK;
}

int pg_loss_kl_div(pg_context *ctx, const float *student, const float *teacher, int64_t teacher_width,
                   int64_t teacher_first, int64_t N, const pg_loss_columns *cols, double temperature,
                   float *dstudent, double *loss) {
  if (check_columns(cols, N)) return PG_ERR;
  if (!(temperature > 0 && isfinite(temperature)))
    return pg_fail("kl_div: temperature must be a finite number > 0, not %g", temperature);
  const int W = cols->count, R = real_columns(cols);
  const int64_t off = cols->first - teacher_first; /* my column c is the teacher's column off + c */
  if (off < 0 || (R > 0 && off + R > teacher_width))
    return pg_fail("kl_div: the teacher's rows hold columns [%lld, %lld), not this rank's [%lld, %lld)",
                   (long long)teacher_first, (long long)(teacher_first + teacher_width), (long long)cols->first,
                   (long long)(cols->first + R));
  const double tau = temperature;
  double *st = malloc((size_t)(N > 0 ? N : 1) * 4 * sizeof(double));
  if (!st) return pg_fail("kl_div: out of memory for %lld rows", (long long)N);
  double *mx = st, *se = st + 2 * N; /* [N][2] each: student, teacher */
  for (int64_t i = 0; i < N; i++) {
    double ms = -INFINITY, mt = -INFINITY;
    for (int c = 0; c < R; c++) {
      ms = fmax(ms, student[i * W + c] / tau);
      mt = fmax(mt, teacher[i * teacher_width + off + c] / tau);
    }
    mx[2 * i] = ms, mx[2 * i + 1] = mt;
  }
  int rc = reduce(ctx, mx, 2 * N, PG_REDUCE_MAX);
  for (int64_t i = 0; i < N && !rc; i++) {
    double ss = 0, stt = 0;
    for (int c = 0; c < R; c++) {
      ss += exp(student[i * W + c] / tau - mx[2 * i]);
      stt += exp(teacher[i * teacher_width + off + c] / tau - mx[2 * i + 1]);
    }
    se[2 * i] = ss, se[2 * i + 1] = stt;
  }
  if (!rc) rc = reduce(ctx, se, 2 * N, PG_REDUCE_SUM);
  double kl = 0;
  for (int64_t i = 0; i < N && !rc; i++) {
    double ls = mx[2 * i] + log(se[2 * i]), lt = mx[2 * i + 1] + log(se[2 * i + 1]);
    for (int c = 0; c < W; c++) {
      if (c >= R) {
        if (dstudent) dstudent[i * W + c] = 0;
        continue;
      }
      double logps = student[i * W + c] / tau - ls, logpt = teacher[i * teacher_width + off + c] / tau - lt;
      double pt = exp(logpt);
      kl += pt * (logpt - logps);
      /* d/ds_c of tau^2 KL / N = tau (p_s - p_t) / N */
      if (dstudent) dstudent[i * W + c] = (float)(tau * (exp(logps) - pt) / (double)(N > 0 ? N : 1));
    }
  }
  free(st);
  if (rc) return PG_ERR;
  if (reduce(ctx, &kl, 1, PG_REDUCE_SUM)) return PG_ERR;
  *loss = N > 0 ? tau * tau * kl / (double)N : 0;
  return PG_OK;
}
