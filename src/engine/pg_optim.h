/* pg_optim: AdamW over an engine's flat buffers, replicated or ZeRO-1.
 *
 * zero = 0: every data replica holds the whole optimizer state and updates
 * every parameter (the gradients were all-reduced).
 * zero = 1: the flat buffer is cut into D contiguous shards; this rank's
 * gradients are the reduce-scattered average for its shard, its AdamW state
 * (m, v) exists only for that shard, it updates only that shard, and the
 * updated parameters are all-gathered back over the data group.
 * zero = 2: the same shards, and the engine keeps only this rank's shard of
 * the gradients (pg_engine_shard_grads): they are written into staging
 * buffers a bucket at a time, reduce-scattered after every micro-batch's
 * backward and added into the shard. zero = 3 (pg_engine_shard_params):
 * the parameters too. Under expert parallelism each shard is two ranges, the
 * dense region's over the data group and the experts' over expert_data.
 *
 * The global gradient norm counts every element of the full model once:
 * sharded tensors summed over the tensor group, replicated tensors (LayerNorm,
 * row-parallel biases, position embedding) on tensor rank 0 only, the second
 * copy of a tied embedding not at all, ZeRO shards summed over the data group.
 *
 * step, grad_norm and clip are collective over the whole context. */
#ifndef PG_OPTIM_H
#define PG_OPTIM_H

#include "pg_engine.h"

typedef struct pg_adamw_hparams {
  float lr, beta1, beta2, eps, weight_decay;
} pg_adamw_hparams;

typedef struct pg_adamw {
  pg_engine *engine;
  pg_adamw_hparams h;
  int zero;
  int64_t lo, hi;  /* the flat range this rank updates in the dense region */
  int64_t elo, ehi; /* and in the experts' region (expert parallelism; else empty) */
  pg_storage *m, *v; /* [hi - lo] then [ehi - elo] */
  long step;       /* updates done */
  float clip_scale; /* gradient factor for the next step (from clipping) */
} pg_adamw;

pg_adamw *pg_adamw_new(pg_engine *e, const pg_adamw_hparams *h, int zero);
/* PG_OK when every hyperparameter is in range (finite lr >= 0, betas in [0, 1), finite eps > 0,
 * finite weight_decay >= 0); else PG_ERR and a message naming the first that is not. */
int pg_adamw_check_hparams(const pg_adamw_hparams *h);
/* Replaces the hyperparameters after checking them (unchanged on error). */
int pg_adamw_set_hparams(pg_adamw *o, const pg_adamw_hparams *h);
void pg_adamw_free(pg_adamw *o);
int pg_adamw_step(pg_adamw *o);
/* Global L2 norm of the gradients (runs pending gradient reductions). */
int pg_adamw_grad_norm(pg_adamw *o, double *norm);
/* norm as above; when norm > max_norm the next step scales gradients by max_norm / (norm + 1e-6). */
int pg_adamw_clip(pg_adamw *o, double max_norm, double *norm);

#endif
