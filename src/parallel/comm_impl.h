/* The private side of pg_comm, shared by its files (not installed):
 *   pg_comm.c          the collectives on a context's groups (all_reduce, all_gather, reduce_scatter, broadcast,
 *                      send/recv, barrier) and their bookkeeping (counts in comm_stats)
 *   comm_agree.c       the agreement step before every call and the watchdog (call records, deadlines)
 *   comm_device.c      device memory: staged through pinned host buffers, or NCCL on the device engine's stream
 *   comm_ring.c        the chunked ring reduce-scatter / all-gather (float32 and bf16)
 *   comm_all_to_all.c  all-to-all with variable counts (expert parallelism)
 *   comm_requests.c    nonblocking transfers: the pipeline's sends and receives, a bucket's reduction in flight
 *   comm_shm.c         collectives over buffers mapped in shared memory (pg_shm.h)
 * Names here start with comm_; nothing outside src/parallel includes this file. */
#ifndef PG_COMM_IMPL_H
#define PG_COMM_IMPL_H

#include <stdint.h>
#include <stdlib.h>

#include "kernels.h" /* pg_bf16_round / pg_bf16_value: the ring's bf16 sums */
#include "pg_backend.h" /* pg_backend_is_device_memory */
#include "pg_clock.h"
#include "pg_comm.h"
#include "pg_cuda.h"
#include "pg_error.h"
#include "pg_size.h"

#ifdef PG_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

/* MPI counts are int: larger buffers go in chunks of this many elements. */
#define PG_MPI_CHUNK ((int64_t)1 << 30)

#define PG_RING_CHUNK ((int64_t)1 << 18) /* floats per transfer (1 MiB) */
#define PG_RING_TAG 0x5067               /* collectives are blocking: no user message can be in flight */
#define PG_RING_MIN ((int64_t)1 << 18)   /* floats: at 1 MiB ring and MPI_Allreduce were even (bench_comm); below, MPI's latency-optimised algorithms */

#define PG_AGREE_TAG 32767 /* the records' tag on the agreement communicators (MPI guarantees tags up to it) */
#define PG_KIND_SENDRECV PG_NUM_COLLS

/* pg_comm's state of a context (ctx->comm), made by pg_comm_init. */
struct pg_comm_state {
  pg_comm_stats stats;
  float *ring_scratch; /* receive buffer of the chunked ring collectives (comm_ring.c), made on first use */
  void *device_stream; /* the device engine's stream its NCCL collectives are queued on (pg_comm_attach_device) */
  int device_attached;
  /* NCCL beyond the groups' communicators (comm_device.c): the world's, which the
   * others are split from; per pipeline neighbour one communicator for each
   * direction ([0] activations, forward; [1] gradients, backward), so that
   * each carries its transfers in one order; the stream sends are queued on;
   * the stream the data group's overlapped bucket reductions run on */
  void *nccl_world, *nccl_next[2], *nccl_prev[2], *send_stream, *reduce_stream;
  /* the context ring's (pg_iexchange_buf): the context group's NCCL communicator, kept apart from nccl[] so
   * that the group's collectives stay as they are, and the stream its exchanges run on */
  void *nccl_ring, *ring_stream;
  /* The agreement step and the watchdog (comm_agree.c): where the next call
   * comes from (pg.dist's bindings set it: "spec.lua:10"), the records of a
   * call's members (scratch, grown as needed), and the message of a call that
   * timed out or disagreed: once set, every later call on the context fails
   * with it (records or data may still be in flight). */
  char site[PG_SITE_MAX];
  void *agree_scratch;
  size_t agree_scratch_bytes;
  char *broken;
  void *nccl[PG_NUM_MODES]; /* each group's NCCL communicator once a device engine uses the context, or NULL */
};

/* What a member says it is about to do (comm_agree.c): compared with every other member's record. */
typedef struct call_rec {
  int32_t kind;         /* pg_coll, or PG_KIND_SENDRECV */
  int32_t dtype, op;    /* -1: not part of the call */
  int32_t root;         /* broadcast source (local rank), else -1 */
  int32_t me;           /* the member that made the record (local rank) */
  int32_t dst, src;     /* point to point: local ranks, -1: none */
  int32_t tag;          /* point to point */
  int32_t recv_dtype;   /* what a recv or sendrecv receives */
  int32_t pad;
  int64_t count;        /* elements sent or reduced (per member for all_gather and reduce_scatter) */
  int64_t recv_count;   /* elements received */
  int32_t ndim, dim;    /* all_gather and reduce_scatter of a tensor: its shape and the dimension (0-based); else 0 */
  int64_t shape[PG_MAX_DIMS]; /* ([2, 3] against [3, 2] along dimension 2: one count, different blocks) */
  char site[PG_SITE_MAX]; /* "spec.lua:10"; "": the runtime */
} call_rec;

/* A device buffer's host copy for one call (comm_stage / comm_unstage); dev is NULL for host memory. */
typedef struct staged {
  void *dev, *host;
  size_t bytes;
} staged;

