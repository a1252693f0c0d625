#include "pg_optim.h"

#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "pg_backend.h"
#include "pg_comm.h"
#include "pg_error.h"

/* %g prints NaN with its sign bit ("-nan" for 0/0); messages say "nan". */
static double shown(float x) { return isnan(x) ? NAN : (double)x; }

int pg_adamw_check_hparams(const pg_adamw_hparams *h) {
  /* torch.optim.AdamW's ranges, and finite: an infinite rate or decay turns every parameter into inf or nan */
  if (!isfinite(h->lr) || h->lr < 0) return pg_fail("AdamW: lr must be a finite number >= 0, got %g", shown(h->lr));
  if (!(h->beta1 >= 0 && h->beta1 < 1))
    return pg_fail("AdamW: betas[1] must be a number in [0, 1), got %g", shown(h->beta1));
  if (!(h->beta2 >= 0 && h->beta2 < 1))
    return pg_fail("AdamW: betas[2] must be a number in [0, 1), got %g", shown(h->beta2));
  if (!isfinite(h->eps) || !(h->eps > 0))
    return pg_fail("AdamW: eps must be a finite number > 0, got %g", shown(h->eps));
  if (!isfinite(h->weight_decay) || h->weight_decay < 0)
    return pg_fail("AdamW: weight_decay must be a finite number >= 0, got %g", shown(h->weight_decay));
  return PG_OK;
}

int pg_adamw_set_hparams(pg_adamw *o, const pg_adamw_hparams *h) {
  if (pg_adamw_check_hparams(h)) return PG_ERR;
  o->h = *h;
  return PG_OK;
}

pg_adamw *pg_adamw_new(pg_engine *e, const pg_adamw_hparams *h, int zero) {
  if (zero < 0 || zero > 3)
    return pg_fail_null("zero=%d is not built: ZeRO stage 1, 2 or 3 (zero = 1, 2, 3) or none (zero = 0)", zero);
  if (pg_adamw_check_hparams(h)) return NULL;
  if (e->sharded && zero == 0) /* its optimizer would read every gradient */
    return pg_fail_null("zero=0: this engine keeps only its shard of the gradients (an optimizer with zero = 2 was "
                        "made for it); make the engine again for zero = 0");
  if (e->params_sharded && zero != 3) /* its optimizer would update parameters this rank does not hold */
    return pg_fail_null("zero=%d: this engine keeps only its shard of the parameters (an optimizer with zero = 3 "
                        "was made for it); make the engine again for zero = %d", zero, zero);
  pg_adamw *o = calloc(1, sizeof *o);
  if (!o) return pg_fail_null("out of memory");
  o->engine = e;
  o->h = *h;
  o->zero = zero;
  o->clip_scale = 1.0f;
  e->zero = zero;
  if ((zero >= 2 && pg_engine_shard_grads(e)) || (zero == 3 && pg_engine_shard_params(e))) {
    free(o);
    return NULL;
  }
  pg_engine_shard(e, &o->lo, &o->hi);
  pg_engine_expert_shard(e, &o->elo, &o->ehi);
  size_t bytes = (size_t)(o->hi - o->lo + o->ehi - o->elo) * sizeof(float);
  if (!(o->m = pg_backend_storage(e->be, bytes)) || !(o->v = pg_backend_storage(e->be, bytes))) {
    pg_adamw_free(o);
    return NULL;
  }
  return o;
}

void pg_adamw_free(pg_adamw *o) {
  if (!o) return;
  pg_storage_release(o->m);
  pg_storage_release(o->v);
  free(o);
}

/* Calls body on every [a, b) piece of a parameter inside this rank's ranges
 * (the dense one, then the experts'); st: where a's moments sit in m and v. */
#define FOR_OWNED_PIECES(o, p, a, b, st, body)                                                               \
  for (int _r = 0; _r < 2; _r++)                                                                             \
    for (int _i = 0; _i < (o)->engine->nparams; _i++) {                                                      \
      pg_param *p = (o)->engine->params[_i];                                                                 \
      int64_t _lo = _r ? (o)->elo : (o)->lo, _hi = _r ? (o)->ehi : (o)->hi;                                  \
      int64_t a = p->offset > _lo ? p->offset : _lo;                                                         \
      int64_t b = p->offset + p->numel < _hi ? p->offset + p->numel : _hi;                                   \
      if (a >= b) continue;                                                                                  \
      int64_t st = a - _lo + (_r ? (o)->hi - (o)->lo : 0);                                                   \
      (void)st;                                                                                              \
      body                                                                                                   \
    }

