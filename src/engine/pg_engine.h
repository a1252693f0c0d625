/* pg_engine: one rank's share of a model and the training step.
 *
 * The engine owns this rank's pipeline stage (a module tree; with the
 * interleaved schedule, V of them: the rank's chunks, pg_schedule.h), places
 * every parameter of the stage in one flat parameter buffer and one flat
 * gradient buffer, initialises them, and runs a step: the micro-batches of a
 * batch through the pipeline schedule, then the gradient reductions that make
 * the result equal the serial model's:
 *   0. sequence parallelism: parameters that saw only this tensor rank's rows
 *      (pg_param.sequence_parallel: norms) get the sum of their gradients
 *      over the tensor group;
 *   1. the two copies of a tied embedding (first and last stage) get the sum
 *      of their gradients (embedding group);
 *   2. data parallel: gradients are averaged over the data group (zero = 0:
 *      all-reduce; zero = 1 or 2: reduce-scatter, each rank keeps the average
 *      for its contiguous shard of the flat buffer). When the data group runs
 *      on one node the flat buffers live in shared memory and these are
 *      single passes over the members' buffers; otherwise chunked ring
 *      collectives (pg_comm.h). Under expert parallelism (the context's
 *      expert > 1) the flat buffers have two regions: the dense parameters,
 *      reduced (and ZeRO-sharded) over the data group as above, then the
 *      experts this rank holds, reduced and sharded over the expert_data group
 *      (the ranks holding the same experts, by MPI: the shared buffers span
 *      members that hold different experts) and divided by E, since an
 *      expert's gradient holds the tokens of E data ranks.
 * Overlap (opts.overlap_grad_reduce, host memory over MPI only, no experts'
 * region): the flat gradient buffer is cut into buckets of about
 * bucket_elems, in the order their gradients become final in backward (the
 * reverse of the parameters' order, chunk by chunk). On the step that syncs,
 * a bucket's nonblocking reduction (all-reduce, or with ZeRO the
 * reduce-scatter of its part of every member's shard) starts as soon as the
 * last module owning one of its parameters has finished the backward of the
 * chunk's last micro-batch (pg_io.backward_done), and runs while the rest of
 * backward does; the step waits for them at its end. A bucket holding a tied
 * embedding's copy starts at the end, after step 1. The shared-memory passes
 * and the device with ZeRO keep the one reduction at the end (pg_engine.c
 * says why); on the device with zero = 0 the data group's NCCL all-reduce
 * runs on its own stream.
 * ZeRO-2 (pg_engine_shard_grads): see pg_engine.sharded below.
 * The loss is computed on the last stage, broadcast to the pipeline group and
 * averaged over the data group, so every rank returns the same number.
 * Evaluation runs a forward-only action list (PG_SCHEDULE_FORWARD) through
 * the same executor as the step.
 *
 * Every call below is collective over the whole context (all ranks call it
 * with the same shapes) unless it says otherwise. */
#ifndef PG_ENGINE_H
#define PG_ENGINE_H

#include "pg_comm.h"
#include "pg_context.h"
#include "pg_module.h"
#include "pg_schedule.h"
#include "pg_shm.h"
#include "pg_tensor.h"

#define PG_MAX_MICRO_BATCHES (1 << 20) /* each needs a row of the batch; the schedule is made at construction */

