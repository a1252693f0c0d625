#include "pg_engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg_clock.h"
#include "pg_comm.h"
#include "pg_error.h"
#include "pg_size.h"

#define FLAT_ALIGN 16 /* floats: every parameter starts on a 64-byte boundary */

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static int pp_size(const pg_engine *e) { return e->ctx->pipeline; }
static int pp_rank(const pg_engine *e) { return e->ctx->pp_rank; }

/* The one place that says where the dense region's gradients are averaged and its ZeRO shards cut: the data
 * group, or with context parallelism data x context (the parameters are replicated over both, Megatron-LM's
 * dp-cp group). With context = 1 it is the data group itself (its communicator, its comm_stats row). */
pg_mode pg_engine_dense_group(const pg_engine *e) { return e->ctx->context > 1 ? PG_MODE_DATA_CONTEXT : PG_MODE_DATA; }
static int dense_size(const pg_engine *e) { return e->ctx->group[pg_engine_dense_group(e)].size; }

/* The flat buffer's two regions (pg_engine.h): 0 the dense parameters, reduced and ZeRO-sharded over the dense
 * group; 1 the experts this rank holds (expert parallelism; else empty), over expert_data. */
static pg_mode region_group(const pg_engine *e, int r) { return r ? PG_MODE_EXPERT_DATA : pg_engine_dense_group(e); }
static int64_t region_lo(const pg_engine *e, int r) { return r ? e->dense_padded : 0; }
static int64_t region_hi(const pg_engine *e, int r) { return r ? e->flat_padded : e->dense_padded; }
static int region_of(const pg_engine *e, int64_t off) { return off >= e->dense_padded; }

/* Member q's ZeRO shard of region r (of its group): the region's length is a multiple of the group's size. */
static void member_shard(const pg_engine *e, int r, int q, int64_t *lo, int64_t *hi) {
  int64_t per = (region_hi(e, r) - region_lo(e, r)) / e->ctx->group[region_group(e, r)].size;
  *lo = region_lo(e, r) + per * q;
  *hi = *lo + per;
}

/* This rank's range of region r: its shard with ZeRO, else the whole region. */
static void own_shard(const pg_engine *e, int r, int64_t *lo, int64_t *hi) {
  if (e->zero) {
    member_shard(e, r, e->ctx->group[region_group(e, r)].rank, lo, hi);
  } else {
    *lo = region_lo(e, r);
    *hi = region_hi(e, r);
  }
}

/* ZeRO-2 and 3 keep this rank's ranges of both regions one after the other (the optimizer state's layout):
 * their length, where flat element off (inside one of them) sits, and a whole buffer's ranges copied in. */
static int64_t shard_elems(const pg_engine *e) {
  int64_t n = 0;
  for (int r = 0; r < 2; r++) {
    int64_t lo, hi;
    own_shard(e, r, &lo, &hi);
    n += hi - lo;
  }
  return n;
}

static int64_t shard_index(const pg_engine *e, int64_t off) {
  int64_t lo, hi, at = 0;
  int r = region_of(e, off);
  if (r) {
    own_shard(e, 0, &lo, &hi);
    at = hi - lo;
  }
  own_shard(e, r, &lo, &hi);
  return at + off - lo;
}

static int copy_shards(const pg_engine *e, float *shard, const float *whole) {
  for (int r = 0; r < 2; r++) {
    int64_t lo, hi;
    own_shard(e, r, &lo, &hi);
    if (hi > lo &&
        e->be->ops->copy(e->be, shard, whole + lo, (size_t)(hi - lo) * sizeof(float), PG_COPY_DEVICE_TO_DEVICE))
      return PG_ERR;
    shard += hi - lo;
  }
  return PG_OK;
}

/* Sequence parallelism: the rows of a micro-batch of N rows that cross this
 * rank's stage boundaries (its tensor rank's share), and the most of them. */
static int sp_on(const pg_engine *e) { return e->opts.sequence_parallel && e->ctx->tensor > 1; }
static int64_t boundary_rows(const pg_engine *e, int64_t N) {
  return sp_on(e) ? pg_sp_rows(N, e->ctx->tensor, e->ctx->tp_rank) : N;
}
static int64_t boundary_rows_max(const pg_engine *e, int64_t N) {
  return sp_on(e) ? pg_sp_rows_max(N, e->ctx->tensor) : N;
}

/* ---------------------------------------------------------------- construction */

static int cp_check_engine(const pg_engine *e);

/* Every chunk's parameters, chunk by chunk: one flat buffer per rank. */
static int collect_params(pg_engine *e) {
  for (int v = 0; v < e->nchunks; v++) {
    int n = 0;
    pg_param **ps = pg_module_collect_params(e->chunks[v].stage, &n);
    if (!ps) return PG_ERR;
    pg_param **all = realloc(e->params, (size_t)(e->nparams + n + 1) * sizeof *all);
    if (!all) {
      free(ps);
      return pg_fail("out of memory");
    }
    memcpy(all + e->nparams, ps, (size_t)n * sizeof *ps);
    e->params = all;
    e->nparams += n;
    free(ps);
  }
  return PG_OK;
}

static int zero3_at_construction(pg_engine *e, uint64_t seed);

static int bind_params(pg_engine *e, uint64_t seed) {
  if (collect_params(e)) return PG_ERR;
  for (int i = 0; i < e->nparams; i++)
    for (int j = 0; j < i; j++)
      if (!strcmp(e->params[i]->name, e->params[j]->name))
        return pg_fail("two parameters are named '%s': give the modules distinct names", e->params[i]->name);
  /* Two regions: the dense parameters (the same on every data rank, reduced
   * over the data group), then the experts' under expert parallelism (the
   * same on the ranks of an expert_data group only, reduced there). Each is
   * padded to a multiple of its group's size: the collectives' blocks are
   * the ZeRO shards. Without expert parameters the second region is empty. */
  int64_t off = 0;
  if (!(e->by_offset = malloc((size_t)(e->nparams + 1) * sizeof *e->by_offset))) return pg_fail("out of memory");
  for (int pass = 0, n = 0; pass < 2; pass++) {
    if (pass == 1) {
      e->dense_numel = off;
      off = e->dense_padded = round_up(off > 0 ? off : FLAT_ALIGN, (int64_t)FLAT_ALIGN * dense_size(e));
    }
    for (int i = 0; i < e->nparams; i++) {
      if (e->params[i]->expert != pass) continue;
      e->by_offset[n++] = i;
      e->params[i]->offset = off;
      /* each numel is at most PG_MAX_NUMEL (2^59), so the sum cannot wrap before it is compared */
      off = round_up(off + e->params[i]->numel, FLAT_ALIGN);
      if (off > PG_MAX_NUMEL)
        return pg_fail("the parameters of this stage have more than 2^59 elements (at '%s')", e->params[i]->name);
    }
  }
  e->flat_numel = off;
  int64_t experts = off - e->dense_padded;
  e->flat_padded = e->dense_padded + (experts ? round_up(experts, (int64_t)FLAT_ALIGN * (e->ctx->data / e->ctx->expert))
                                              : 0);
  if (e->opts.zero == 3 && dense_size(e) > 1) return zero3_at_construction(e, seed);
  size_t bytes = (size_t)e->flat_padded * sizeof(float);
  /* Data-parallel replicas on one node share their buffers (single-pass
   * reductions); anything else, or no room in /dev/shm: private memory. */
  pg_mode dg = pg_engine_dense_group(e);
  if (!e->opts.private_buffers && (pg_shm_create(e->ctx, dg, bytes, &e->param_shm, &e->param_store) ||
                                   pg_shm_create(e->ctx, dg, bytes, &e->grad_shm, &e->grad_store)))
    return PG_ERR;
  if ((!e->param_store && !(e->param_store = pg_backend_storage(e->be, bytes))) ||
      (!e->grad_store && !(e->grad_store = pg_backend_storage(e->be, bytes))))
    return pg_fail("the flat parameter and gradient buffers (2 x %zu bytes on %s): %s", bytes, e->be->name, pg_error());
  /* the init rule runs on the host; a device engine copies the result over */
  float *pd = e->param_store->data, *gd = e->grad_store->data;
  float *init = e->be->device == PG_CPU ? pd : calloc((size_t)e->flat_padded, sizeof(float));
  if (!init) return pg_fail("out of memory initialising the parameters on the host");
  for (int i = 0; i < e->nparams; i++) {
    pg_param *p = e->params[i];
    p->data = init + p->offset;
    pg_param_init(p, seed);
    p->data = pd + p->offset;
    p->grad = gd + p->offset;
  }
  if (init != pd) {
    int rc = e->be->ops->copy(e->be, pd, init, bytes, PG_COPY_HOST_TO_DEVICE);
    free(init);
    if (rc) return PG_ERR;
  }
  return PG_OK;
}

static int count_parameters(pg_engine *e, int64_t *n);
static void free_staging(pg_engine *e);
static void free_units(pg_engine *e);
static int make_staging(pg_engine *e);
static int check_shardable(const pg_engine *e);

/* ---------------------------------------------------------------- buckets */

#define BUCKET_MAX ((int64_t)1 << 30) /* elements: MPI counts are int */

/* Whether p's gradient needs another reduction before the data group's
 * (a tied embedding's copy: the embedding group's sum, which cannot
 * start in backward since the other copy's stage finishes later): its
 * bucket starts at the end of the step, after that reduction; a sequence-
 * parallel parameter's: the tensor group's sum). A reduction of the same
 * kind is added here. */
static int reduced_first(const pg_engine *e, const pg_param *p) {
  if (sp_on(e) && p->sequence_parallel) return 1; /* the sum over the tensor group (sync_sequence_parallel) */
  return e->opts.tied_name && pp_size(e) > 1 && (e->is_first || e->is_last) && !strcmp(p->name, e->opts.tied_name);
}

/* The group that reduces p's gradient: a bucket holds parameters of one group. */
static pg_mode reduction_group(const pg_engine *e, const pg_param *p) { return region_group(e, p->expert); }

/* Whether this step's reduction goes bucket by bucket: on the device
 * zero = 1 keeps the one reduce-scatter of the whole buffer at the end
 * (NCCL's equal blocks: its shards), and zero = 2 and 3 always go by
 * buckets (each member's piece reduced onto it, comm_nccl_reduce_v). */
static int buckets_apply(const pg_engine *e) {
  return e->buckets && (e->be->device == PG_CPU || !e->zero || e->sharded);
}

int pg_engine_overlaps(const pg_engine *e) {
  return buckets_apply(e) && (!e->sharded || e->opts.overlap_grad_reduce);
}

/* The overlapped reduction applies to host memory reduced over MPI. The
 * shared-memory reduction stays one pass at the end: it is the cores that
 * run backward that read every member's buffer, so overlapping it would
 * take them from backward (memory bandwidth is the limit of both), and a
 * bucket would need every member to flag it final before anyone could read
 * it, a cross-process wait per bucket. On the device a bucket's all-reduce
 * runs on the data group's reduction stream (pg_comm_device_overlap: NCCL,
 * one GPU per rank), after an event the engine's stream records when the
 * bucket's last gradient kernel is queued; the engine's stream waits for
 * the reduction's event before the optimizer (pg_wait). */
static int overlap_applies(const pg_engine *e) {
  /* expert parallelism's second region reduces over expert_data after backward (zero 0 and 1): its buckets
   * would need the division by E after their reduction (ZeRO-2's do it as they add into the shard) */
  if (!e->opts.overlap_grad_reduce || dense_size(e) == 1 || e->flat_padded > e->dense_padded) return 0;
  return e->be->device == PG_CPU ? !pg_engine_shares_buffers(e)
                                 : pg_comm_device_overlap(e->ctx, pg_engine_dense_group(e));
}

/* Whether p's gradient is written by a module that does not own it (a tied
 * head on the owner's stage writes the embedding's early in backward, the
 * embedding late): with ZeRO-2 its bucket keeps its staging all call. */
static int borrowed(const pg_engine *e, const pg_param *p) {
  for (int v = 0; v < e->nchunks; v++) {
    pg_param *b[8];
    int n = pg_module_borrowed_params(e->chunks[v].stage, b, 8);
    for (int i = 0; i < n && i < 8; i++)
      if (b[i] == p) return 1;
    if (n > 8) return 1; /* more than we look at: keep it staged, which is always right */
  }
  return 0;
}

/* Buckets in the order their gradients become final: chunk by chunk from
 * the last (the interleaved schedule finishes its later chunks' backward
 * first), within a chunk from its last parameter back. A bucket takes
 * parameters of one region (the group that reduces them) while it stays
 * within bucket_elems (a larger parameter is a bucket of its own), covers
 * the gaps up to the next bucket of its region (so that the buckets tile
 * each region, and every shard element is reduced: in this order a region's
 * offsets only fall), and a parameter reduced first elsewhere (a tied
 * embedding's copy) is a bucket of its own, started at the end after that
 * reduction. */
