#include "comm_impl.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- device memory, staged through the host ----
 *
 * A device engine's modules hand device buffers to these collectives. Where
 * no NCCL communicator serves the group (pg_comm_attach_device), such a
 * buffer is copied to host memory (after the device has finished writing
 * it), reduced or moved there by the MPI algorithms below, and copied back:
 * the same arithmetic in the same order as for host memory, so results equal
 * the cpu backend's reductions. Said once per process, on stderr. */

static void say_staged(pg_context *ctx, const char *why) {
  static int said;
  if (!said && ctx->rank == 0) fprintf(stderr, "pipegoose: %s\n", why);
  said = 1;
}

/* Staging buffers are page-locked (pinned) host memory, which the GPU copies
 * at full speed without a bounce buffer; they are kept for reuse, since
 * cudaMallocHost costs milliseconds, until the last device context detaches.
 * Past PG_PINNED_BLOCKS buffers in use at once, plain malloc. */
#define PG_PINNED_BLOCKS 16
static struct {
  void *p;
  size_t bytes;
  int busy;
} pinned[PG_PINNED_BLOCKS];
static int attached_contexts;

static void *host_take(size_t bytes) {
#ifdef PG_WITH_CUDA
  int fit = -1, empty = -1, small = -1;
  for (int i = 0; i < PG_PINNED_BLOCKS; i++) {
    if (!pinned[i].p) empty = empty < 0 ? i : empty;
    else if (pinned[i].busy) continue;
    else if (pinned[i].bytes >= bytes) fit = fit < 0 || pinned[i].bytes < pinned[fit].bytes ? i : fit;
    else small = i;
  }
  if (fit < 0 && empty < 0 && small >= 0) { /* a free block too small: make it big enough */
    cudaFreeHost(pinned[small].p);
    pinned[small].p = NULL;
    empty = small;
  }
  if (fit < 0 && empty >= 0 && cudaMallocHost(&pinned[empty].p, bytes) == cudaSuccess) {
    pinned[empty].bytes = bytes;
    fit = empty;
  } else if (fit < 0 && empty >= 0) {
    pinned[empty].p = NULL;
    (void)cudaGetLastError();
  }
  if (fit >= 0) {
    pinned[fit].busy = 1;
    return pinned[fit].p;
  }
#endif
  return malloc(bytes);
}

void comm_host_give(void *p) {
  if (!p) return;
  for (int i = 0; i < PG_PINNED_BLOCKS; i++)
    if (pinned[i].p == p) {
      pinned[i].busy = 0;
      return;
    }
  free(p);
}

static void host_release_all(void) {
#ifdef PG_WITH_CUDA
  for (int i = 0; i < PG_PINNED_BLOCKS; i++)
    if (pinned[i].p && !pinned[i].busy) {
      cudaFreeHost(pinned[i].p);
      pinned[i].p = NULL;
    }
#endif
}

int comm_stage(pg_context *ctx, pg_mode m, void **buf, size_t bytes, int copy_in, staged *s) {
  s->dev = s->host = NULL;
  s->bytes = bytes;
  if (ctx->group[m].size == 1 || !bytes || !pg_backend_is_device_memory(*buf)) return PG_OK;
  say_staged(ctx, "some collectives on device memory go through host buffers over MPI (blocks NCCL cannot "
                  "split evenly, transfers other than to a pipeline neighbour)");
  if (!(s->host = host_take(bytes))) return pg_fail("out of memory staging %zu bytes of device memory", bytes);
  s->dev = *buf;
  /* The device must be done with the buffer before the host reads it (copy_in)
   * or unstage overwrites it: the engine's stream does not wait for the legacy
   * stream's cudaMemcpy, so a kernel still reading the previous micro-batch's
   * activation would see the next one (seen on an H200; the emulator's
   * deferred streams now show it too). */
  if (pg_cuda_synchronize() || (copy_in && pg_cuda_memcpy(s->host, s->dev, bytes, PG_CUDA_DEVICE_TO_HOST))) {
    comm_host_give(s->host);
    s->dev = s->host = NULL;
    return PG_ERR;
  }
  *buf = s->host;
  return PG_OK;
}