typedef struct pg_engine_opts {
  int micro_batches;
  pg_schedule_kind schedule;
  int vocab;            /* token ids must be < vocab */
  int width;            /* hidden width at stage boundaries */
  int64_t bucket_elems; /* data-parallel bucket size (floats) of the overlapped reduction; <= 0: 25 MiB */
  int overlap_grad_reduce; /* 1: reduce buckets during the last micro-batch's backward, where it applies */
  const char *tied_name; /* name of a weight whose copies live on the first and last stage, or NULL */
  int private_buffers;   /* 1: never share the flat buffers with the data group (collectives through MPI) */
  const pg_backend *backend; /* where the engine runs (pg_backend.h); NULL: the cpu backend */
  int objective;         /* the last stage ends in an objective (pg_objective_new): targets are its to read */
  int router_experts;    /* > 0: the model has mixture-of-experts layers of this many experts (pg_io.router) */
  pg_precision precision; /* of the stages' products (pg_module_set_precision); masters, gradients and optimizer
                             state stay float32 in the flat buffers whatever it is */
  int zero;              /* 3: ZeRO-3 from construction (the optimizer is made with zero = 3): with data > 1 only
                            this rank's shards of the parameters and gradients are ever allocated, and each
                            parameter's shard initialised alone; 0: the optimizer decides (pg_engine_shard_*) */
  int sequence_parallel; /* the stages hand over this tensor rank's rows of each micro-batch (pg_sp_rows;
                            the modules were built for it: pg_module_sequence_parallel) */
} pg_engine_opts;

typedef struct pg_engine_stats {
  long steps;
  double step_seconds;      /* wall time inside forward_backward */
  double recv_wait_seconds; /* blocked in pipeline receives (bubble + transfer) */
  double send_wait_seconds; /* waiting for pipeline sends to complete */
  double grad_sync_seconds; /* tied-embedding and data-parallel gradient reductions: without overlap the time
                               in them, with overlap from the first bucket's start to the last's end */
  double exposed_comm_seconds; /* the part of the reductions the step waited for after its backward ended (without
                                  overlap: all of grad_sync_seconds) */
  double compute_seconds;   /* forward and backward of the stage's modules */
} pg_engine_stats;

/* One of the rank's model chunks (pg_schedule.h: with V = 1, the rank's
 * stage): its modules and the buffers of its micro-batches in flight. */
typedef struct pg_chunk {
  pg_module *stage;
  int is_first, is_last; /* the model's first piece (reads token ids) / last piece (ends in the loss) */
  int nslots;            /* most micro-batches the schedule keeps in flight on this chunk */
  int peak_in_flight;    /* as measured by a step */
  float *stage_in;       /* [nslots][rows * width] received activations */
  float *grad_send;      /* [nslots][rows * width] */
  pg_request **act_req, **grad_req; /* per slot: the send in flight, or NULL */
  const float **stage_out; /* per slot: forward outputs to send */
  pg_request **router_req; /* with MoE layers, per slot: the routing totals' send in flight, or NULL */
} pg_chunk;

/* A piece [lo, hi) of the flat gradient buffer reduced as one collective
 * over `mode`'s group (today the data group; a bucket of parameters reduced
 * over another group, expert parallelism's, would name that group). */
typedef struct pg_bucket {
  int64_t lo, hi;
  pg_mode mode;
  int nparams;       /* parameters whose gradients it holds */
  int pending;       /* of those, not final yet in this step's last backward */
  int deferred;      /* holds a tied embedding's copy: starts after the embedding group's sum */
  pg_request *req;   /* in flight, or NULL */
  /* ZeRO-2 (pg_engine.sharded): where its gradients are written while they
   * are made, until its reduce-scatter is added into the shard */
  int p0, p1;        /* its parameters are params[p0 .. p1] */
  int resident;      /* keeps its own staging for the whole call (a tied copy, a weight a tied head borrows) */
  float *stage;      /* [hi - lo]: a pool slot or its own; NULL when not staged */
  int slot;          /* the pool slot it holds, or -1 */
  long seq;          /* start order, to complete the oldest first */
  int started_in_backward; /* this call */
} pg_bucket;

/* ZeRO-3 (pg_engine_shard_params): the parameters of one top-level module of
 * a chunk (a transformer block, the embedding, the final norm), gathered as
 * one all-gather per region of the flat range [lo[r], hi[r]) they lie in
 * there (each member's piece: the range's intersection with its shard): the
 * dense parameters over the dense group, an MoE's experts (expert
 * parallelism) over expert_data. */
