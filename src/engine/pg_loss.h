/* pg_loss: losses for objectives written in Lua, over an output that may be
 * split by vocabulary over the tensor group (an LMHead with output =
 * "logits": each tensor rank holds `count` columns starting at global column
 * `first` of a padded vocabulary; columns from `size` on are padding and take
 * no part). Host memory; the statistics that need every column are
 * all-reduced over ctx's tensor group (ctx NULL or T = 1: nothing to reduce),
 * so every tensor rank returns the same loss and its own columns' gradient.
 * Semantics are torch's: F.cross_entropy (mean over non-ignored rows,
 * label_smoothing, ignore_index) and F.kl_div(log_target=True,
 * reduction="batchmean") of temperature-scaled log-softmaxes times tau^2. */
#ifndef PG_LOSS_H
#define PG_LOSS_H

#include <stdint.h>

#include "pg_context.h"

typedef struct pg_loss_columns {
  int64_t size;  /* real vocabulary (classes): global columns [0, size) */
  int64_t first; /* global index of this rank's first column (0-based) */
  int count;     /* this rank's columns (the row stride of its logits) */
} pg_loss_columns;

typedef struct pg_ce_opts {
  double label_smoothing; /* in [0, 1] */
  double z_loss;          /* coefficient of mean(logsumexp^2) (PaLM's z-loss); 0: none */
  int32_t ignore_index;   /* rows whose target is this take no part (torch: -100) */
  int sum;                /* 1: sum over rows instead of the mean */
} pg_ce_opts;

typedef struct pg_ce_result {
  double loss;   /* the objective: (1 - ls) nll + ls smooth + z_loss * z, mean (or sum) */
  double nll;    /* mean (or sum) of -log p(target) */
  double z;      /* mean (or sum) of logsumexp^2 */
  int64_t count; /* rows that took part */
} pg_ce_result;

/* dlogits (may be NULL): d loss / d logits, [N, count]. Targets outside
 * [0, size) other than ignore_index are an error naming the row. */
int pg_loss_cross_entropy(pg_context *ctx, const float *logits, const int32_t *targets, int64_t N,
                          const pg_loss_columns *cols, const pg_ce_opts *o, float *dlogits, pg_ce_result *r);

/* tau^2 * sum_rows KL(softmax(t / tau) || softmax(s / tau)) / N. teacher:
 * [N, teacher_width] rows whose column 0 is global column teacher_first
 * (the same slice as the student's, or the whole vocabulary: first 0).
 * dstudent (may be NULL): d loss / d student, [N, count]. */
int pg_loss_kl_div(pg_context *ctx, const float *student, const float *teacher, int64_t teacher_width,
                   int64_t teacher_first, int64_t N, const pg_loss_columns *cols, double temperature,
                   float *dstudent, double *loss);

#endif