/* ---- NCCL: collectives on device memory, queued on the device engine's stream ---- */

#ifdef PG_WITH_CUDA

ncclDataType_t comm_nccl_type(pg_dtype d) {
  switch (d) {
  case PG_INT32: return ncclInt32;
  case PG_INT64: return ncclInt64;
  case PG_FLOAT64: return ncclFloat64;
  case PG_BFLOAT16: return ncclBfloat16;
  default: return ncclFloat32;
  }
}

ncclRedOp_t comm_nccl_op(pg_reduce_op op) {
  return op == PG_REDUCE_MAX ? ncclMax : op == PG_REDUCE_MIN ? ncclMin : op == PG_REDUCE_AVG ? ncclAvg : ncclSum;
}

int comm_nccl_done(ncclResult_t r, const char *what, pg_mode m) {
  if (r == ncclSuccess) return PG_OK;
  int dev = -1;
  cudaGetDevice(&dev);
  return pg_fail("%s over the %s group failed on cuda:%d: %s", what, pg_mode_name(m), dev, ncclGetErrorString(r));
}

/* The group's NCCL communicator when buf is device memory and there is one. */
ncclComm_t comm_nccl_for(pg_context *ctx, pg_mode m, const void *buf) {
  return ctx->comm->nccl[m] && pg_backend_is_device_memory(buf) ? (ncclComm_t)ctx->comm->nccl[m] : NULL;
}

/* A communicator split from the world's: every rank of the world calls it,
 * members with their colour, the others with NCCL_SPLIT_NOCOLOR. */
static int split(pg_context *ctx, int color, int key, void **out, pg_mode m) {
  ncclComm_t c = NULL;
  if (comm_nccl_done(ncclCommSplit((ncclComm_t)ctx->comm->nccl_world, color, key, &c, NULL), "creating the NCCL communicator", m))
    return PG_ERR;
  *out = c;
  return PG_OK;
}

/* The pipeline link that carries a transfer to or from pipeline rank `peer`
 * when it is a neighbour (NULL otherwise), and the peer's rank in it (a link's
 * rank 0 is its lower stage). Activations go up, gradients down, each
 * direction on its own communicator. NCCL has no tags: each direction's
 * transfers are received in the order they are sent, the schedule's order on
 * both sides. */
ncclComm_t comm_pipeline_link(pg_context *ctx, int peer, int sending, int *peer_in_link) {
  int me = ctx->group[PG_MODE_PIPELINE].rank;
  *peer_in_link = peer == me + 1 ? 1 : 0;
  if (peer == me + 1) return (ncclComm_t)ctx->comm->nccl_next[sending ? 0 : 1];
  if (peer == me - 1) return (ncclComm_t)ctx->comm->nccl_prev[sending ? 1 : 0];
  return NULL;
}

/* The context ring's communicator (split from the world's: every world rank calls it) and its stream, when the
 * context group has more than one rank. The group's other collectives keep to nccl[] (none for context), so only
 * the ring's exchanges (pg_iexchange_buf) change transport. */
static int attach_context_ring(pg_context *ctx) {
  pg_group *g = &ctx->group[PG_MODE_CONTEXT];
  if (split(ctx, g->size > 1 ? g->ranks[0] : NCCL_SPLIT_NOCOLOR, g->rank, &ctx->comm->nccl_ring, PG_MODE_CONTEXT))
    return PG_ERR;
  if (!ctx->comm->nccl_ring) return PG_OK;
  cudaStream_t st = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  if (e != cudaSuccess) return pg_fail("creating the context ring's stream failed: %s", cudaGetErrorString(e));
  ctx->comm->ring_stream = st;
  return PG_OK;
}

static void detach_context_ring(pg_context *ctx) {
  if (ctx->comm->ring_stream) cudaStreamDestroy((cudaStream_t)ctx->comm->ring_stream);
  if (ctx->comm->nccl_ring) ncclCommDestroy((ncclComm_t)ctx->comm->nccl_ring);
}