typedef struct pg_gather_unit {
  pg_module *m;      /* its module (pg_module.gather_unit) */
  pg_param **params; /* every parameter of m's tree */
  int nparams;
  int chunk;         /* whose tree it is in */
  int64_t lo[2], hi[2]; /* per region (dense, experts); an empty one lo = hi. buf holds region 0's range, then 1's */
  int resident;      /* owns a weight another module reads (a tied head): gathered once a call, kept to its end */
  float *buf;        /* both ranges: a resident unit's own, or the pool slot it holds; NULL when not held */
  int slot;          /* the pool slot it holds, or -1 */
  int gathered;      /* the parameters point into buf (the gather completed) */
  /* bf16 gathers (pg_engine.gather16): the gather_bf16 weights' n16 elements are gathered as bf16 into the
   * start of buf and the other parameters' n32 as float32 after them (from float (n16 + 1) / 2), each set packed
   * in flat order without the gaps between parameters (the dense region's elements first, then the experts'), so
   * a member's piece of its contiguous shard of a region stays contiguous in both; at[i]: parameter i's first
   * element's place in its set */
  int64_t n16, n32, *at;
  int packed;        /* the gather held or in flight is the packed one (a call's; outside one: float32) */
  int own_buf;       /* buf is this gather's own (a float32 gather of a pooled unit outside a call) */
  pg_request *reqs[2]; /* per region: the float32 part's gather in flight, or NULL */
  pg_request *req16[2]; /* per region: the bf16 part's gather in flight, or NULL */
} pg_gather_unit;