int pg_adamw_grad_norm(pg_adamw *o, double *norm) {
  pg_engine *e = o->engine;
  if (pg_engine_sync_grads(e)) return PG_ERR;
  double sq[2] = {0, 0}; /* dense, experts */
  FOR_OWNED_PIECES(o, p, a, b, st, {
    if (p->tied_copy || (p->replicated && e->ctx->tp_rank != 0)) continue;
    double piece;
    if (e->be->ops->sum_squares(e->be, pg_engine_grad_at(e, a), b - a, &piece)) return PG_ERR;
    sq[p->expert] += piece;
  })
  /* every rank holds a disjoint part of the model's gradients: its tensor
   * shard, its pipeline stage, and with ZeRO-1 its data shard; the experts'
   * part also its experts (expert group), and with ZeRO-1 its shard of them */
  if (e->flat_padded > e->dense_padded &&
      (pg_all_reduce_buf(e->ctx, PG_MODE_EXPERT, &sq[1], 1, PG_FLOAT64, PG_REDUCE_SUM) ||
       (o->zero && pg_all_reduce_buf(e->ctx, PG_MODE_EXPERT_DATA, &sq[1], 1, PG_FLOAT64, PG_REDUCE_SUM))))
    return PG_ERR;
  if (o->zero && pg_all_reduce_buf(e->ctx, pg_engine_dense_group(e), &sq[0], 1, PG_FLOAT64, PG_REDUCE_SUM))
    return PG_ERR;
  sq[0] += sq[1];
  if (pg_all_reduce_buf(e->ctx, PG_MODE_TENSOR, &sq[0], 1, PG_FLOAT64, PG_REDUCE_SUM) ||
      pg_all_reduce_buf(e->ctx, PG_MODE_PIPELINE, &sq[0], 1, PG_FLOAT64, PG_REDUCE_SUM))
    return PG_ERR;
  double total = sq[0];
  *norm = sqrt(total);
  return PG_OK;
}

int pg_adamw_clip(pg_adamw *o, double max_norm, double *norm) {
  if (!(max_norm > 0))
    return pg_fail("clip_grad_norm: max_norm must be a number > 0, got %g", isnan(max_norm) ? NAN : max_norm);
  if (pg_adamw_grad_norm(o, norm)) return PG_ERR;
  double f = max_norm / (*norm + 1e-6);
  o->clip_scale = f < 1 ? (float)f : 1.0f;
  return PG_OK;
}

int pg_adamw_step(pg_adamw *o) {
  pg_engine *e = o->engine;
  if (pg_engine_sync_grads(e)) return PG_ERR;
  o->step++;
  float *m = o->m->data, *v = o->v->data;
  /* every owned piece in one table and one backend call (the device runs it as one launch); at most two pieces per
   * parameter (the dense range, the experts') */
  pg_adamw_piece *pieces = calloc(2 * (size_t)e->nparams + 1, sizeof *pieces);
  if (!pieces) return pg_fail("AdamW step: out of memory for the table of %d parameters", e->nparams);
  int npieces = 0;
  FOR_OWNED_PIECES(o, p, a, b, st, {
    pieces[npieces++] = ((pg_adamw_piece){.param = pg_engine_param_at(e, a), .grad = pg_engine_grad_at(e, a),
                                          .m = m + st, .v = v + st, .n = b - a, .decay = p->weight_decay != 0});
  })
  int rc = e->be->ops->adamw_update_pieces(e->be, pieces, npieces, o->h.lr, o->h.beta1, o->h.beta2, o->h.eps,
                                           o->h.weight_decay, (int)o->step, o->clip_scale);
  free(pieces);
  if (rc) return PG_ERR;
  o->clip_scale = 1.0f;
  return pg_engine_gather_params(e); /* ZeRO-1: the shards are the collectives' blocks */
}