/* The uneven collectives of ZeRO-2's buckets and ZeRO-3's gathers, in place
 * on buf (the members' pieces one after another, counts[r] elements for
 * member r): NCCL's reduce-scatter and all-gather take equal blocks only, so
 * each member's piece is its own collective, one per member inside one NCCL
 * group: reduce_v reduces piece r onto member r (ncclReduce, root r),
 * all_gather_v broadcasts piece r from member r (ncclBroadcast, root r).
 * Each element crosses the group once as in NCCL's reduce-scatter and
 * all-gather, without padding the pieces to equal blocks (padding would
 * need slots and shards sized to D x the largest piece, and the shard
 * layout is ZeRO-1's). Pieces of 0 elements are skipped: every member
 * knows the counts, so all skip the same ones. */
static ncclResult_t nccl_pieces(int reduce, void *buf, const int64_t *counts, int size, ncclDataType_t type,
                                ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  size_t es = type == ncclBfloat16 ? 2 : type == ncclFloat64 || type == ncclInt64 ? 8 : 4, at = 0;
  ncclResult_t r = ncclGroupStart();
  for (int i = 0; i < size && r == ncclSuccess; i++) {
    void *piece = (char *)buf + at * es;
    if (counts[i] > 0)
      r = reduce ? ncclReduce(piece, piece, (size_t)counts[i], type, op, i, comm, stream)
                 : ncclBroadcast(piece, piece, (size_t)counts[i], type, i, comm, stream);
    at += (size_t)counts[i];
  }
  ncclResult_t end = ncclGroupEnd(); /* also after a failed call: the group must be closed */
  return r != ncclSuccess ? r : end;
}

ncclResult_t comm_nccl_reduce_v(float *buf, const int64_t *counts, int size, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream) {
  return nccl_pieces(1, buf, counts, size, ncclFloat32, op, comm, stream);
}

ncclResult_t comm_nccl_all_gather_v(void *buf, const int64_t *counts, int size, ncclDataType_t type, ncclComm_t comm,
                                    cudaStream_t stream) {
  return nccl_pieces(0, buf, counts, size, type, ncclSum, comm, stream);
}
#endif

int pg_comm_attach_device(pg_context *ctx, void *stream) {
  if (check_ctx(ctx)) return PG_ERR;
  if (ctx->comm->device_attached) {
    if (ctx->comm->device_stream != stream)
      return pg_fail("this parallel context already serves an engine on another device: one context per device");
    return PG_OK;
  }
  ctx->comm->device_stream = stream;
  ctx->comm->device_attached = 1;
  attached_contexts++;
#ifdef PG_WITH_CUDA
  /* NCCL needs a GPU per rank: if any node has more ranks than GPUs, every
   * rank stages (the same transport everywhere) */
  int devices = 0;
  if (pg_cuda_device_count(&devices)) return PG_ERR;
  int crowded = pg_node_size() > devices;
  if (MPI_Allreduce(MPI_IN_PLACE, &crowded, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD) != MPI_SUCCESS)
    return pg_fail("agreeing on the device transport failed");
  if (crowded) {
    say_staged(ctx, "ranks outnumber the GPUs of a node: collectives on device memory go through host buffers over "
                    "MPI instead of NCCL");
    return PG_OK;
  }
  /* The world's communicator (its id from rank 0 over MPI), and the others
   * split from it: a communicator per tensor, data and embedding group of
   * more than one rank, and per pipeline link and direction. */
  pg_group *w = &ctx->group[PG_MODE_GLOBAL];
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  if (w->rank == 0 && comm_nccl_done(ncclGetUniqueId(&id), "creating an NCCL id", PG_MODE_GLOBAL)) return PG_ERR;
  if (MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, w->comm) != MPI_SUCCESS)
    return pg_fail("sharing the NCCL id of the world failed");
  ncclComm_t world = NULL;
  if (comm_nccl_done(ncclCommInitRank(&world, w->size, id, w->rank), "creating the NCCL communicator", PG_MODE_GLOBAL))
    return PG_ERR;
  ctx->comm->nccl_world = world;
  const pg_mode modes[] = {PG_MODE_TENSOR, PG_MODE_DATA, PG_MODE_EMBEDDING, PG_MODE_EXPERT, PG_MODE_EXPERT_DATA};
  for (size_t i = 0; i < sizeof modes / sizeof *modes; i++) {
    pg_group *g = &ctx->group[modes[i]];
    if (split(ctx, g->size > 1 ? g->ranks[0] : NCCL_SPLIT_NOCOLOR, g->rank, &ctx->comm->nccl[modes[i]], modes[i]))
      return PG_ERR;
  }
  if (attach_context_ring(ctx)) return PG_ERR;
  /* Link (s, s + 1) of a pipeline group is named by its lower member's
   * global rank; in two rounds (even s, then odd s) so that a rank is in at
   * most one link per split. */
  pg_group *p = &ctx->group[PG_MODE_PIPELINE];
  for (int round = 0; round < 2; round++)
    for (int dir = 0; dir < 2; dir++) {
      int lower = p->rank % 2 == round ? p->rank : p->rank - 1, member = lower >= 0 && lower + 1 < p->size;
      void *c = NULL;
      if (split(ctx, member ? p->ranks[lower] : NCCL_SPLIT_NOCOLOR, p->rank, &c, PG_MODE_PIPELINE)) return PG_ERR;
      if (member) *(lower == p->rank ? &ctx->comm->nccl_next[dir] : &ctx->comm->nccl_prev[dir]) = c;
    }
  if (p->size > 1) {
    cudaStream_t st = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) return pg_fail("creating the pipeline's send stream failed: %s", cudaGetErrorString(e));
    ctx->comm->send_stream = st;
  }
  if (ctx->comm->nccl[PG_MODE_DATA]) {
    cudaStream_t st = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) return pg_fail("creating the data group's reduction stream failed: %s", cudaGetErrorString(e));
    ctx->comm->reduce_stream = st;
  }