typedef struct pg_engine {
  pg_context *ctx;
  pg_chunk *chunks;     /* V of them: piece v*P + pp_rank of the model is chunks[v] */
  int nchunks;
  const pg_backend *be; /* where the stage's buffers, the flat buffers and the optimizer state live */
  int is_first, is_last; /* this rank holds the model's first / last piece */
  pg_param **params;    /* every chunk's, chunk by chunk */
  int *by_offset;       /* [nparams]: params' indices in flat offset order (the regions interleave the chunks') */
  int nparams;
  pg_storage *param_store, *grad_store;
  pg_recompute_arena *recompute_arena; /* the recomputed blocks' shared buffers, all chunks' (pg_module.h) */
  pg_shm param_shm, grad_shm; /* the data group's copies of both, when shared (pg_shm.h) */
  int64_t flat_numel;  /* used elements */
  int64_t flat_padded; /* buffer length: the dense region, then the experts' (expert parallelism) */
  int64_t dense_numel, dense_padded; /* the dense region [0, dense_padded): a multiple of the data size (ZeRO
                                        shards); the experts' [dense_padded, flat_padded), a multiple of the
                                        expert_data size, empty without expert parallelism */
  pg_engine_opts opts;
  pg_action *actions;
  int nactions;
  int capacity_rows;   /* rows per micro-batch the buffers hold */
  uint16_t *bf16_scratch[2]; /* precision bf16: the GEMM operands' scratch every module shares (pg_io) */
  int64_t bf16_scratch_n[2];
  float *wide_scratch[PG_WIDE_SCRATCH]; /* precision bf16: float32 room for bf16 activations (pg_io) */
  int64_t wide_scratch_n[PG_WIDE_SCRATCH];
  float *grad_recv;    /* [rows * width]: every receive of a gradient is followed by its backward */
  int32_t *device_ids; /* device backends: [2][rows * micro-batches] the batch's token ids and targets */
  int64_t device_ids_cap;
  int32_t *cp_ids;     /* context parallelism: [2][B * T / C] this rank's chunks of the batch's ids and targets */
  int64_t cp_ids_cap;
  pg_io *ios;          /* per micro-batch */
  double *router;      /* with router_experts: [micro-batches][2 * experts] routing totals (pg_io.router) */
  double last_ce, last_aux; /* the last forward_backward's token loss and auxiliary losses (every rank) */
  double *expert_tokens; /* with router_experts: [experts] the last forward_backward's choices of each
                            expert, over all MoE layers, micro-batches and data ranks */
  pg_io *eval_ios;     /* per evaluation micro-batch, eval_ios_cap of them */
  int eval_ios_cap;
  int zero;            /* 0: replicated optimizer; 1: ZeRO-1 (gradient shards); 2: ZeRO-2; 3: ZeRO-3 (pg_optim.h) */
  pg_bucket *buckets;  /* in the order they start; NULL when the reduction is not overlapped */
  int nbuckets;
  int *param_bucket;   /* [nparams]: the bucket of params[i] */
  int *last_backward;  /* [nchunks]: index in actions of the chunk's last backward */
  int overlap_now;     /* this call's last backward starts buckets */
  int final_pass;      /* the action running is a chunk's last backward of a call that syncs */
  int buckets_started; /* of this step */
  double first_start;  /* when the step's first bucket started */
  int started_in_backward; /* buckets of the last step that synced which started before its backward ended */
  float *sp_grads;     /* sequence parallelism: the gradients of the sequence_parallel parameters, packed */
  int64_t sp_grads_n;
  int grads_pending;   /* gradients added since the last reduction */
  /* ZeRO-2 with data > 1 (pg_engine_shard_grads): grad_store holds only this
   * rank's shards, ZeRO-1's ranges (pg_engine_shard: the dense region's over
   * the dense group, then the experts' over expert_data) one after the other
   * (pg_engine_grad_at); gradients are written into staging buffers, a bucket
   * at a time, reduce-scattered over their region's group after every
   * micro-batch's backward and added into the shard. */
  int sharded;
  float **pool;        /* [npool] staging slots of pool_elems floats */
  int *pool_owner;     /* [npool] the bucket holding each, or -1 */
  int npool;
  int64_t pool_elems;
  int64_t resident_elems; /* staging kept by resident buckets */
  long bucket_seq;
  /* ZeRO-3 with data > 1 (pg_engine_shard_params): param_store holds only
   * this rank's shards of the parameters, laid out as grad_store's (ZeRO-2:
   * pg_engine_param_at); between a unit's gather and its release its
   * parameters' data point into its buffer, else they are NULL. */
  int params_sharded;
  int reshard_after_forward; /* 1 (default): release a unit after its forward, gather it again for backward */
  int prefetch;              /* 1 (default): start the next unit's gather before this one computes */
  pg_gather_unit *units;     /* in forward order (the chunks' trees) */
  int nunits;
  int *param_unit;           /* [nparams]: the unit owning params[i] */
  float **gpool;             /* [ngpool] gather slots of gpool_elems floats */
  int *gpool_owner;          /* [ngpool] the unit holding each, or -1 */
  int ngpool;
  int64_t gpool_elems, gresident_elems;
  int gathers_started;       /* this call: the first agrees on the set (pg_agree_batch) */
  int gather16;              /* precision bf16: the units' gather_bf16 weights gathered in bf16 */
  long unit_gathers;         /* gathers started since the engine was made */
  int64_t num_parameters; /* of the full model, counted at construction */
  pg_engine_stats stats;
} pg_engine;

/* Bytes of precision bf16's working weights, operand scratch and the bf16 activations' float32 scratch on this
 * rank (0 in fp32). */
size_t pg_engine_bf16_bytes(const pg_engine *e);

/* Takes ownership of the nchunks stage modules (freed by pg_engine_free, also
 * on failure): chunk v is piece v*P + pp_rank of the model (pg_schedule.h),
 * so whether a chunk reads token ids or ends in the loss follows from the
 * context. More than one chunk needs opts->schedule = PG_SCHEDULE_INTERLEAVED. */