static int build_buckets(pg_engine *e) {
  if (!(overlap_applies(e) || e->sharded) || e->nparams == 0) return PG_OK;
  int *first = calloc((size_t)e->nchunks + 1, sizeof *first);
  e->buckets = calloc((size_t)e->nparams, sizeof *e->buckets);
  e->param_bucket = calloc((size_t)e->nparams, sizeof *e->param_bucket);
  e->last_backward = calloc((size_t)e->nchunks, sizeof *e->last_backward);
  if (!first || !e->buckets || !e->param_bucket || !e->last_backward) {
    free(first);
    return pg_fail("out of memory for the gradient buckets");
  }
  for (int v = 0; v < e->nchunks; v++) {
    int n = 0;
    pg_param **ps = pg_module_collect_params(e->chunks[v].stage, &n);
    if (!ps) {
      free(first);
      return PG_ERR;
    }
    free(ps);
    first[v + 1] = first[v] + n;
  }
  int nb = 0, too_large = 0;
  int64_t next_lo[2] = {region_hi(e, 0), region_hi(e, 1)}; /* the lowest bucket of each region so far */
  for (int v = e->nchunks - 1; v >= 0; v--) {
    int a = first[v], b = first[v + 1];
    if (a == b) continue;
    int count = 0, tied = 0;
    for (int i = b - 1; i >= a; i--) {
      pg_param *p = e->params[i];
      int t = reduced_first(e, p), r = e->sharded && (t || borrowed(e, p));
      pg_mode g = reduction_group(e, p);
      pg_bucket *k = &e->buckets[nb];
      if (count > 0 && (k->hi - p->offset > e->opts.bucket_elems || t || r || tied || g != k->mode)) {
        k = &e->buckets[++nb]; /* close the open bucket */
        count = tied = 0;
      }
      if (count == 0) *k = (pg_bucket){.hi = next_lo[p->expert], .mode = g, .p1 = i, .slot = -1};
      k->lo = next_lo[p->expert] = p->offset;
      k->p0 = i;
      k->nparams = ++count;
      k->deferred = tied = tied || t;
      k->resident = k->resident || r;
      e->param_bucket[i] = nb;
    }
    nb++;
  }
  free(first);
  for (int k = 0; k < nb; k++) {
    e->buckets[k].pending = e->buckets[k].nparams;
    if (e->buckets[k].hi - e->buckets[k].lo > BUCKET_MAX) too_large = 1;
  }
  e->nbuckets = nb;
  for (int k = 0; k < e->nactions; k++)
    if (e->actions[k].kind == PG_ACT_BACKWARD) e->last_backward[e->actions[k].chunk] = k;
  if (too_large && e->sharded)
    return pg_fail("zero = 2: a gradient bucket of more than 2^30 elements (a parameter that large): use zero = 1");
  if (too_large) { /* a parameter of more than 2^30 elements: MPI's counts; the ring reduces it at the end */
    free(e->buckets);
    free(e->param_bucket);
    free(e->last_backward);
    e->buckets = NULL;
    e->param_bucket = e->last_backward = NULL;
    e->nbuckets = 0;
  }
  return PG_OK;
}

/* A chunk's modules must take what its piece receives and produce what it hands on. */
static int check_widths(const pg_engine *e, int v) {
  const pg_chunk *c = &e->chunks[v];
  const pg_module *m = c->stage;
  if ((c->is_first && m->in_width == 0) || (!c->is_first && m->in_width == e->opts.width))
    if ((c->is_last && m->out_width == 0) || (!c->is_last && m->out_width == e->opts.width)) return PG_OK;
  char chunk[32] = "";
  if (e->nchunks > 1) snprintf(chunk, sizeof chunk, " chunk %d", v + 1);
  return pg_fail("stage %d%s: its modules take width %d and produce width %d; a %s stage must take %s and produce %s",
                 e->ctx->pp_rank, chunk, m->in_width, m->out_width,
                 c->is_first ? "first" : c->is_last ? "last" : "middle",
                 c->is_first ? "token ids" : "the hidden width", c->is_last ? "the loss" : "the hidden width");
}

/* The schedule and each chunk's per-slot state. */
static int make_schedule(pg_engine *e) {
  if (pg_schedule_build(e->opts.schedule, pp_size(e), e->nchunks, e->opts.micro_batches, pp_rank(e), &e->actions,
                        &e->nactions))
    return PG_ERR;
  for (int v = 0; v < e->nchunks; v++) {
    pg_chunk *c = &e->chunks[v];
    c->nslots = pg_schedule_max_in_flight(e->actions, e->nactions, v);
    if (c->nslots < 1) c->nslots = 1;
    c->act_req = calloc((size_t)c->nslots, sizeof *c->act_req);
    c->grad_req = calloc((size_t)c->nslots, sizeof *c->grad_req);
    c->stage_out = calloc((size_t)c->nslots, sizeof *c->stage_out);
    if (e->opts.router_experts > 0) c->router_req = calloc((size_t)c->nslots, sizeof *c->router_req);
    if (!c->act_req || !c->grad_req || !c->stage_out || (e->opts.router_experts > 0 && !c->router_req))
      return pg_fail("out of memory");
  }
  e->ios = calloc((size_t)e->opts.micro_batches, sizeof *e->ios);
  if (!e->ios) return pg_fail("out of memory");
  if (e->opts.router_experts < 0) return pg_fail("router_experts must be >= 0, not %d", e->opts.router_experts);
  if (e->opts.router_experts > 0) {
    e->router = calloc((size_t)e->opts.micro_batches * 2 * (size_t)e->opts.router_experts, sizeof *e->router);
    e->expert_tokens = calloc((size_t)e->opts.router_experts, sizeof *e->expert_tokens);
    if (!e->router || !e->expert_tokens) return pg_fail("out of memory");
  }
  return PG_OK;
}

pg_engine *pg_engine_new(pg_context *ctx, pg_module *const *stages, int nchunks, uint64_t seed,
                         const pg_engine_opts *opts) {
  pg_engine *e = calloc(1, sizeof *e);
  pg_chunk *chunks = nchunks > 0 ? calloc((size_t)nchunks, sizeof *chunks) : NULL;
  if (!e || !chunks) {
    for (int v = 0; v < nchunks; v++) pg_module_free(stages[v]);
    free(e);
    free(chunks);
    return nchunks > 0 ? pg_fail_null("out of memory") : pg_fail_null("an engine needs at least one chunk");
  }
  e->ctx = ctx;
  e->chunks = chunks;
  e->nchunks = nchunks;
  e->reshard_after_forward = 1; /* FSDP2's default */
  e->prefetch = 1;
  for (int v = 0; v < nchunks; v++) {
    chunks[v].stage = stages[v];
    /* the model's first and last pieces (placement: pg_schedule_piece) */
    int g = pg_schedule_piece(ctx->pipeline, ctx->pp_rank, v);
    chunks[v].is_first = g == 0;
    chunks[v].is_last = g == ctx->pipeline * nchunks - 1;
  }
  e->be = opts->backend ? opts->backend : pg_backend_cpu();
  e->is_first = chunks[0].is_first;
  e->is_last = chunks[nchunks - 1].is_last;
  e->opts = *opts;
  e->opts.tied_name = NULL; /* ours is a copy, made below */
  if (e->be->device != PG_CPU) {
    e->opts.private_buffers = 1; /* shared memory is host memory */
    if (ctx->world_size > 1 && pg_comm_attach_device(ctx, e->be->stream)) {
      pg_engine_free(e);
      return NULL;
    }
  }
  /* the schedule and the per-micro-batch state are made here, O(micro_batches) */
  if (e->opts.micro_batches < 1 || e->opts.micro_batches > PG_MAX_MICRO_BATCHES) {
    pg_engine_free(e);
    return pg_fail_null("micro_batches must be from 1 to %d, not %d", PG_MAX_MICRO_BATCHES, opts->micro_batches);
  }
  if (e->opts.bucket_elems <= 0) e->opts.bucket_elems = (int64_t)25 * 1024 * 1024 / 4;
  if (opts->tied_name && !(e->opts.tied_name = strdup(opts->tied_name))) {
    pg_engine_free(e);
    return pg_fail_null("out of memory");
  }
  int rc = !(e->recompute_arena = pg_recompute_arena_new(e->be));
  /* one arena for every chunk: a rank runs one block's backward at a time */
  for (int v = 0; v < nchunks && !rc; v++)
    rc = check_widths(e, v) || pg_module_set_backend(chunks[v].stage, e->be) ||
         pg_module_set_precision(chunks[v].stage, opts->precision) ||
         pg_module_use_recompute_arena(chunks[v].stage, e->recompute_arena);
  if (rc || make_schedule(e) || bind_params(e, seed) || cp_check_engine(e) || (!e->sharded && build_buckets(e)) ||
      count_parameters(e, &e->num_parameters)) {
    pg_engine_free(e);
    return NULL;
  }
  return e;
}

void pg_engine_free(pg_engine *e) {
  if (!e) return;
  for (int v = 0; v < e->nchunks; v++) {
    pg_chunk *c = &e->chunks[v];
    for (int i = 0; c->act_req && c->grad_req && i < c->nslots; i++) {
      pg_wait(&c->act_req[i]);
      pg_wait(&c->grad_req[i]);
      if (c->router_req) pg_wait(&c->router_req[i]);
    }
    pg_module_free(c->stage);
    pg_be_release(e->be, c->stage_in);
    pg_be_release(e->be, c->grad_send);
    free(c->act_req);
    free(c->grad_req);
    free(c->stage_out);
    free(c->router_req);
  }
  pg_recompute_arena_free(e->recompute_arena); /* after the modules that allocate from it */
  /* a step that failed may leave some in flight; on a broken context the
   * members that should complete them never will: they are left to the job's end */
  for (int k = 0; k < e->nbuckets && !pg_comm_broken(e->ctx); k++) pg_wait(&e->buckets[k].req);
  free_staging(e);
  free_units(e);
  free(e->buckets);
  free(e->param_bucket);
  free(e->last_backward);
  free(e->router);
  free(e->expert_tokens);
  pg_be_release(e->be, e->sp_grads);
  free(e->chunks);
  free(e->params);
  free(e->by_offset);
  pg_shm_close(&e->param_shm);
  pg_shm_close(&e->grad_shm);
  pg_storage_release(e->param_store);
  pg_storage_release(e->grad_store);
  free(e->actions);
  pg_be_release(e->be, e->grad_recv);
  pg_be_release(e->be, e->device_ids);
  free(e->cp_ids);
  free(e->ios);
  free(e->eval_ios);
  pg_be_release(e->be, e->bf16_scratch[0]);
  pg_be_release(e->be, e->bf16_scratch[1]);
  for (int k = 0; k < PG_WIDE_SCRATCH; k++) pg_be_release(e->be, e->wide_scratch[k]);
  free((char *)e->opts.tied_name);
  free(e);
}

/* Precision bf16: one scratch for the rounded operands of whichever GEMM runs (modules run one at a time), and
 * one set of float32 buffers for the bf16 activations widened or before rounding, each as large as the largest
 * any module of the rank's chunks needs at the current capacity, in the backend's memory (where the kernels read
 * them). The float32 buffers are there (at least one element) whenever the precision is bf16. */
static int bf16_scratch(pg_engine *e) {
  pg_bf16_need need = {{0}, {0}};
  for (int v = 0; v < e->nchunks; v++) pg_module_bf16_scratch(e->chunks[v].stage, &need);
  for (int k = 0; k < 2; k++) {
    pg_be_release(e->be, e->bf16_scratch[k]);
    e->bf16_scratch[k] = NULL;
    e->bf16_scratch_n[k] = 0;
    if (!need.operand[k]) continue;
    if ((uint64_t)need.operand[k] > SIZE_MAX / 2)
      return pg_fail("the bf16 operand scratch of %lld elements is too large", (long long)need.operand[k]);
    if (!(e->bf16_scratch[k] = e->be->ops->alloc(e->be, (size_t)need.operand[k] * 2)))
      return pg_fail("no room for the bf16 operand scratch (%lld elements): %s", (long long)need.operand[k],
                     pg_error());
    e->bf16_scratch_n[k] = need.operand[k];
  }
  for (int k = 0; k < PG_WIDE_SCRATCH; k++) {
    pg_be_release(e->be, e->wide_scratch[k]);
    e->wide_scratch[k] = NULL;
    e->wide_scratch_n[k] = 0;
    if (e->opts.precision != PG_PRECISION_BF16) continue;
    int64_t n = need.wide[k] > 0 ? need.wide[k] : 1;
    if ((uint64_t)n > SIZE_MAX / sizeof(float))
      return pg_fail("the bf16 activations' float32 scratch of %lld elements is too large", (long long)n);
    if (!(e->wide_scratch[k] = pg_be_floats(e->be, (size_t)n)))
      return pg_fail("no room for the bf16 activations' float32 scratch (%lld elements): %s", (long long)n,
                     pg_error());
    e->wide_scratch_n[k] = n;
  }
  return PG_OK;
}

/* A micro-batch's view of the engine's precision-bf16 scratch (NULL in fp32). */
static void lend_bf16_scratch(const pg_engine *e, pg_io *io) {
  memcpy(io->bf16_scratch, e->bf16_scratch, sizeof io->bf16_scratch);
  memcpy(io->wide_scratch, e->wide_scratch, sizeof io->wide_scratch);
}