#endif
  return PG_OK;
}

int pg_comm_device_overlap(const pg_context *ctx, pg_mode m) {
  return m == PG_MODE_DATA && ctx->comm && ctx->comm->reduce_stream != NULL;
}

void pg_comm_detach_device(pg_context *ctx) {
  if (!ctx->comm) return;
#ifdef PG_WITH_CUDA
  for (int m = 0; m < PG_NUM_MODES; m++)
    if (ctx->comm->nccl[m]) ncclCommDestroy((ncclComm_t)ctx->comm->nccl[m]);
  for (int d = 0; d < 2; d++) {
    if (ctx->comm->nccl_next[d]) ncclCommDestroy((ncclComm_t)ctx->comm->nccl_next[d]);
    if (ctx->comm->nccl_prev[d]) ncclCommDestroy((ncclComm_t)ctx->comm->nccl_prev[d]);
  }
  if (ctx->comm->nccl_world) ncclCommDestroy((ncclComm_t)ctx->comm->nccl_world);
  if (ctx->comm->send_stream) cudaStreamDestroy((cudaStream_t)ctx->comm->send_stream);
  if (ctx->comm->reduce_stream) cudaStreamDestroy((cudaStream_t)ctx->comm->reduce_stream);
  detach_context_ring(ctx);
#endif
  for (int m = 0; m < PG_NUM_MODES; m++) ctx->comm->nccl[m] = NULL;
  for (int d = 0; d < 2; d++) ctx->comm->nccl_next[d] = ctx->comm->nccl_prev[d] = NULL;
  ctx->comm->nccl_world = ctx->comm->send_stream = ctx->comm->reduce_stream = NULL;
  ctx->comm->nccl_ring = ctx->comm->ring_stream = NULL;
  if (ctx->comm->device_attached && --attached_contexts == 0) host_release_all();
  ctx->comm->device_attached = 0;
  ctx->comm->device_stream = NULL;
}

/* Back to the device (when copy_out and the collective succeeded); rc passes through. */
int comm_unstage(staged *s, int rc, int copy_out) {
  if (!s->dev) return rc;
  if (rc == PG_OK && copy_out &&
      (pg_cuda_memcpy(s->dev, s->host, s->bytes, PG_CUDA_HOST_TO_DEVICE) || pg_cuda_synchronize()))
    rc = PG_ERR;
  comm_host_give(s->host);
  return rc;
}