pg_engine *pg_engine_new(pg_context *ctx, pg_module *const *stages, int nchunks, uint64_t seed,
                         const pg_engine_opts *opts);
void pg_engine_free(pg_engine *e);

/* Adds the gradients of grad_scale * (mean token loss over the global batch
 * + the auxiliary losses of mixture-of-experts layers); tokens/targets [B*T]
 * are this data rank's share. sync: run the gradient reductions at the end
 * (0 while accumulating; reductions then run when the optimizer needs the
 * gradients). *loss: that objective for the batch (last_ce + last_aux).
 * Auxiliary losses are taken per micro-batch, the load balance over the
 * routing totals of that micro-batch on every data rank together
 * (transformers' over the whole batch when there is one micro-batch), and
 * averaged weighted by rows, as the token loss is. */
int pg_engine_forward_backward(pg_engine *e, const int32_t *tokens, const int32_t *targets, int B, int T,
                               float grad_scale, int sync, double *loss);
/* Evaluation: mean loss (if targets) and/or logits [B*T, vocab] (if logits) on every rank. */
int pg_engine_evaluate(pg_engine *e, const int32_t *tokens, const int32_t *targets, int B, int T, double *loss,
                       float *logits);
/* Decoding with the key/value cache (pg_module.h's pg_decode), forward only: row b of tokens [B*T] is
 * sequence row0 + b of a cache of cache_rows sequences, its T tokens at positions pos[b] .. pos[b] + T - 1
 * (host; pos[b] at most the positions that sequence holds: a prompt goes in whole or in pieces, then one
 * token a step). logits (NULL: not wanted): [B*T, vocab] on every rank. Collective like evaluate. Touches
 * neither parameters, gradients nor the optimizer; a training engine's next forward_backward is what it
 * would have been. Modules written in Lua and sequence parallelism are refused (no cache path). */
int pg_engine_decode(pg_engine *e, const int32_t *tokens, int B, int T, int row0, const int32_t *pos, int cache_rows,
                     float *logits);
/* PG_OK when pg_engine_decode can run (every module has a cache path), else PG_ERR saying which has not. */
int pg_engine_check_decode(const pg_engine *e);
/* Frees the key/value caches (the next decode starts with empty ones). */
void pg_engine_release_cache(pg_engine *e);
/* 1 when the data-parallel replicas share their flat buffers (pg_shm.h): the
 * reductions are single passes over shared memory; 0: the MPI ring. */
int pg_engine_shares_buffers(const pg_engine *e);

/* The group over which the dense region's gradients are averaged and ZeRO-sharded: PG_MODE_DATA, or with
 * context parallelism PG_MODE_DATA_CONTEXT (data x context). */
pg_mode pg_engine_dense_group(const pg_engine *e);
int pg_engine_zero_grad(pg_engine *e);
/* 1 when the engine overlaps its data-parallel reduction with backward:
 * overlap_grad_reduce set, data > 1, host memory, buffers not shared. */
int pg_engine_overlaps(const pg_engine *e);
/* Runs the pending gradient reductions (no-op when none are pending). */
int pg_engine_sync_grads(pg_engine *e);
/* ZeRO-2 (the optimizer calls it for zero = 2): keep only this rank's shard
 * of the gradients. With data = 1 nothing changes. The device backend and
 * modules written in Lua that own parameters (they write gradients through
 * views of the whole buffer) are refused with an error naming them. Not
 * collective; every member of the data group must call it. */
int pg_engine_shard_grads(pg_engine *e);
/* ZeRO-3 (the optimizer calls it for zero = 3, after pg_engine_shard_grads):
 * keep only this rank's shard of the parameters too. Every module that owns
 * parameters is a gather unit: before its forward and its backward its
 * parameters are all-gathered over the data group (an MoE's experts, under
 * expert parallelism, over expert_data) into a slot (the next unit's gather
 * started before, nonblocking: prefetch), and released after (after forward
 * only when reshard_after_forward, else at the end of the call). With data =
 * 1 nothing changes. The device backend and modules written in Lua that own
 * parameters are refused by name. Not collective. */