static int ensure_capacity(pg_engine *e, int rows) {
  if (rows <= e->capacity_rows) return PG_OK;
  size_t w = (size_t)e->opts.width, brows = (size_t)boundary_rows_max(e, rows);
  int needs_grad_recv = 0;
  pg_recompute_arena_reset(e->recompute_arena); /* every module is allocated again below */
  for (int v = 0; v < e->nchunks; v++) {
    pg_chunk *c = &e->chunks[v];
    int64_t sizes[3] = {c->nslots, rows, e->opts.width};
    if (pg_size_product(3, sizes) < 0)
      return pg_fail("pipeline buffers of %d slots x %d rows x width %d have more than 2^59 elements", c->nslots, rows,
                     e->opts.width);
    size_t n = (size_t)c->nslots * brows * w;
    if (pg_module_alloc(c->stage, c->nslots, rows)) return PG_ERR;
    pg_be_release(e->be, c->stage_in);
    pg_be_release(e->be, c->grad_send);
    c->stage_in = c->grad_send = NULL;
    if (!c->is_first && (!(c->stage_in = pg_be_floats(e->be, n)) || !(c->grad_send = pg_be_floats(e->be, n))))
      return pg_fail("pipeline buffers: %s", pg_error());
    if (!c->is_last) needs_grad_recv = 1;
  }
  pg_be_release(e->be, e->grad_recv);
  e->grad_recv = NULL;
  if (needs_grad_recv && !(e->grad_recv = pg_be_floats(e->be, brows * w)))
    return pg_fail("pipeline buffers: %s", pg_error());
  if (bf16_scratch(e)) return PG_ERR;
  e->capacity_rows = rows;
  return PG_OK;
}

size_t pg_engine_bf16_bytes(const pg_engine *e) {
  size_t b = 2 * (size_t)(e->bf16_scratch_n[0] + e->bf16_scratch_n[1]);
  for (int k = 0; k < PG_WIDE_SCRATCH; k++) b += sizeof(float) * (size_t)e->wide_scratch_n[k];
  for (int v = 0; v < e->nchunks; v++) b += pg_module_bf16_bytes(e->chunks[v].stage);
  return b;
}

static size_t chunk_slot_bytes(const pg_engine *e, const pg_chunk *c) {
  size_t b = pg_module_saved_bytes(c->stage);
  if (!c->is_first) b += (size_t)boundary_rows_max(e, e->capacity_rows) * e->opts.width * sizeof(float);
  return b;
}

size_t pg_engine_slot_bytes(const pg_engine *e) {
  size_t b = 0;
  for (int v = 0; v < e->nchunks; v++) b += chunk_slot_bytes(e, &e->chunks[v]);
  return b;
}

size_t pg_engine_activation_bytes(const pg_engine *e, int peak) {
  size_t b = 0;
  for (int v = 0; v < e->nchunks; v++)
    b += chunk_slot_bytes(e, &e->chunks[v]) * (size_t)(peak ? e->chunks[v].peak_in_flight : e->chunks[v].nslots);
  return b;
}

/* ---------------------------------------------------------------- the step */

static int check_tokens(const pg_engine *e, const int32_t *ids, int64_t n, const char *what) {
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= e->opts.vocab)
      return pg_fail("%s id %d at position %lld is outside the vocabulary [0, %d)", what, ids[i], (long long)i + 1,
                     e->opts.vocab);
  return PG_OK;
}

static int wait_req(pg_engine *e, pg_request **r) {
  if (!*r) return PG_OK;
  double t0 = pg_wtime();
  int rc = pg_wait(r);
  e->stats.send_wait_seconds += pg_wtime() - t0;
  return rc;
}

static int wait_all_sends(pg_engine *e) {
  for (int v = 0; v < e->nchunks; v++) {
    pg_chunk *c = &e->chunks[v];
    for (int s = 0; s < c->nslots; s++)
      if (wait_req(e, &c->act_req[s]) || wait_req(e, &c->grad_req[s]) ||
          (c->router_req && wait_req(e, &c->router_req[s])))
        return PG_ERR;
  }
  return PG_OK;
}

static int recv_timed(pg_engine *e, float *buf, int64_t n, int src, int tag) {
  double t0 = pg_wtime();
  int rc = pg_recv_buf(e->ctx, PG_MODE_PIPELINE, buf, n, src, tag);
  e->stats.recv_wait_seconds += pg_wtime() - t0;
  return rc;
}

/* A micro-batch's routing totals travel with its activations (the layers so
 * far, down the pipeline) and with its gradients (the whole model's, from the
 * last stage back), each right after that message with the same tag: MPI
 * keeps the order of messages between two ranks with one tag. The doubles go
 * as their bytes. */
static int send_router(pg_engine *e, pg_chunk *c, const pg_io *io, int slot, int dst, int tag) {
  if (!e->router || !io->router) return PG_OK; /* evaluation keeps no totals */
  if (wait_req(e, &c->router_req[slot])) return PG_ERR; /* one send per slot in flight */
  return pg_isend_buf(e->ctx, PG_MODE_PIPELINE, (const float *)io->router, 4 * (int64_t)e->opts.router_experts, dst,
                      tag, &c->router_req[slot]);
}

static int recv_router(pg_engine *e, pg_chunk *c, pg_io *io, int slot, int src, int tag) {
  if (!e->router || !io->router) return PG_OK;
  /* the totals' own earlier send (down the pipeline) must be done before they are overwritten */
  if (wait_req(e, &c->router_req[slot])) return PG_ERR;
  return recv_timed(e, (float *)io->router, 4 * (int64_t)e->opts.router_experts, src, tag);
}

/* One action of a schedule over micro-batches ios[0..M-1] (M names the
 * transfers: pg_action_message). Training and evaluation both run here. */
static int run_action(pg_engine *e, pg_action a, pg_io *ios, int M) {
  pg_chunk *c = &e->chunks[a.chunk];
  int slot = a.mb % c->nslots, peer, tag;
  pg_action_message(a, pp_size(e), M, pp_rank(e), &peer, &tag);
  pg_io *io = &ios[a.mb];
  int64_t n = boundary_rows(e, (int64_t)io->B * io->T) * e->opts.width;
  size_t slot_off = (size_t)slot * boundary_rows_max(e, e->capacity_rows) * e->opts.width;
  float *in_buf = c->stage_in ? c->stage_in + slot_off : NULL;
  switch (a.kind) {
  case PG_ACT_RECV_ACT:
    return recv_timed(e, in_buf, n, peer, tag) || recv_router(e, c, io, slot, peer, tag);
  case PG_ACT_FORWARD: {
    if (wait_req(e, &c->act_req[slot])) return PG_ERR; /* the slot's outputs may still be on their way */
    double t0 = pg_wtime();
    int rc = pg_module_forward(c->stage, slot, io, in_buf, &c->stage_out[slot]);
    e->stats.compute_seconds += pg_wtime() - t0;
    return rc;
  }
  case PG_ACT_SEND_ACT:
    return pg_isend_buf(e->ctx, PG_MODE_PIPELINE, c->stage_out[slot], n, peer, tag, &c->act_req[slot]) ||
           send_router(e, c, io, slot, peer, tag);
  case PG_ACT_RECV_GRAD:
    return recv_timed(e, e->grad_recv, n, peer, tag) || recv_router(e, c, io, slot, peer, tag);
  case PG_ACT_BACKWARD: {
    const float *dx = NULL;
    double t0 = pg_wtime();
    int rc = pg_module_backward(c->stage, slot, io, c->is_last ? NULL : e->grad_recv, &dx);
    e->stats.compute_seconds += pg_wtime() - t0;
    if (rc || c->is_first) return rc;
    if (wait_req(e, &c->grad_req[slot])) return PG_ERR;
    return e->be->ops->copy(e->be, c->grad_send + slot_off, dx, (size_t)n * sizeof(float), PG_COPY_DEVICE_TO_DEVICE);
  }
  case PG_ACT_SEND_GRAD:
    return pg_isend_buf(e->ctx, PG_MODE_PIPELINE, c->grad_send + slot_off, n, peer, tag, &c->grad_req[slot]) ||
           send_router(e, c, io, slot, peer, tag);
  }
  return pg_fail("unknown pipeline action %d", (int)a.kind);
}

/* ---------------------------------------------------------------- overlapped reduction */

/* This member's and every other's part of bucket b: with ZeRO the bucket's
 * intersection with each member's shard (the shards are contiguous and in
 * rank order, so these are the bucket's pieces one after another). */
static void bucket_counts(const pg_engine *e, const pg_bucket *b, int64_t *counts) {
  for (int q = 0; q < e->ctx->group[b->mode].size; q++) {
    int64_t lo, hi;
    member_shard(e, region_of(e, b->lo), q, &lo, &hi);
    if (b->lo > lo) lo = b->lo;
    if (b->hi < hi) hi = b->hi;
    counts[q] = hi > lo ? hi - lo : 0;
  }
}

static int start_bucket(pg_engine *e, pg_bucket *b) {
  if (e->buckets_started++ == 0) {
    /* the members agree once per step on the set (pg_comm.h), then start its buckets in the same order */
    char what[96];
    snprintf(what, sizeof what, "overlapped gradient reduction in %d buckets", e->nbuckets);
    /* over the dense group: every member runs the same buckets (the experts' groups are inside it) */
    if (pg_agree_batch(e->ctx, pg_engine_dense_group(e), e->zero ? PG_COLL_REDUCE_SCATTER : PG_COLL_ALL_REDUCE,
                       PG_REDUCE_AVG, e->flat_padded, what))
      return PG_ERR;
    e->first_start = pg_wtime();
  }
  b->pending = -1; /* started */
  b->seq = e->bucket_seq++;
  float *g = e->sharded ? b->stage : (float *)e->grad_store->data + b->lo;
  if (!e->zero) return pg_iall_reduce_buf(e->ctx, b->mode, g, b->hi - b->lo, PG_REDUCE_AVG, &b->req);
  int64_t *counts = malloc((size_t)e->ctx->group[b->mode].size * sizeof *counts);
  if (!counts) return pg_fail("out of memory starting a gradient bucket");
  bucket_counts(e, b, counts);
  int rc = pg_ireduce_scatter_buf(e->ctx, b->mode, g, counts, PG_REDUCE_AVG, &b->req);
  free(counts);
  return rc;
}

/* Lets MPI move the buckets in flight (Open MPI progresses nonblocking
 * collectives only inside MPI calls) and completes those that are done. */
static int progress_buckets(pg_engine *e) {
  for (int k = 0; k < e->nbuckets; k++) {
    int done;
    if (e->buckets[k].req && pg_test(&e->buckets[k].req, &done)) return PG_ERR;
  }
  return PG_OK;
}