static inline MPI_Datatype mpi_type(pg_dtype d) {
  switch (d) {
  case PG_FLOAT32: return MPI_FLOAT;
  case PG_INT32: return MPI_INT32_T;
  case PG_FLOAT64: return MPI_DOUBLE;
  case PG_INT64: return MPI_INT64_T;
  case PG_BFLOAT16: return MPI_UINT16_T; /* moved as bits; summed only by the ring (fold_bf16) */
  default: return MPI_DATATYPE_NULL;
  }
}

static inline MPI_Op mpi_op(pg_reduce_op op) {
  switch (op) {
  case PG_REDUCE_MAX: return MPI_MAX;
  case PG_REDUCE_MIN: return MPI_MIN;
  default: return MPI_SUM;
  }
}

static inline int mpi_fail(int rc, const char *what, pg_mode m) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return pg_fail("%s over the %s group failed: %s", what, pg_mode_name(m), msg);
}

static inline int check_ctx(pg_context *ctx) {
  if (!ctx || ctx->destroyed) return pg_fail("the parallel context was destroyed");
  if (!ctx->comm) return pg_fail("the parallel context has no communication state (pg_comm_init was not called)");
  if (ctx->comm->broken) return pg_fail("the parallel context failed earlier and cannot be used: %s", ctx->comm->broken);
  return PG_OK;
}

/* comm_agree.c */
int comm_agree_coll(pg_context *ctx, pg_mode m, pg_coll kind, int dtype, int op, int root, int64_t count);
int comm_agree_pair(pg_context *ctx, pg_mode m, call_rec *c);
int comm_agree_shape(pg_context *ctx, pg_mode m, pg_coll kind, const pg_tensor *t, int dim, int op);
int comm_debug_checks(void);
void comm_describe(const pg_group *g, const call_rec *c, char *buf, size_t n);
int comm_disagree(pg_context *ctx, const char *msg);
int comm_give_up(pg_context *ctx, int n, MPI_Request *reqs, const char *msg);
int comm_global_rank(const pg_group *g, int local);
void comm_rank_name(const pg_group *g, int local, char *buf, size_t n);
call_rec comm_make_rec(pg_context *ctx, pg_mode m, int kind, int dtype, int op, int64_t count);
int comm_pair_matches(const call_rec *s, const call_rec *r);
int comm_pair_message(pg_context *ctx, const pg_group *g, pg_mode m, const call_rec *s, const call_rec *r);
int comm_poll_all(int n, MPI_Request *reqs, int *idx, MPI_Status *st, double deadline, const char *what, pg_mode m);
int comm_scratch(pg_context *ctx, int n, call_rec **recs, MPI_Request **reqs, int **idx);
int comm_timeout_ok(double *limit);

/* comm_device.c */
void comm_host_give(void *p);
int comm_stage(pg_context *ctx, pg_mode m, void **buf, size_t bytes, int copy_in, staged *s);
int comm_unstage(staged *s, int rc, int copy_out);

/* pg_comm.c */
int comm_check_dtype(const pg_tensor *t, pg_reduce_op op, int reducing);
void comm_count(pg_context *ctx, pg_mode m, pg_coll c, double bytes, double t0);
void comm_count_direct(pg_context *ctx, pg_mode m, pg_coll c, double bytes, double t0);
void comm_scale_avg(void *buf, int64_t n, int size);

/* comm_ring.c */
int64_t comm_block_start(int64_t n, int size, int b);
int comm_ring_all_gather(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype);
int comm_ring_all_gather_units(pg_context *ctx, pg_mode m, void *data, int64_t n, int64_t unit, pg_dtype dtype);
int comm_ring_reduce_scatter(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_reduce_op op, pg_dtype dtype);
int comm_ring_reduce_scatter_to(pg_context *ctx, pg_mode m, const float *in, float *out, int64_t per, pg_reduce_op op);
int comm_ring_reduce_scatter_units(pg_context *ctx, pg_mode m, void *data, int64_t n, pg_reduce_op op, int64_t unit, pg_dtype dtype);

#ifdef PG_WITH_CUDA
#define NCCL_STREAM(ctx) ((cudaStream_t)(ctx)->comm->device_stream)

/* comm_device.c */
int comm_nccl_done(ncclResult_t r, const char *what, pg_mode m);
ncclComm_t comm_nccl_for(pg_context *ctx, pg_mode m, const void *buf);
ncclRedOp_t comm_nccl_op(pg_reduce_op op);
ncclDataType_t comm_nccl_type(pg_dtype d);
ncclComm_t comm_pipeline_link(pg_context *ctx, int peer, int sending, int *peer_in_link);
ncclResult_t comm_nccl_reduce_v(float *buf, const int64_t *counts, int size, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream);
ncclResult_t comm_nccl_all_gather_v(void *buf, const int64_t *counts, int size, ncclDataType_t type, ncclComm_t comm,
                                    cudaStream_t stream);
#endif

#endif