int pg_engine_shard_params(pg_engine *e);
/* ZeRO-3's reshard_after_forward (default 1: FSDP2's): 0 keeps a unit gathered from its first forward of a
 * call to the call's end (a pipeline step gathers each unit once instead of twice per micro-batch). */
int pg_engine_set_reshard_after_forward(pg_engine *e, int on);
/* ZeRO-3's prefetch (default 1): 0 starts a unit's gather only when the unit is about to run, so no
 * transfer overlaps compute (the bench's measure of what the prefetch buys). */
int pg_engine_set_prefetch(pg_engine *e, int on);
/* The parameter value of flat element off: anywhere without ZeRO-3, inside this rank's shard with it. */
float *pg_engine_param_at(const pg_engine *e, int64_t off);
/* Bytes of parameter memory on this rank: the flat buffer, or with ZeRO-3 the
 * shard plus the gather slots (pool slots made so far and resident units'). */
size_t pg_engine_param_bytes(const pg_engine *e);
/* The gradient of flat element off: anywhere without ZeRO-2, inside this
 * rank's shard with it. */
float *pg_engine_grad_at(const pg_engine *e, int64_t off);
/* Bytes of gradient memory on this rank: the flat buffer, or with ZeRO-2 the
 * shard plus the staging buffers (pool slots made so far and resident ones). */
size_t pg_engine_grad_bytes(const pg_engine *e);
/* This rank's ZeRO shard of the flat buffers' dense region: [*lo, *hi) (the
 * whole region without ZeRO), and of the experts' region (over the
 * expert_data group; empty without expert parallelism). */
void pg_engine_shard(const pg_engine *e, int64_t *lo, int64_t *hi);
void pg_engine_expert_shard(const pg_engine *e, int64_t *lo, int64_t *hi);
/* ZeRO-1 after an update: every rank's shards to all the others (each region
 * over its group). No-op without ZeRO. */
int pg_engine_gather_params(pg_engine *e);
/* Total parameters of the full (unsharded) model. Not collective: counted
 * once, when the engine is made (a sum over the tensor and pipeline groups
 * there); a rank that asked alone used to leave the others' next collective
 * facing this sum. */
int64_t pg_engine_num_parameters(const pg_engine *e);
/* The parameter of that name on this rank, or NULL. */
pg_param *pg_engine_find_param(const pg_engine *e, const char *name);
/* This rank's piece of p (its tensor-parallel shard, p->numel floats) into
 * host memory `piece`; with ZeRO-3 gathered over the data group (collective
 * there: every member asks for the same parameters in the same order). */
int pg_engine_read_param(pg_engine *e, pg_param *p, float *piece);
/* The other way, local: with ZeRO-3 only the part inside this rank's shard is kept. */
int pg_engine_write_param(pg_engine *e, pg_param *p, const float *piece);
/* Fills this rank's shard of p from a full (host) tensor of full_rows rows
 * (pg_param_load_full), wherever the engine keeps its parameters. */
int pg_engine_load_param(pg_engine *e, pg_param *p, const float *full, int64_t full_rows);
/* The full tensor of a parameter, assembled from the shards of the tensor
 * group into `full` (p->full_shape). Collective over the tensor group. */
int pg_engine_gather_param(pg_engine *e, pg_param *p, float *full);

/* Saved activation bytes per micro-batch on this rank (all chunks). */
size_t pg_engine_slot_bytes(const pg_engine *e);
/* Activation bytes of the buffers (peak = 0) or of the micro-batches a step
 * held at its worst moment (peak = 1), chunk by chunk, not counting the
 * fixed bytes of recomputation (pg_module_fixed_bytes). */
size_t pg_engine_activation_bytes(const pg_engine *e, int peak);

#endif