static int param_index(const pg_engine *e, const pg_param *p) {
  int lo = 0, hi = e->nparams - 1; /* by_offset is in offset order */
  while (lo <= hi) {
    int mid = (lo + hi) / 2, k = e->by_offset[mid];
    if (e->params[k]->offset == p->offset) return e->params[k] == p ? k : -1;
    if (e->params[k]->offset < p->offset) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

/* ---------------------------------------------------------------- ZeRO-2: staged gradients */

/* Points the bucket's parameters' gradients at its staging, or at nothing
 * between its staged times (NULL: the kernels then write no weight
 * gradient). Nothing writes them then: their owners stage them first
 * (pg_io.backward_begin), and a weight another module writes (borrowed) is
 * resident. */
static void aim_grads(pg_engine *e, const pg_bucket *b) {
  for (int i = b->p0; i <= b->p1; i++) {
    pg_param *p = e->params[i];
    p->grad = b->stage ? b->stage + (p->offset - b->lo) : NULL;
  }
}

/* The bucket's reduce-scatter is done: this rank's piece of it is added into
 * the shard (the sum over micro-batches of the reduced gradients; an
 * expert's divided by E, as pg_engine_sync_grads says why), and the staging
 * is zeroed for the next gradients written into it (the kernels add) and,
 * from the pool, handed back. */
static int complete_bucket(pg_engine *e, pg_bucket *b) {
  if (pg_wait(&b->req)) return PG_ERR;
  int64_t a, z;
  int region = region_of(e, b->lo);
  own_shard(e, region, &a, &z);
  if (b->lo > a) a = b->lo;
  if (b->hi < z) z = b->hi;
  float *acc = z > a ? pg_engine_grad_at(e, a) : NULL;
  if (region) { /* the experts' region: host memory only (check_shardable), each term divided by E */
    float scale = 1.0f / (float)e->ctx->expert;
    for (int64_t x = a; x < z; x++) acc[x - a] += b->stage[x - b->lo] * scale;
    memset(b->stage, 0, (size_t)(b->hi - b->lo) * sizeof(float));
  } else if ((z > a && e->be->ops->residual_forward(e->be, acc, acc, b->stage + (a - b->lo), z - a)) ||
             e->be->ops->zero(e->be, b->stage, (size_t)(b->hi - b->lo) * sizeof(float))) {
    /* residual_forward is the backend's elementwise add (out = a + x; in place here): on the device it follows
     * the reduction on the engine's stream, which pg_wait made wait for it */
    return PG_ERR;
  }
  b->seq = -1;
  b->pending = b->nparams;
  if (b->resident) return PG_OK;
  e->pool_owner[b->slot] = -1;
  b->slot = -1;
  b->stage = NULL;
  aim_grads(e, b);
  return PG_OK;
}

/* Completes the bucket started first among those in flight; 0 when none is. */
static int complete_oldest(pg_engine *e, int *found) {
  pg_bucket *o = NULL;
  for (int k = 0; k < e->nbuckets; k++) {
    pg_bucket *b = &e->buckets[k];
    if (b->seq >= 0 && b->pending < 0 && (!o || b->seq < o->seq)) o = b;
  }
  *found = o != NULL;
  return o ? complete_bucket(e, o) : PG_OK;
}

/* Bucket k's gradients are about to be written: it gets a pool slot (the
 * oldest reduction in flight completes to free one; the pool grows only when
 * every slot holds a bucket still being written). A bucket still in flight
 * from the previous micro-batch completes first. */
static int stage_bucket(pg_engine *e, pg_bucket *b) {
  if (b->resident) return PG_OK;
  if (b->pending < 0 && b->seq >= 0 && complete_bucket(e, b)) return PG_ERR;
  if (b->stage) return PG_OK;
  int s = -1;
  for (;;) {
    for (int i = 0; i < e->npool && s < 0; i++)
      if (e->pool_owner[i] < 0) s = i;
    int found = 0;
    if (s >= 0) break;
    if (complete_oldest(e, &found)) return PG_ERR;
    if (!found) break;
  }
  if (s < 0) {
    float **pool = realloc(e->pool, (size_t)(e->npool + 1) * sizeof *pool);
    if (pool) e->pool = pool;
    int *owner = pool ? realloc(e->pool_owner, (size_t)(e->npool + 1) * sizeof *owner) : NULL;
    if (owner) e->pool_owner = owner;
    float *slot = owner ? pg_be_floats(e->be, (size_t)e->pool_elems) : NULL;
    if (!slot) return pg_fail("zero = 2: out of memory for a gradient staging buffer of %lld floats",
                              (long long)e->pool_elems);
    s = e->npool++;
    e->pool[s] = slot;
  }
  e->pool_owner[s] = (int)(b - e->buckets);
  b->slot = s;
  b->stage = e->pool[s];
  aim_grads(e, b);
  return PG_OK;
}

static int gather_for(pg_engine *e, pg_module *m, int step);
static int zero3_backward_done(pg_engine *e, pg_module *m);

/* pg_io.backward_begin: module m is about to write its parameters' gradients
 * (with ZeRO-3 its parameters are gathered first). */
static int on_backward_begin(void *ud, pg_module *m) {
  pg_engine *e = ud;
  if (e->params_sharded && gather_for(e, m, -1)) return PG_ERR;
  if (!e->sharded) return PG_OK;
  for (int i = 0; i < m->nparams; i++) {
    int k = param_index(e, m->params[i]);
    if (k < 0) return pg_fail("module %s: parameter %s is not this engine's", m->name, m->params[i]->name);
    if (stage_bucket(e, &e->buckets[e->param_bucket[k]])) return PG_ERR;
  }
  return PG_OK;
}

/* Every micro-batch's backward: a bucket whose parameters are all written
 * starts its reduce-scatter (without overlap_grad_reduce it is waited for at
 * once); resident ones are reduced at the end of the call. */
static int sharded_backward_done(pg_engine *e, pg_module *m) {
  for (int i = 0; i < m->nparams; i++) {
    int k = param_index(e, m->params[i]);
    if (k < 0) return pg_fail("module %s: parameter %s is not this engine's", m->name, m->params[i]->name);
    pg_bucket *b = &e->buckets[e->param_bucket[k]];
    if (b->pending <= 0 || --b->pending > 0) continue;
    if (b->resident) {
      b->pending = b->nparams; /* the next micro-batch adds to the same staging */
      continue;
    }
    b->started_in_backward = 1;
    if (start_bucket(e, b) || (!e->opts.overlap_grad_reduce && complete_bucket(e, b))) return PG_ERR;
  }
  return progress_buckets(e);
}

static int tied_reduce(pg_engine *e);
static int sync_sequence_parallel(pg_engine *e);

/* The end of every call with ZeRO-2 (whether it syncs or not: the
 * gradients of a call exist only as the shard): the buckets in flight
 * complete, a bucket written only in part (a module that ran no backward)
 * is reduced as it is, then the tied embedding's sum and the resident
 * buckets, in bucket order on every member. */
static int finish_sharded(pg_engine *e) {
  double t0 = pg_wtime();
  e->started_in_backward = 0; /* buckets, not starts (each starts once per micro-batch) */
  for (int k = 0; k < e->nbuckets; k++) {
    e->started_in_backward += e->buckets[k].started_in_backward;
    e->buckets[k].started_in_backward = 0;
  }
  int found = 1;
  while (found)
    if (complete_oldest(e, &found)) return PG_ERR;
  for (int k = 0; k < e->nbuckets; k++) {
    pg_bucket *b = &e->buckets[k];
    if (!b->resident && b->stage && (start_bucket(e, b) || complete_bucket(e, b))) return PG_ERR;
  }
  if (sync_sequence_parallel(e) || tied_reduce(e)) return PG_ERR;
  for (int k = 0; k < e->nbuckets; k++) {
    pg_bucket *b = &e->buckets[k];
    if (b->resident && (start_bucket(e, b) || complete_bucket(e, b))) return PG_ERR;
  }
  for (int k = 0; k < e->nbuckets; k++) e->buckets[k].pending = e->buckets[k].nparams;
  double t1 = pg_wtime();
  e->stats.exposed_comm_seconds += t1 - t0;
  if (e->buckets_started) e->stats.grad_sync_seconds += t1 - e->first_start;
  e->buckets_started = 0;
  return PG_OK;
}

/* pg_io.backward_done: module m's parameters have their gradients of this
 * micro-batch; in a chunk's last backward of a step that syncs those are
 * final, and a bucket whose every parameter is final starts. */
static int on_backward_done(void *ud, pg_module *m) {
  pg_engine *e = ud;
  if (e->sharded) return sharded_backward_done(e, m) || (e->params_sharded && zero3_backward_done(e, m));
  if (!e->final_pass) return PG_OK;
  for (int i = 0; i < m->nparams; i++) {
    int k = param_index(e, m->params[i]);
    if (k < 0) return pg_fail("module %s: parameter %s is not this engine's", m->name, m->params[i]->name);
    pg_bucket *b = &e->buckets[e->param_bucket[k]];
    if (b->pending > 0 && --b->pending == 0 && !b->deferred && start_bucket(e, b)) return PG_ERR;
  }
  return progress_buckets(e);
}


/* ---------------------------------------------------------------- ZeRO-3: gathered parameters */

/* A slot of the gather pool for unit u (a resident unit has its own): a
 * free one, or a new one when every slot is held (nested units, prefetch). */
static int add_gather_slot(pg_engine *e) {
  float **pool = realloc(e->gpool, (size_t)(e->ngpool + 1) * sizeof *pool);
  if (pool) e->gpool = pool;
  int *owner = pool ? realloc(e->gpool_owner, (size_t)(e->ngpool + 1) * sizeof *owner) : NULL;
  if (owner) e->gpool_owner = owner;
  float *slot = owner ? pg_be_floats(e->be, (size_t)e->gpool_elems) : NULL;
  if (!slot) {
    pg_fail("zero = 3: out of memory for a parameter gather slot of %lld floats", (long long)e->gpool_elems);
    return -1;
  }
  e->gpool[e->ngpool] = slot;
  e->gpool_owner[e->ngpool] = -1;
  return e->ngpool++;
}

static int unit_buffer(pg_engine *e, pg_gather_unit *u) {
  if (u->buf) return PG_OK;
  int s = -1;
  for (int i = 0; i < e->ngpool && s < 0; i++)
    if (e->gpool_owner[i] < 0) s = i;
  if (s < 0 && (s = add_gather_slot(e)) < 0) return PG_ERR;
  e->gpool_owner[s] = (int)(u - e->units);
  u->slot = s;
  u->buf = e->gpool[s];
  return PG_OK;
}

/* The elements of u's set (bf16: the gather_bf16 weights; else the others) inside [a, z) of the flat buffer. */
static int64_t set_elems_in(const pg_gather_unit *u, int bf16, int64_t a, int64_t z) {
  int64_t n = 0;
  for (int i = 0; i < u->nparams; i++) {
    const pg_param *p = u->params[i];
    int64_t lo = p->offset > a ? p->offset : a, hi = p->offset + p->numel < z ? p->offset + p->numel : z;
    if ((p->gather_bf16 != 0) == bf16 && hi > lo) n += hi - lo;
  }
  return n;
}

/* A call's gather of u under bf16 gathers: this rank's piece of each parameter, rounded to bf16 (the bits the
 * modules' own working copies had: pg_bf16_from_f32) or copied, into its packed place; then, region by region,
 * the bf16 part's and the float32 part's all-gathers over the region's group. Rounding before the gather gives
 * what rounding after it would. */
static int start_packed_gather(pg_engine *e, pg_gather_unit *u, int64_t *counts) {
  uint16_t *b16 = (uint16_t *)u->buf;
  float *f32 = u->buf + (u->n16 + 1) / 2;
  const pg_backend *be = e->be; /* the backend's kernel and copy: queued on the device's stream before the gather */
  for (int i = 0; i < u->nparams; i++) {
    const pg_param *p = u->params[i];
    int64_t a, z;
    own_shard(e, p->expert, &a, &z);
    if (p->offset > a) a = p->offset;
    if (p->offset + p->numel < z) z = p->offset + p->numel;
    if (z <= a) continue;
    const float *mine = pg_engine_param_at(e, a);
    if (p->gather_bf16 ? be->ops->bf16_from_f32(be, b16 + u->at[i] + (a - p->offset), mine, z - a)
                       : be->ops->copy(be, f32 + u->at[i] + (a - p->offset), mine, (size_t)(z - a) * sizeof(float),
                                       PG_COPY_DEVICE_TO_DEVICE))
      return PG_ERR;
  }
  for (int r = 0; r < 2; r++)
    for (int set = 1; set >= 0; set--) { /* every member starts the bf16 part first */
      int64_t before = set_elems_in(u, set, 0, region_lo(e, r)); /* the set's elements of the regions before */
      if (set_elems_in(u, set, region_lo(e, r), region_hi(e, r)) == 0) continue;
      for (int q = 0; q < e->ctx->group[region_group(e, r)].size; q++) {
        int64_t lo, hi;
        member_shard(e, r, q, &lo, &hi);
        counts[q] = set_elems_in(u, set, lo, hi);
      }
      if (pg_iall_gather_v_buf(e->ctx, region_group(e, r), set ? (void *)(b16 + before) : (void *)(f32 + before),
                               counts, set ? PG_BFLOAT16 : PG_FLOAT32, set ? &u->req16[r] : &u->reqs[r]))
        return PG_ERR;
    }
  return PG_OK;
}

/* Unit u's elements in region r, in all, and where p's start in its float32 gather (region 0's range first). */
static int64_t unit_len(const pg_gather_unit *u, int r) { return u->hi[r] - u->lo[r]; }
static int64_t unit_elems(const pg_gather_unit *u) { return unit_len(u, 0) + unit_len(u, 1); }
static int64_t unit_place(const pg_gather_unit *u, const pg_param *p) {
  return (p->expert ? unit_len(u, 0) : 0) + p->offset - u->lo[p->expert];
}

/* Whether any of u's gathers is in flight; waits for them all. */
static int unit_in_flight(const pg_gather_unit *u) { return u->reqs[0] || u->reqs[1] || u->req16[0] || u->req16[1]; }
static int wait_unit(pg_gather_unit *u) {
  int rc = PG_OK;
  for (int r = 0; r < 2; r++)
    if (pg_wait(&u->req16[r]) || pg_wait(&u->reqs[r])) rc = PG_ERR;
  return rc;
}

/* Starts unit u's all-gathers (nothing when it is gathered or on its way):
 * this rank's piece of each region's range from the shard into its place in
 * the buffer, then the nonblocking all-gather of every member's piece over
 * the region's group. In a
 * call (in_call) under bf16 gathers, the packed bf16 and float32 parts;
 * outside one (a checkpoint's or Lua's read), float32 into a buffer of its
 * own when the pool's slots are sized for the packed ones. */
static int start_gather(pg_engine *e, pg_gather_unit *u, int in_call) {
  if (u->gathered || unit_in_flight(u)) return PG_OK;
  if (e->gathers_started++ == 0) {
    char what[96]; /* the members agree once per call on the set, then start its gathers in the same order */
    snprintf(what, sizeof what, "zero-3 parameter gathers of %d units", e->nunits);
    if (pg_agree_batch(e->ctx, pg_engine_dense_group(e), PG_COLL_ALL_GATHER, PG_REDUCE_SUM, e->flat_padded, what))
      return PG_ERR;
  }
  u->packed = in_call && e->gather16;
  if (!u->packed && e->gather16 && !u->resident) {
    if (!(u->buf = pg_be_floats(e->be, (size_t)unit_elems(u))))
      return pg_fail("zero = 3: out of memory gathering module %s (%lld floats)", u->m->name,
                     (long long)unit_elems(u));
    u->own_buf = 1;
  } else if (unit_buffer(e, u)) {
    return PG_ERR;
  }
  int64_t *counts = malloc((size_t)dense_size(e) * sizeof *counts); /* the experts' group is inside the dense one */
  if (!counts) return pg_fail("out of memory starting a parameter gather");
  e->unit_gathers++;
  int rc = PG_OK;
  if (u->packed) rc = start_packed_gather(e, u, counts);
  for (int r = 0; r < 2 && !u->packed && !rc; r++) {
    if (unit_len(u, r) == 0) continue;
    const pg_group *g = &e->ctx->group[region_group(e, r)];
    float *at = u->buf + (r ? unit_len(u, 0) : 0); /* region r's range */
    for (int q = 0; q < g->size; q++) {
      int64_t a, z;
      member_shard(e, r, q, &a, &z);
      if (u->lo[r] > a) a = u->lo[r];
      if (u->hi[r] < z) z = u->hi[r];
      counts[q] = z > a ? z - a : 0;
      /* this rank's piece from its shard (on the device: queued on its stream before the gather) */
      if (q == g->rank && counts[q] && !rc)
        rc = e->be->ops->copy(e->be, at + (a - u->lo[r]), pg_engine_param_at(e, a), (size_t)counts[q] * sizeof(float),
                              PG_COPY_DEVICE_TO_DEVICE);
    }
    if (!rc) rc = pg_iall_gather_v_buf(e->ctx, region_group(e, r), at, counts, PG_FLOAT32, &u->reqs[r]);
  }
  free(counts);
  return rc;
}

/* Unit u's parameters usable: its gather started (if not yet) and complete. */
static int finish_gather(pg_engine *e, pg_gather_unit *u, int in_call) {
  if (u->gathered) return PG_OK;
  if (start_gather(e, u, in_call) || wait_unit(u)) return PG_ERR;
  for (int i = 0; i < u->nparams; i++) {
    pg_param *p = u->params[i];
    p->data16 = NULL;
    if (!u->packed) p->data = u->buf + unit_place(u, p);
    else if (p->gather_bf16) p->data16 = (const uint16_t *)u->buf + u->at[i], p->data = NULL;
    else p->data = u->buf + (u->n16 + 1) / 2 + u->at[i];
  }
  u->gathered = 1;
  return PG_OK;
}

/* Unit u's parameters freed (a gather in flight completes first: MPI writes its buffer). */
static int release_unit(pg_engine *e, pg_gather_unit *u) {
  if (wait_unit(u)) return PG_ERR;
  for (int i = 0; i < u->nparams; i++) {
    u->params[i]->data = NULL;
    u->params[i]->data16 = NULL;
  }
  u->gathered = u->packed = 0;
  if (u->own_buf) {
    pg_be_release(e->be, u->buf);
    u->buf = NULL;
    u->own_buf = 0;
  } else if (!u->resident && u->slot >= 0) {
    e->gpool_owner[u->slot] = -1;
    u->slot = -1;
    u->buf = NULL;
  }
  return PG_OK;
}

/* The end of every call (and the start: what a failed call left): every unit released. */
static int release_units(pg_engine *e) {
  for (int k = 0; k < e->nunits; k++)
    if (release_unit(e, &e->units[k])) return PG_ERR;
  e->gathers_started = 0;
  return PG_OK;
}

/* The unit of a hook's module: the unit itself, or the one whose tree owns its parameters. */
static pg_gather_unit *unit_of(pg_engine *e, pg_module *m) {
  if (m->gather_unit)
    for (int k = 0; k < e->nunits; k++)
      if (e->units[k].m == m) return &e->units[k];
  int k = m->nparams > 0 ? param_index(e, m->params[0]) : -1;
  if (k < 0) {
    pg_fail("module %s is in no gather unit of this engine", m->name);
    return NULL;
  }
  return &e->units[e->param_unit[k]];
}

/* Before a unit's forward (step = +1) or backward (-1), and again (no-op)
 * for every module inside it: its gather completed, and the gather of the
 * unit that runs next in that direction (within the chunk: the chunks'
 * order is the schedule's) started, so that it moves while this one
 * computes (prefetch). */
static int gather_for(pg_engine *e, pg_module *m, int step) {
  pg_gather_unit *u = unit_of(e, m);
  if (!u) return PG_ERR;
  int k = (int)(u - e->units), next = k + step;
  if (start_gather(e, u, 1)) return PG_ERR;
  /* from the unit's own hook only: a module inside it runs within the unit's forward or backward (the
   * recomputed forward inside backward must not fetch the unit after it) */
  if (e->prefetch && u->m == m && next >= 0 && next < e->nunits && e->units[next].chunk == u->chunk &&
      start_gather(e, &e->units[next], 1))
    return PG_ERR;
  return finish_gather(e, u, 1);
}

static int on_forward_begin(void *ud, pg_module *m) { return gather_for(ud, m, +1); }

/* After a unit's forward (not a module's inside it): released with
 * reshard_after_forward (gathered again for its backward), else kept to the
 * end of the call. The same after its backward. */
static int unit_done(pg_engine *e, pg_module *m) {
  pg_gather_unit *u = unit_of(e, m);
  if (!u) return PG_ERR;
  return u->m == m && e->reshard_after_forward && !u->resident ? release_unit(e, u) : PG_OK;
}

static int on_forward_done(void *ud, pg_module *m) { return unit_done(ud, m); }

static int zero3_backward_done(pg_engine *e, pg_module *m) { return unit_done(e, m); }

/* One gather unit: module m's tree. Its parameters lie in [lo[r], hi[r]) of
 * each region of the flat buffer (a tree's parameters of a region are
 * consecutive there, chunk order being tree order). A unit owning a weight
 * another module reads (the tied head's embedding) is resident: that module
 * runs outside the owner's hooks. */
static int add_unit(pg_engine *e, pg_module *m, int chunk) {
  pg_gather_unit *u = &e->units[e->nunits];
  *u = (pg_gather_unit){.m = m, .chunk = chunk, .lo = {INT64_MAX, INT64_MAX}, .slot = -1};
  if (!(u->params = pg_module_collect_params(m, &u->nparams))) return PG_ERR;
  e->nunits++;
  if (!(u->at = calloc((size_t)u->nparams + 1, sizeof *u->at))) return pg_fail("zero = 3: out of memory");
  for (int r = 0; r < 2; r++) /* the packed sets: the dense region's elements, then the experts' */
    for (int i = 0; i < u->nparams; i++) {
      pg_param *p = u->params[i];
      if (p->expert != r) continue;
      int k = param_index(e, p);
      if (k < 0) return pg_fail("module %s: parameter %s is not this engine's", m->name, p->name);
      if (p->offset < u->hi[r]) /* the packed sets' order */
        return pg_fail("zero = 3: module %s: parameter %s lies before the one it follows in the flat buffer",
                       m->name, p->name);
      u->at[i] = p->gather_bf16 ? u->n16 : u->n32;
      *(p->gather_bf16 ? &u->n16 : &u->n32) += p->numel;
      e->param_unit[k] = e->nunits - 1;
      if (p->offset < u->lo[r]) u->lo[r] = p->offset;
      u->hi[r] = p->offset + p->numel;
      if (borrowed(e, p)) u->resident = 1;
    }
  for (int r = 0; r < 2; r++)
    if (u->lo[r] > u->hi[r]) u->lo[r] = u->hi[r] = 0; /* no parameter there */
  if (unit_elems(u) > BUCKET_MAX)
    return pg_fail("zero = 3: module %s has parameters over more than 2^30 elements (one gather): use zero = 2",
                   m->name);
  m->gather_unit = 1;
  return PG_OK;
}

/* The gather units of a chunk, in the order of forward: each child of its
 * root container whose tree holds parameters (FSDP wraps each transformer
 * block; the embedding and the final norm are units of their own), or the
 * whole root when it owns parameters itself or has no children. */
static int collect_units(pg_engine *e, pg_module *root, int chunk) {
  int n = 0;
  pg_param **ps = pg_module_collect_params(root, &n);
  if (!ps) return PG_ERR;
  free(ps);
  if (n == 0) return PG_OK;
  if (root->nparams > 0 || root->nchildren == 0) return add_unit(e, root, chunk);
  for (int i = 0; i < root->nchildren; i++) {
    if (!(ps = pg_module_collect_params(root->children[i], &n))) return PG_ERR;
    free(ps);
    if (n > 0 && add_unit(e, root->children[i], chunk)) return PG_ERR;
  }
  return PG_OK;
}

static void free_units(pg_engine *e) {
  for (int k = 0; k < e->nunits && !pg_comm_broken(e->ctx); k++) wait_unit(&e->units[k]);
  for (int k = 0; k < e->nunits; k++)
    if (e->units[k].own_buf) pg_be_release(e->be, e->units[k].buf);
  for (int k = 0; k < e->nunits; k++) {
    if (e->units[k].resident) pg_be_release(e->be, e->units[k].buf);
    free(e->units[k].at);
    free(e->units[k].params); /* the modules' gather_unit flags stay: without ZeRO-3's hooks nobody reads them */
  }
  for (int i = 0; i < e->ngpool; i++) pg_be_release(e->be, e->gpool[i]);
  free(e->gpool);
  free(e->gpool_owner);
  free(e->units);
  free(e->param_unit);
  e->gpool = NULL;
  e->gpool_owner = NULL;
  e->units = NULL;
  e->param_unit = NULL;
  e->ngpool = e->nunits = 0;
}

int pg_engine_set_reshard_after_forward(pg_engine *e, int on) {
  if (e->params_sharded && e->gathers_started)
    return pg_fail("reshard_after_forward cannot change while a call holds gathered parameters");
  e->reshard_after_forward = on != 0;
  return PG_OK;
}

int pg_engine_set_prefetch(pg_engine *e, int on) {
  if (e->params_sharded && e->gathers_started)
    return pg_fail("prefetch cannot change while a call holds gathered parameters");
  e->prefetch = on != 0;
  return PG_OK;
}

/* The gather units, the resident units' buffers and the pool's first two
 * slots (the unit computing and the one prefetched: memory() says before
 * the first step what training holds); the pool's slots hold the largest
 * unit that is not resident. */
static int make_units(pg_engine *e) {
  /* precision bf16: the weights read only as bf16 are gathered in bf16 and the modules' whole working copies go
   * (pg_module_bf16_gathered): one bf16 copy of a unit, while it is gathered, instead of the stage's */
  if (e->opts.precision == PG_PRECISION_BF16) {
    e->gather16 = 1;
    for (int v = 0; v < e->nchunks; v++) pg_module_bf16_gathered(e->chunks[v].stage);
  }
  if (!(e->units = calloc((size_t)e->nparams + 1, sizeof *e->units)) ||
      !(e->param_unit = calloc((size_t)e->nparams + 1, sizeof *e->param_unit)))
    return pg_fail("zero = 3: out of memory");
  for (int v = 0; v < e->nchunks; v++)
    if (collect_units(e, e->chunks[v].stage, v)) return PG_ERR;
  e->gpool_elems = e->gresident_elems = 0;
  int pooled = 0;
  for (int k = 0; k < e->nunits; k++) {
    pg_gather_unit *u = &e->units[k];
    int64_t n = unit_elems(u);
    if (!u->resident) { /* a slot holds a call's gather: the packed parts under bf16 gathers */
      int64_t need = e->gather16 ? (u->n16 + 1) / 2 + u->n32 : n;
      pooled++;
      if (need > e->gpool_elems) e->gpool_elems = need;
      continue;
    }
    if (!(u->buf = pg_be_floats(e->be, (size_t)n)))
      return pg_fail("zero = 3: out of memory for a gather buffer of %lld floats", (long long)n);
    e->gresident_elems += n;
  }
  for (int i = 0; i < (pooled < 2 ? pooled : 2); i++)
    if (add_gather_slot(e) < 0) return PG_ERR;
  return PG_OK;
}

int pg_engine_shard_params(pg_engine *e) {
  if (e->params_sharded || dense_size(e) == 1) return PG_OK; /* one replica: the shard is the whole buffer */
  if (!e->sharded)
    return pg_fail("zero = 3: the gradients must be sharded first (pg_engine_shard_grads)");
  int64_t per = shard_elems(e);
  pg_storage *shard = NULL;
  if (make_units(e) || !(shard = pg_backend_storage(e->be, (size_t)per * sizeof(float)))) {
    free_units(e);
    return shard ? PG_ERR : pg_fail("zero = 3: the parameter shard (%lld floats): %s", (long long)per, pg_error());
  }
  if (copy_shards(e, shard->data, e->param_store->data)) {
    free_units(e);
    pg_storage_release(shard);
    return PG_ERR;
  }
  pg_shm_close(&e->param_shm);
  pg_storage_release(e->param_store);
  e->param_store = shard;
  e->params_sharded = 1;
  for (int i = 0; i < e->nparams; i++) e->params[i]->data = NULL;
  return PG_OK;
}

/* ZeRO-3 from construction (opts.zero = 3, data > 1; bind_params has laid
 * the flat buffer out): only this rank's shards of the parameters and the
 * gradients are allocated, each parameter initialised alone into a scratch
 * of its own size and its part in the shard kept, so that the whole stage is
 * never held; then ZeRO-2's buckets and staging and the gather units. */
static int zero3_at_construction(pg_engine *e, uint64_t seed) {
  e->zero = 3;
  if (check_shardable(e)) return PG_ERR;
  size_t bytes = (size_t)shard_elems(e) * sizeof(float);
  if (!(e->param_store = pg_backend_storage(e->be, bytes)) || !(e->grad_store = pg_backend_storage(e->be, bytes)))
    return pg_fail("zero = 3: the parameter and gradient shards (2 x %zu bytes): %s", bytes, pg_error());
  if (e->be->ops->zero(e->be, e->param_store->data, bytes) || e->be->ops->zero(e->be, e->grad_store->data, bytes))
    return PG_ERR;
  e->sharded = e->params_sharded = 1; /* pg_engine_write_param keeps the part in the shard */
  for (int i = 0; i < e->nparams; i++) {
    pg_param *p = e->params[i];
    float *full = malloc((size_t)p->numel * sizeof(float));
    if (!full) return pg_fail("zero = 3: out of memory initialising %s", p->name);
    p->data = full;
    pg_param_init(p, seed);
    int rc = pg_engine_write_param(e, p, full);
    free(full);
    p->data = p->grad = NULL;
    if (rc) return PG_ERR;
  }
  if (build_buckets(e) || make_staging(e) || make_units(e)) return PG_ERR;
  return PG_OK;
}

float *pg_engine_param_at(const pg_engine *e, int64_t off) {
  return (float *)e->param_store->data + (e->params_sharded ? shard_index(e, off) : off);
}

size_t pg_engine_param_bytes(const pg_engine *e) {
  if (!e->params_sharded) return (size_t)e->flat_padded * sizeof(float);
  return e->param_store->bytes + ((size_t)e->ngpool * (size_t)e->gpool_elems + (size_t)e->gresident_elems) * sizeof(float);
}

/* Before a step that syncs: every bucket waiting for its parameters again.
 * What a step that failed part way left in flight completes first (it
 * started on every member); a step that finished left nothing. */
static int reset_buckets(pg_engine *e) {
  for (int k = 0; k < e->nbuckets; k++) {
    pg_bucket *b = &e->buckets[k];
    if (pg_wait(&b->req)) return PG_ERR;
    b->pending = b->nparams;
    b->seq = -1;
    if (b->stage && !b->resident) { /* ZeRO-2: what a failed call left staged is dropped */
      if (e->be->ops->zero(e->be, b->stage, (size_t)(b->hi - b->lo) * sizeof(float))) return PG_ERR;
      e->pool_owner[b->slot] = -1;
      b->slot = -1;
      b->stage = NULL;
      aim_grads(e, b);
    }
  }
  e->buckets_started = 0;
  return PG_OK;
}

/* The end of a step whose buckets started during backward: the tied
 * embedding's sum, then its bucket and any bucket that did not start (a
 * parameter whose module never ran backward), in bucket order on every
 * member; then the waits. */
static int finish_buckets(pg_engine *e) {
  double t0 = pg_wtime();
  e->started_in_backward = e->buckets_started;
  if (sync_sequence_parallel(e) || tied_reduce(e)) return PG_ERR;
  for (int k = 0; k < e->nbuckets; k++)
    if (e->buckets[k].pending >= 0 && start_bucket(e, &e->buckets[k])) return PG_ERR;
  for (int k = 0; k < e->nbuckets; k++)
    if (pg_wait(&e->buckets[k].req)) return PG_ERR;
  double t1 = pg_wtime();
  e->stats.exposed_comm_seconds += t1 - t0;
  e->stats.grad_sync_seconds += t1 - e->first_start;
  for (int k = 0; k < e->nbuckets; k++) e->buckets[k].pending = e->buckets[k].nparams;
  e->buckets_started = 0;
  e->grads_pending = 0;
  return PG_OK;
}

/* The mean loss of the last stage, made the same on every rank: broadcast down
 * the pipeline group, then averaged over the data group (equal shares; with
 * context parallelism over data x context, each rank's mean being over its
 * equal share of every sequence's tokens: the mean over all tokens). */
static int share_loss(pg_engine *e, double *loss) {
  if (pg_broadcast_buf(e->ctx, PG_MODE_PIPELINE, loss, 1, PG_FLOAT64, pp_size(e) - 1) ||
      pg_all_reduce_buf(e->ctx, pg_engine_dense_group(e), loss, 1, PG_FLOAT64, PG_REDUCE_SUM))
    return PG_ERR;
  *loss /= dense_size(e);
  return PG_OK;
}

static int check_batch(pg_engine *e, const int32_t *tokens, const int32_t *targets, int B, int T, int chunks_of_m) {
  if (B < 1 || T < 1) return pg_fail("batch shape must be positive, got %d x %d", B, T);
  if ((int64_t)B * T > INT32_MAX) return pg_fail("a batch of %d x %d tokens: at most 2^31 - 1 tokens", B, T);
  if (chunks_of_m && B % e->opts.micro_batches) {
    if (e->ctx->data > 1)
      return pg_fail("batch %d per data rank (global batch %lld over data=%d) is not divisible by micro_batches=%d: "
                     "the global batch must be a multiple of data x micro_batches = %lld",
                     B, (long long)B * e->ctx->data, e->ctx->data, e->opts.micro_batches,
                     (long long)e->ctx->data * e->opts.micro_batches);
    return pg_fail("batch %d is not divisible by micro_batches=%d", B, e->opts.micro_batches);
  }
  if (check_tokens(e, tokens, (int64_t)B * T, "input token")) return PG_ERR;
  /* an objective gives targets its own meaning (class labels, ignored positions) and checks them */
  if (targets && !e->opts.objective && check_tokens(e, targets, (int64_t)B * T, "target token")) return PG_ERR;
  return PG_OK;
}

/* A device engine's embedding and head read the ids on the device: the
 * batch (checked on the host) is copied over once per call. */
static int ids_on_backend(pg_engine *e, const int32_t **tokens, const int32_t **targets, int64_t n) {
  if (e->be->device == PG_CPU) return PG_OK;
  if (n > e->device_ids_cap) {
    pg_be_release(e->be, e->device_ids);
    e->device_ids_cap = 0;
    if (!(e->device_ids = e->be->ops->alloc(e->be, 2 * (size_t)n * sizeof(int32_t))))
      return pg_fail("token ids on %s: %s", e->be->name, pg_error());
    e->device_ids_cap = n;
  }
  size_t bytes = (size_t)n * sizeof(int32_t);
  if (e->be->ops->copy(e->be, e->device_ids, *tokens, bytes, PG_COPY_HOST_TO_DEVICE) ||
      (*targets && e->be->ops->copy(e->be, e->device_ids + n, *targets, bytes, PG_COPY_HOST_TO_DEVICE)))
    return PG_ERR;
  *tokens = e->device_ids;
  if (*targets) *targets = e->device_ids + n;
  return PG_OK;
}

/* ---------------------------------------------------------------- context parallelism */

static int evaluate_rows(pg_engine *e, const int32_t *tokens, const int32_t *targets, int B, int T, double *loss,
                         float *logits);

static int cp_on(const pg_engine *e) { return e->ctx->context > 1; }

/* What context parallelism cannot serve, refused when the engine is made. */
static int cp_check_engine(const pg_engine *e) {
  if (!cp_on(e)) return PG_OK;
  int C = e->ctx->context;
  if (e->flat_padded > e->dense_padded)
    return pg_fail("context=%d with expert parallelism (expert=%d) is not supported (the experts' gradients are "
                   "averaged over expert_data, which does not span the context group): use expert = 1 or context = 1",
                   C, e->ctx->expert);
  if (e->opts.objective)
    return pg_fail("context=%d with an objective written in Lua is not supported (it would see two chunks of each "
                   "sequence as its rows): use the model's own loss or context = 1", C);
  return PG_OK;
}

/* ... and per batch: the sequence cut into 2C equal chunks. */
static int cp_check(const pg_engine *e, int T, const char *what) {
  if (!cp_on(e)) return PG_OK;
  int C = e->ctx->context;
  if (T % (2 * C))
    return pg_fail("%s: sequence length %d is not divisible by 2 x context = %d (each context rank holds two of the "
                   "2C equal chunks of every sequence)", what, T, 2 * C);
  return PG_OK;
}

/* Every context rank of a data rank receives the same full [B, T] ids; this one keeps chunks r and 2C-1-r of
 * each sequence (pg_cp_position), inputs and targets alike, as a [B, T / C] batch. */
static int cp_local_batch(pg_engine *e, const int32_t **tokens, const int32_t **targets, int B, int *T) {
  int C = e->ctx->context, r = e->ctx->cp_rank, Tl = *T / C;
  int64_t L = Tl / 2, n = (int64_t)B * Tl;
  if (n > e->cp_ids_cap) {
    int32_t *ids = realloc(e->cp_ids, 2 * (size_t)n * sizeof *ids);
    if (!ids) return pg_fail("out of memory for this context rank's chunks of the batch");
    e->cp_ids = ids;
    e->cp_ids_cap = n;
  }
  for (int which = 0; which < 2; which++) {
    const int32_t *src = which ? *targets : *tokens;
    if (!src) continue;
    int32_t *dst = e->cp_ids + (size_t)which * n;
    for (int b = 0; b < B; b++)
      for (int64_t t = 0; t < Tl; t++) dst[(int64_t)b * Tl + t] = src[(int64_t)b * *T + pg_cp_position(C, r, L, t)];
  }
  *tokens = e->cp_ids;
  if (*targets) *targets = e->cp_ids + n;
  *T = Tl;
  return PG_OK;
}

int pg_engine_forward_backward(pg_engine *e, const int32_t *tokens, const int32_t *targets, int B, int T,
                               float grad_scale, int sync, double *loss) {
  double t0 = pg_wtime();
  if (check_batch(e, tokens, targets, B, T, 1) || cp_check(e, T, "forward_backward") ||
      (cp_on(e) && cp_local_batch(e, &tokens, &targets, B, &T)))
    return PG_ERR;
  const int32_t *host_targets = targets;
  if (ids_on_backend(e, &tokens, &targets, (int64_t)B * T)) return PG_ERR;
  int M = e->opts.micro_batches, Bm = B / M;
  if (ensure_capacity(e, Bm * T)) return PG_ERR;
  float dloss = grad_scale / (float)((int64_t)B * T);
  size_t nr = 2 * (size_t)e->opts.router_experts;
  if (e->router) memset(e->router, 0, (size_t)M * nr * sizeof *e->router);
  for (int i = 0; i < M; i++) {
    size_t off = (size_t)i * Bm * T;
    e->ios[i] = (pg_io){.B = Bm, .T = T, .tokens = tokens + off, .targets = targets + off, .dloss = dloss,
                        .want_grad = 1, .loss_sum = 0, .logits = NULL, .mb = i, .row0 = (int64_t)off,
                        .host_targets = host_targets + off, .router = e->router ? e->router + i * nr : NULL,
                        .backward_done = buckets_apply(e) ? on_backward_done : NULL,
                        .backward_begin = e->sharded ? on_backward_begin : NULL, .backward_ud = e,
                        .forward_begin = e->params_sharded ? on_forward_begin : NULL,
                        .forward_done = e->params_sharded ? on_forward_done : NULL,
                        .step = e->stats.steps, .global_row0 = (int64_t)e->ctx->dp_rank * B * T + (int64_t)off,
                        .cp_chunk = cp_on(e) ? T / 2 : 0};
    lend_bf16_scratch(e, &e->ios[i]);
  }
  /* gradients accumulated over calls with sync = 0 reduce on the call that
   * syncs; with ZeRO-2 on every call (only the shard can accumulate) */
  e->overlap_now = (sync || e->sharded) && buckets_apply(e);
  if ((e->overlap_now && reset_buckets(e)) || release_units(e)) return PG_ERR;
  for (int k = 0; k < e->nactions; k++) {
    pg_action a = e->actions[k];
    e->final_pass = e->overlap_now && a.kind == PG_ACT_BACKWARD && k == e->last_backward[a.chunk];
    int rc = run_action(e, a, e->ios, M) || (e->buckets_started && progress_buckets(e));
    e->final_pass = 0;
    if (rc) return PG_ERR;
  }
  if (wait_all_sends(e)) return PG_ERR;
  for (int v = 0; v < e->nchunks; v++) {
    int live = pg_schedule_max_in_flight(e->actions, e->nactions, v);
    if (live > e->chunks[v].peak_in_flight) e->chunks[v].peak_in_flight = live;
  }
  e->grads_pending = !e->sharded;
  double sum = 0, aux = 0;
  for (int i = 0; i < M; i++) {
    sum += e->ios[i].loss_sum;
    aux += e->ios[i].aux_sum;
  }
  *loss = e->is_last ? sum / ((double)B * T) : 0;
  if (share_loss(e, loss)) return PG_ERR;
  /* auxiliary losses come from the stages that hold MoE layers (the load-balancing
   * one from the last MoE layer's): summed over the pipeline, averaged over the data group (data x context
   * under context parallelism: each rank's share of the tokens) */
  aux /= (double)B * T;
  if (e->router && (pg_all_reduce_buf(e->ctx, PG_MODE_PIPELINE, &aux, 1, PG_FLOAT64, PG_REDUCE_SUM) ||
                    pg_all_reduce_buf(e->ctx, pg_engine_dense_group(e), &aux, 1, PG_FLOAT64, PG_REDUCE_SUM)))
    return PG_ERR;
  if (e->router) {
    aux /= dense_size(e);
    /* after backward every stage holds the whole model's totals (the last stage's, sent back), summed over
     * the data group by the last MoE layer */
    int E = e->opts.router_experts;
    for (int k = 0; k < E; k++) e->expert_tokens[k] = 0;
    for (int i = 0; i < M; i++)
      for (int k = 0; k < E; k++) e->expert_tokens[k] += e->ios[i].router[k];
  }
  e->last_ce = *loss;
  e->last_aux = e->router ? aux : 0;
  *loss += e->last_aux;
  if (e->sharded ? finish_sharded(e) : sync && (e->overlap_now ? finish_buckets(e) : pg_engine_sync_grads(e)))
    return PG_ERR;
  if (release_units(e)) return PG_ERR;
  e->overlap_now = 0;
  e->stats.steps++;
  e->stats.step_seconds += pg_wtime() - t0;
  return PG_OK;
}

/* Evaluation's logits under context parallelism: every context rank's rows [B, T / C, vocab] gathered over the
 * context group and put at their positions in the full [B, T, vocab]. */
static int cp_gather_logits(pg_engine *e, const float *mine, float *logits, int B, int Tl) {
  int C = e->ctx->context, V = e->opts.vocab;
  int64_t L = Tl / 2, per = (int64_t)B * Tl * V;
  float *all = malloc((size_t)C * (size_t)per * sizeof(float));
  if (!all) return pg_fail("out of memory gathering the logits over the context group");
  memcpy(all + (size_t)e->ctx->cp_rank * per, mine, (size_t)per * sizeof(float));
  if (pg_all_gather_buf(e->ctx, PG_MODE_CONTEXT, all, per, PG_FLOAT32)) {
    free(all);
    return PG_ERR;
  }
  for (int r = 0; r < C; r++)
    for (int b = 0; b < B; b++)
      for (int64_t t = 0; t < Tl; t++)
        memcpy(logits + ((int64_t)b * C * Tl + pg_cp_position(C, r, L, t)) * V,
               all + (size_t)r * per + ((int64_t)b * Tl + t) * V, (size_t)V * sizeof(float));
  free(all);
  return PG_OK;
}

int pg_engine_evaluate(pg_engine *e, const int32_t *tokens, const int32_t *targets, int B, int T, double *loss,
                       float *logits) {
  if (check_batch(e, tokens, targets, B, T, 0) || cp_check(e, T, "evaluate") ||
      (cp_on(e) && cp_local_batch(e, &tokens, &targets, B, &T)))
    return PG_ERR;
  /* context parallelism: this rank's chunks' logits, gathered over the context group at the end */
  float *all_logits = logits, *cp_logits = NULL;
  if (cp_on(e) && logits && e->is_last) {
    if (!(cp_logits = malloc((size_t)B * T * e->opts.vocab * sizeof(float))))
      return pg_fail("out of memory for this context rank's logits");
    logits = cp_logits;
  }
  int rc = evaluate_rows(e, tokens, targets, B, T, loss, logits);
  if (!rc && cp_logits) rc = cp_gather_logits(e, cp_logits, all_logits, B, T);
  free(cp_logits);
  if (!rc && all_logits && cp_on(e) && pp_size(e) > 1)
    rc = pg_broadcast_buf(e->ctx, PG_MODE_PIPELINE, all_logits, (int64_t)B * T * e->ctx->context * e->opts.vocab,
                          PG_FLOAT32, pp_size(e) - 1);
  return rc;
}

/* Evaluation of [B, T] rows (with context parallelism this rank's chunks). */
static int evaluate_rows(pg_engine *e, const int32_t *tokens, const int32_t *targets, int B, int T, double *loss,
                         float *logits) {
  const int32_t *host_targets = targets;
  if (ids_on_backend(e, &tokens, &targets, (int64_t)B * T)) return PG_ERR;
  /* Micro-batches of at most a training micro-batch's rows go down the pipeline. */
  int rows_cap = e->capacity_rows;
  if (rows_cap < T) rows_cap = T * (B < 8 ? B : 8); /* nothing trained yet: chunks of up to 8 rows */
  if (ensure_capacity(e, rows_cap)) return PG_ERR;
  int Bc = rows_cap / T;
  if (Bc > B) Bc = B;
  int nmb = (B + Bc - 1) / Bc;
  if (nmb > e->eval_ios_cap) {
    pg_io *ios = realloc(e->eval_ios, (size_t)nmb * sizeof *ios);
    if (!ios) return pg_fail("out of memory for %d evaluation micro-batches", nmb);
    e->eval_ios = ios;
    e->eval_ios_cap = nmb;
  }
  for (int i = 0; i < nmb; i++) {
    int b0 = i * Bc, nb = B - b0 < Bc ? B - b0 : Bc;
    size_t off = (size_t)b0 * T;
    e->eval_ios[i] = (pg_io){.B = nb, .T = T, .tokens = tokens + off, .targets = targets ? targets + off : NULL,
                             .dloss = 0, .want_grad = 0, .loss_sum = 0,
                             .logits = logits && e->is_last ? logits + off * e->opts.vocab : NULL, .mb = i,
                             .row0 = (int64_t)off, .host_targets = host_targets ? host_targets + off : NULL,
                             .cp_chunk = cp_on(e) ? T / 2 : 0,
                             .forward_begin = e->params_sharded ? on_forward_begin : NULL,
                             .forward_done = e->params_sharded ? on_forward_done : NULL, .backward_ud = e};
    lend_bf16_scratch(e, &e->eval_ios[i]);
  }
  /* the same executor as training, on a forward-only list (pg_schedule.h) */
  pg_action *acts;
  int nacts;
  if (release_units(e) ||
      pg_schedule_build(PG_SCHEDULE_FORWARD, pp_size(e), e->nchunks, nmb, pp_rank(e), &acts, &nacts))
    return PG_ERR;
  for (int k = 0; k < nacts; k++)
    if (run_action(e, acts[k], e->eval_ios, nmb)) {
      free(acts);
      return PG_ERR;
    }
  free(acts);
  if (release_units(e)) return PG_ERR;
  double sum = 0;
  for (int i = 0; i < nmb; i++) sum += e->eval_ios[i].loss_sum;
  if (wait_all_sends(e)) return PG_ERR;
  if (loss) {
    *loss = e->is_last ? sum / ((double)B * T) : 0;
    if (share_loss(e, loss)) return PG_ERR;
  }
  if (logits && pp_size(e) > 1 && !cp_on(e) && /* context parallelism: broadcast once gathered */
      pg_broadcast_buf(e->ctx, PG_MODE_PIPELINE, logits, (int64_t)B * T * e->opts.vocab, PG_FLOAT32, pp_size(e) - 1))
    return PG_ERR;
  return PG_OK;
}

int pg_engine_check_decode(const pg_engine *e) {
  if (cp_on(e))
    return pg_fail("decode with context=%d: the key/value cache holds whole sequences; decode with a context of "
                   "context = 1 (a checkpoint loads at any context size)", e->ctx->context);
  for (int v = 0; v < e->nchunks; v++)
    if (pg_module_check_decode(e->chunks[v].stage)) return PG_ERR;
  return PG_OK;
}

int pg_engine_decode(pg_engine *e, const int32_t *tokens, int B, int T, int row0, const int32_t *pos, int cache_rows,
                     float *logits) {
  if (check_batch(e, tokens, NULL, B, T, 0)) return PG_ERR;
  if (cache_rows < 1 || row0 < 0 || row0 > cache_rows - B)
    return pg_fail("decode: sequences %d..%d of a cache of %d sequences", row0, row0 + B - 1, cache_rows);
  if (pg_engine_check_decode(e)) return PG_ERR;
  const int32_t *targets = NULL;
  if (ids_on_backend(e, &tokens, &targets, (int64_t)B * T)) return PG_ERR;
  /* one micro-batch of every row: a training engine's buffers grow if a training micro-batch is smaller (the
   * next forward_backward writes every buffer it reads, so training goes on as it would have) */
  if (ensure_capacity(e, B * T)) return PG_ERR;
  pg_decode d = {.row0 = row0, .rows = B, .pos = pos, .cache_rows = cache_rows};
  pg_io io = {.B = B, .T = T, .tokens = tokens, .logits = logits && e->is_last ? logits : NULL, .decode = &d,
              .forward_begin = e->params_sharded ? on_forward_begin : NULL,
              .forward_done = e->params_sharded ? on_forward_done : NULL, .backward_ud = e};
  lend_bf16_scratch(e, &io);
  pg_action *acts;
  int nacts;
  if (pg_schedule_build(PG_SCHEDULE_FORWARD, pp_size(e), e->nchunks, 1, pp_rank(e), &acts, &nacts)) return PG_ERR;
  for (int k = 0; k < nacts; k++)
    if (run_action(e, acts[k], &io, 1)) {
      free(acts);
      return PG_ERR;
    }
  free(acts);
  if (wait_all_sends(e) || release_units(e)) return PG_ERR;
  if (logits && pp_size(e) > 1 &&
      pg_broadcast_buf(e->ctx, PG_MODE_PIPELINE, logits, (int64_t)B * T * e->opts.vocab, PG_FLOAT32, pp_size(e) - 1))
    return PG_ERR;
  return PG_OK;
}

void pg_engine_release_cache(pg_engine *e) {
  for (int v = 0; v < e->nchunks; v++) pg_module_release_cache(e->chunks[v].stage);
}

int pg_engine_shares_buffers(const pg_engine *e) { return e->param_shm.size > 0 && e->grad_shm.size > 0; }

int pg_engine_zero_grad(pg_engine *e) {
  e->grads_pending = 0;
  if (!e->sharded) return e->be->ops->zero(e->be, e->grad_store->data, (size_t)e->flat_padded * sizeof(float));
  for (int k = 0; k < e->nbuckets; k++) /* staging holds nothing between calls; a failed call's is dropped here */
    if (e->buckets[k].stage &&
        e->be->ops->zero(e->be, e->buckets[k].stage, (size_t)(e->buckets[k].hi - e->buckets[k].lo) * sizeof(float)))
      return PG_ERR;
  return e->be->ops->zero(e->be, e->grad_store->data, e->grad_store->bytes);
}

float *pg_engine_grad_at(const pg_engine *e, int64_t off) {
  return (float *)e->grad_store->data + (e->sharded ? shard_index(e, off) : off);
}

size_t pg_engine_grad_bytes(const pg_engine *e) {
  if (!e->sharded) return (size_t)e->flat_padded * sizeof(float);
  return e->grad_store->bytes + ((size_t)e->npool * (size_t)e->pool_elems + (size_t)e->resident_elems) * sizeof(float);
}

/* The bucket list with ZeRO-2's staging: the pool's slots hold the largest
 * bucket that is not resident; resident ones get their own, kept. The pool
 * starts with the two slots of the steady state (one bucket being written,
 * the one before it reducing), so that memory() says before the first step
 * what training holds; it grows only when a module's parameters span more
 * buckets than the slots free. */
static int make_staging(pg_engine *e) {
  e->pool_elems = e->resident_elems = 0;
  int pooled = 0;
  for (int k = 0; k < e->nbuckets; k++) pooled += !e->buckets[k].resident;
  for (int k = 0; k < e->nbuckets; k++) {
    pg_bucket *b = &e->buckets[k];
    b->seq = -1;
    b->slot = -1;
    aim_grads(e, b); /* nowhere until staged */
    int64_t n = b->hi - b->lo;
    if (!b->resident) {
      if (n > e->pool_elems) e->pool_elems = n;
      continue;
    }
    if (!(b->stage = pg_be_floats(e->be, (size_t)n)))
      return pg_fail("zero = 2: out of memory for the staging of %lld gradients", (long long)n);
    e->resident_elems += n;
    aim_grads(e, b);
  }
  pooled = pooled < 2 ? pooled : 2;
  if (pooled && (!(e->pool = calloc((size_t)pooled, sizeof *e->pool)) ||
                 !(e->pool_owner = malloc((size_t)pooled * sizeof *e->pool_owner))))
    return pg_fail("zero = 2: out of memory");
  for (int i = 0; i < pooled; i++) {
    if (!(e->pool[i] = pg_be_floats(e->be, (size_t)e->pool_elems)))
      return pg_fail("zero = 2: out of memory for a gradient staging buffer of %lld floats", (long long)e->pool_elems);
    e->pool_owner[i] = -1;
    e->npool++;
  }
  return PG_OK;
}

static void free_staging(pg_engine *e) {
  for (int k = 0; k < e->nbuckets; k++)
    if (e->buckets[k].resident) pg_be_release(e->be, e->buckets[k].stage);
  for (int i = 0; i < e->npool; i++) pg_be_release(e->be, e->pool[i]);
  free(e->pool);
  free(e->pool_owner);
  e->pool = NULL;
  e->pool_owner = NULL;
  e->npool = 0;
}

/* What ZeRO-2 and 3 cannot serve, refused by name (e->zero names the stage). */
static int check_shardable(const pg_engine *e) {
  /* the device's buckets and gathers are NCCL collectives on the data group's own stream (comm_requests.c) */
  if (e->be->device != PG_CPU && !pg_comm_device_overlap(e->ctx, pg_engine_dense_group(e)))
    return pg_fail("zero = %d on the %s backend reduces and gathers over the data group's NCCL stream, which this "
                   "context lacks (ranks outnumber a node's GPUs, or context parallelism's data x context group): "
                   "use zero = 1", e->zero, e->be->name);
  /* the experts' region divides its reduced terms by E on the host (complete_bucket) */
  if (e->be->device != PG_CPU && e->flat_padded > e->dense_padded)
    return pg_fail("zero = %d with expert parallelism on the %s backend is not supported yet (the experts' region is "
                   "sharded in host memory only): use zero = 1", e->zero, e->be->name);
  for (int v = 0; v < e->nchunks; v++) {
    const pg_module *m = pg_module_find_foreign_writer(e->chunks[v].stage);
    if (m)
      return pg_fail("zero = %d keeps only a shard of the gradients, but module '%s' (written in Lua) writes its "
                     "parameters' gradients into the whole buffer: use zero = 1", e->zero, m->name);
  }
  return PG_OK;
}

int pg_engine_shard_grads(pg_engine *e) {
  if (e->sharded || dense_size(e) == 1) return PG_OK; /* one replica: the shard is the whole buffer */
  if (check_shardable(e)) return PG_ERR;
  if (e->grads_pending)
    return pg_fail("zero = %d: gradients of an earlier forward_backward wait for their reduction; make the optimizer "
                   "before training, or call engine:sync_grads() first", e->zero);
  int64_t per = shard_elems(e);
  pg_storage *shard = pg_backend_storage(e->be, (size_t)per * sizeof(float));
  if (!shard) return pg_fail("zero = 2: the gradient shard (%lld floats): %s", (long long)per, pg_error());
  /* what the buffer holds for the shard (reduced gradients, or zeros) stays */
  if (copy_shards(e, shard->data, e->grad_store->data)) {
    pg_storage_release(shard);
    return PG_ERR;
  }
  for (int k = 0; k < e->nbuckets; k++)
    if (pg_wait(&e->buckets[k].req)) {
      pg_storage_release(shard);
      return PG_ERR;
    }
  free(e->buckets);
  free(e->param_bucket);
  free(e->last_backward);
  e->buckets = NULL;
  e->param_bucket = e->last_backward = NULL;
  e->nbuckets = 0;
  /* the reductions go through MPI: the members' shared gradient buffers go */
  pg_shm_close(&e->grad_shm);
  pg_storage_release(e->grad_store);
  e->grad_store = shard;
  e->sharded = 1;
  return build_buckets(e) || make_staging(e);
}

void pg_engine_shard(const pg_engine *e, int64_t *lo, int64_t *hi) { own_shard(e, 0, lo, hi); }

void pg_engine_expert_shard(const pg_engine *e, int64_t *lo, int64_t *hi) { own_shard(e, 1, lo, hi); }

/* 1. tied embedding: the first stage's weight and the last stage's copy. */
static int tied_reduce(pg_engine *e) {
  if (!e->opts.tied_name || pp_size(e) == 1 || !(e->is_first || e->is_last)) return PG_OK;
  pg_param *p = NULL;
  for (int i = 0; i < e->nparams && !p; i++)
    if (!strcmp(e->params[i]->name, e->opts.tied_name)) p = e->params[i];
  if (!p) return pg_fail("stage %d holds no parameter '%s' to tie", pp_rank(e), e->opts.tied_name);
  return pg_all_reduce_buf(e->ctx, PG_MODE_EMBEDDING, p->grad, p->numel, PG_FLOAT32, PG_REDUCE_SUM);
}

/* Averages (zero = 0) or reduce-scatters (zero = 1) the n floats at g over
 * group m: shared memory when the group's buffers are mapped (sh), else the
 * ring's reduce-scatter and all-gather at any size, so that zero = 0 and
 * zero = 1 reduce in the same order. The one "reduce this region over that
 * group" step: the dense region goes over the data group, the experts' over
 * expert_data. */
static int reduce_region(pg_engine *e, pg_mode m, const pg_shm *sh, float *g, int64_t n) {
  if (e->ctx->group[m].size == 1 || n == 0) return PG_OK;
  if (!e->zero)
    return sh ? pg_shm_all_reduce(e->ctx, sh, n, PG_REDUCE_AVG)
              : pg_reduce_scatter_inplace(e->ctx, m, g, n, PG_REDUCE_AVG) || pg_all_gather_inplace(e->ctx, m, g, n);
  return sh ? pg_shm_reduce_scatter(e->ctx, sh, n, PG_REDUCE_AVG)
            : pg_reduce_scatter_inplace(e->ctx, m, g, n, PG_REDUCE_AVG);
}

int pg_engine_gather_params(pg_engine *e) {
  if (!e->zero || e->params_sharded) return PG_OK; /* ZeRO-3 gathers a module's parameters when it runs */
  float *w = e->param_store->data;
  if (dense_size(e) > 1 &&
      (e->param_shm.size ? pg_shm_all_gather(e->ctx, &e->param_shm, e->dense_padded)
                         : pg_all_gather_inplace(e->ctx, pg_engine_dense_group(e), w, e->dense_padded)))
    return PG_ERR;
  int64_t n = e->flat_padded - e->dense_padded;
  if (n && e->ctx->group[PG_MODE_EXPERT_DATA].size > 1 &&
      pg_all_gather_inplace(e->ctx, PG_MODE_EXPERT_DATA, w + e->dense_padded, n))
    return PG_ERR;
  return PG_OK;
}

/* Step 0 of the reductions: the gradients of parameters that saw only this
 * tensor rank's rows (sequence parallelism) summed over the tensor group, in
 * one collective over a packed copy. */
static int sync_sequence_parallel(pg_engine *e) {
  if (!sp_on(e)) return PG_OK;
  int64_t n = 0;
  for (int i = 0; i < e->nparams; i++)
    if (e->params[i]->sequence_parallel) n += e->params[i]->numel;
  if (n == 0) return PG_OK;
  if (n > e->sp_grads_n) {
    pg_be_release(e->be, e->sp_grads);
    e->sp_grads_n = 0;
    if (!(e->sp_grads = pg_be_floats(e->be, (size_t)n))) return pg_fail("sequence-parallel gradients: %s", pg_error());
    e->sp_grads_n = n;
  }
  const pg_backend *be = e->be;
  for (int pass = 0; pass < 2; pass++) { /* pack, reduce, unpack */
    int64_t off = 0;
    for (int i = 0; i < e->nparams; i++) {
      pg_param *p = e->params[i];
      if (!p->sequence_parallel) continue;
      size_t bytes = (size_t)p->numel * sizeof(float);
      if (pass == 0 ? be->ops->copy(be, e->sp_grads + off, p->grad, bytes, PG_COPY_DEVICE_TO_DEVICE)
                    : be->ops->copy(be, p->grad, e->sp_grads + off, bytes, PG_COPY_DEVICE_TO_DEVICE))
        return PG_ERR;
      off += p->numel;
    }
    if (pass == 0 && pg_all_reduce_buf(e->ctx, PG_MODE_TENSOR, e->sp_grads, n, PG_FLOAT32, PG_REDUCE_SUM))
      return PG_ERR;
  }
  return PG_OK;
}

int pg_engine_sync_grads(pg_engine *e) {
  if (!e->grads_pending) return PG_OK; /* never with ZeRO-2: every call reduces */
  double t0 = pg_wtime();
  float *g = e->grad_store->data;
  /* 0. sequence parallelism: the norms' gradients over the tensor group. */
  if (sync_sequence_parallel(e) || tied_reduce(e)) return PG_ERR;
  /* 2. data parallel: the average over the replicas; the experts' region
   * over the ranks holding the same experts (the shared buffers span the data
   * group, whose members hold different experts: that region goes by MPI).
   * Each region's length is a multiple of its group's size, so the
   * collectives' blocks are the ZeRO shards: with zero = 1 or 2 ours is
   * reduced in place. */
  const pg_shm *sh = e->grad_shm.size ? &e->grad_shm : NULL;
  if (reduce_region(e, pg_engine_dense_group(e), sh, g, e->dense_padded) ||
      reduce_region(e, PG_MODE_EXPERT_DATA, NULL, g + e->dense_padded, e->flat_padded - e->dense_padded))
    return PG_ERR;
  /* an expert's gradient on a rank holds the tokens of all E members of its
   * expert group, each at its own rank's scale: the average over the D data
   * ranks is the average over expert_data divided by E (exact for E a power
   * of 2). Experts run on the cpu backend only: host memory. */
  if (e->flat_padded > e->dense_padded) {
    int64_t lo, hi;
    pg_engine_expert_shard(e, &lo, &hi);
    float inv = 1.0f / (float)e->ctx->expert;
    for (int64_t i = lo; i < hi; i++) g[i] *= inv;
  }
  e->grads_pending = 0;
  double dt = pg_wtime() - t0;
  e->stats.grad_sync_seconds += dt;
  e->stats.exposed_comm_seconds += dt; /* all of it after backward */
  return PG_OK;
}

/* Every rank builds its engine, so the sum is collective here and nowhere else. */
static int count_parameters(pg_engine *e, int64_t *n) {
  int64_t local[2] = {0, 0}; /* dense, experts (each member of an expert group holds its own) */
  for (int i = 0; i < e->nparams; i++) {
    pg_param *p = e->params[i];
    if (p->tied_copy || (p->replicated && e->ctx->tp_rank != 0)) continue;
    if (p->valid_rows < 0) {
      local[p->expert] += p->numel;
      continue;
    }
    int64_t row = p->numel / p->shape[0];
    for (int64_t r = 0; r < p->shape[0]; r++)
      if (pg_param_full_index(p, r * row) / row < p->valid_rows) local[p->expert] += row;
  }
  if (pg_all_reduce_buf(e->ctx, PG_MODE_EXPERT, &local[1], 1, PG_INT64, PG_REDUCE_SUM)) return PG_ERR;
  local[0] += local[1];
  if (pg_all_reduce_buf(e->ctx, PG_MODE_TENSOR, &local[0], 1, PG_INT64, PG_REDUCE_SUM) ||
      pg_all_reduce_buf(e->ctx, PG_MODE_PIPELINE, &local[0], 1, PG_INT64, PG_REDUCE_SUM))
    return PG_ERR;
  *n = local[0];
  return PG_OK;
}

int64_t pg_engine_num_parameters(const pg_engine *e) { return e->num_parameters; }

pg_param *pg_engine_find_param(const pg_engine *e, const char *name) {
  for (int i = 0; i < e->nparams; i++)
    if (!strcmp(e->params[i]->name, name)) return e->params[i];
  return NULL;
}

/* ZeRO-3: this rank's shard of p's tensor-parallel piece cut on the host, its part in the data shard kept. */
static int zero3_load_param(pg_engine *e, pg_param *p, const float *full, int64_t full_rows) {
  pg_param host = *p;
  if (!(host.data = malloc((size_t)p->numel * sizeof(float)))) return pg_fail("out of memory loading %s", p->name);
  pg_param_load_full(&host, full, full_rows);
  int rc = pg_engine_write_param(e, p, host.data);
  free(host.data);
  return rc;
}

/* ZeRO-3 outside a call: p's unit gathered over the data group (collective there), read, released. */
static int zero3_gather_param(pg_engine *e, pg_param *p, float *full) {
  pg_param *own = pg_engine_find_param(e, p->name); /* p may be a view of it (the Lua binding's) */
  int k = own ? param_index(e, own) : -1;
  if (k < 0) return pg_fail("parameter %s is not this engine's", p->name);
  pg_gather_unit *u = &e->units[e->param_unit[k]];
  if (finish_gather(e, u, 0)) return PG_ERR;
  pg_param view = *p;
  view.data = own->data;
  int rc = pg_engine_gather_param(e, &view, full);
  if (release_units(e)) rc = PG_ERR;
  return rc;
}

int pg_engine_read_param(pg_engine *e, pg_param *p, float *piece) {
  size_t bytes = (size_t)p->numel * sizeof(float);
  if (!e->params_sharded) return e->be->ops->copy(e->be, piece, p->data, bytes, PG_COPY_DEVICE_TO_HOST);
  int k = param_index(e, p);
  if (k < 0) return pg_fail("parameter %s is not this engine's", p->name);
  int rc = finish_gather(e, &e->units[e->param_unit[k]], 0);
  if (!rc) rc = e->be->ops->copy(e->be, piece, p->data, bytes, PG_COPY_DEVICE_TO_HOST);
  if (release_units(e)) rc = PG_ERR;
  return rc;
}

int pg_engine_write_param(pg_engine *e, pg_param *p, const float *piece) {
  if (!e->params_sharded)
    return e->be->ops->copy(e->be, p->data, piece, (size_t)p->numel * sizeof(float), PG_COPY_HOST_TO_DEVICE);
  int64_t a, z;
  own_shard(e, p->expert, &a, &z);
  if (p->offset > a) a = p->offset;
  if (p->offset + p->numel < z) z = p->offset + p->numel;
  if (z <= a) return PG_OK;
  return e->be->ops->copy(e->be, pg_engine_param_at(e, a), piece + (a - p->offset), (size_t)(z - a) * sizeof(float),
                          PG_COPY_HOST_TO_DEVICE);
}

int pg_engine_load_param(pg_engine *e, pg_param *p, const float *full, int64_t full_rows) {
  if (e->params_sharded) return zero3_load_param(e, p, full, full_rows);
  if (e->be->device == PG_CPU) {
    pg_param_load_full(p, full, full_rows);
    return PG_OK;
  }
  /* a device engine: cut the shard on the host, then copy it over */
  size_t bytes = (size_t)p->numel * sizeof(float);
  pg_param host = *p;
  if (!(host.data = malloc(bytes))) return pg_fail("out of memory loading %s", p->name);
  pg_param_load_full(&host, full, full_rows);
  int rc = e->be->ops->copy(e->be, p->data, host.data, bytes, PG_COPY_HOST_TO_DEVICE);
  free(host.data);
  return rc;
}

int pg_engine_gather_param(pg_engine *e, pg_param *p, float *full) {
  if (e->params_sharded && !p->data) return zero3_gather_param(e, p, full);
  size_t bytes = (size_t)p->numel * sizeof(float);
  if (p->split_parts == 1) return e->be->ops->copy(e->be, full, p->data, bytes, PG_COPY_DEVICE_TO_HOST);
  int T = p->split_parts;
  float *all = malloc((size_t)T * bytes); /* host: the gathered shards */
  if (!all) return pg_fail("out of memory gathering %s", p->name);
  if (e->be->ops->copy(e->be, all + (size_t)e->ctx->tp_rank * p->numel, p->data, bytes, PG_COPY_DEVICE_TO_HOST)) {
    free(all);
    return PG_ERR;
  }
  if (pg_all_gather_buf(e->ctx, PG_MODE_TENSOR, all, p->numel, PG_FLOAT32)) {
    free(all);
    return PG_ERR;
  }
  for (int r = 0; r < T; r++)
    for (int64_t i = 0; i < p->numel; i++) full[pg_param_full_index_of(p, i, r)] = all[(size_t)r * p->numel + i];
  free(all);
  return PG_OK;
}
