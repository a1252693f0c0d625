#include "pg_comm.h"
#include "comm_impl.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int pg_comm_init(pg_context *ctx) {
  if (ctx->comm) return PG_OK;
  ctx->comm = calloc(1, sizeof *ctx->comm);
  return ctx->comm ? PG_OK : pg_fail("out of memory for the parallel context's communication state");
}

void pg_comm_release(pg_context *ctx) {
  struct pg_comm_state *s = ctx->comm;
  if (!s) return;
  pg_comm_detach_device(ctx);
  free(s->ring_scratch);
  /* A call that timed out may have left records in flight from this scratch:
   * it is kept (leaked) then, as MPI may still write into it. */
  if (!s->broken) free(s->agree_scratch);
  free(s->broken);
  free(s);
  ctx->comm = NULL;
}

const pg_comm_stats *pg_comm_stats_of(const pg_context *ctx) {
  static const pg_comm_stats none;
  return ctx->comm ? &ctx->comm->stats : &none;
}

int pg_comm_broken(const pg_context *ctx) { return ctx->comm && ctx->comm->broken; }

void pg_comm_stats_reset(pg_context *ctx) {
  if (ctx->comm) memset(&ctx->comm->stats, 0, sizeof ctx->comm->stats);
}

int pg_reduce_op_from_name(const char *name, pg_reduce_op *out) {
  if (!strcmp(name, "sum")) *out = PG_REDUCE_SUM;
  else if (!strcmp(name, "max")) *out = PG_REDUCE_MAX;
  else if (!strcmp(name, "min")) *out = PG_REDUCE_MIN;
  else if (!strcmp(name, "avg")) *out = PG_REDUCE_AVG;
  else return pg_fail("unknown reduce op '%s' (expected sum, max, min or avg)", name);
  return PG_OK;
}

int comm_check_dtype(const pg_tensor *t, pg_reduce_op op, int reducing) {
  if (!t->storage) return pg_fail("the tensor was freed");
  if (mpi_type(t->dtype) == MPI_DATATYPE_NULL)
    return pg_fail("collectives support float32 and int32, not %s", pg_dtype_name(t->dtype));
  if (reducing && op == PG_REDUCE_AVG && t->dtype != PG_FLOAT32)
    return pg_fail("op avg needs a float32 tensor, not %s", pg_dtype_name(t->dtype));
  return PG_OK;
}

void comm_count(pg_context *ctx, pg_mode m, pg_coll c, double bytes, double t0) {
  ctx->comm->stats.calls[m][c]++;
  ctx->comm->stats.bytes[m][c] += bytes;
  ctx->comm->stats.seconds[m][c] += pg_wtime() - t0;
}

/* A send or receive NCCL carried device to device (pg_comm_stats.direct). */
void comm_count_direct(pg_context *ctx, pg_mode m, pg_coll c, double bytes, double t0) {
  comm_count(ctx, m, c, bytes, t0);
  ctx->comm->stats.direct[m][c]++;
}

void comm_scale_avg(void *buf, int64_t n, int size) {
  float *x = buf, s = 1.0f / (float)size;
#pragma omp parallel for simd schedule(static) if (parallel : n > 32768)
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* In place over blocks of whole rows of `unit` floats (unit_start): the
 * ZeRO shards (unit 1) and sequence parallelism's rows. NCCL's blocks are
 * equal: it serves a device buffer whose rows split evenly; otherwise the
 * buffer is staged through the host. */
static int reduce_scatter_units(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_reduce_op op, int64_t unit,
                                pg_dtype dtype) {
  if (check_ctx(ctx) || comm_agree_coll(ctx, m, PG_COLL_REDUCE_SCATTER, dtype, op, -1, n)) return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  double t0 = pg_wtime();
  size_t es = pg_dtype_size(dtype);
#ifdef PG_WITH_CUDA
  ncclComm_t nc = (n / unit) % g->size ? NULL : comm_nccl_for(ctx, m, buf); /* NCCL's blocks are equal */
  if (nc) {
    int64_t blk = n / g->size;
    if (comm_nccl_done(ncclReduceScatter(buf, (char *)buf + (size_t)g->rank * blk * es, (size_t)blk, comm_nccl_type(dtype),
                                    comm_nccl_op(op), nc, NCCL_STREAM(ctx)),
                  "reduce_scatter", m))
      return PG_ERR;
    comm_count(ctx, m, PG_COLL_REDUCE_SCATTER, (double)n * es, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (comm_stage(ctx, m, &buf, (size_t)n * es, 1, &s)) return PG_ERR;
  int rc = comm_ring_reduce_scatter_units(ctx, m, buf, n, op, unit, dtype);
  if (!rc) comm_count(ctx, m, PG_COLL_REDUCE_SCATTER, (double)n * es, t0);
  return comm_unstage(&s, rc, 1);
}

static int all_gather_units(pg_context *ctx, pg_mode m, void *buf, int64_t n, int64_t unit, pg_dtype dtype) {
  if (check_ctx(ctx) || comm_agree_coll(ctx, m, PG_COLL_ALL_GATHER, dtype, -1, -1, n)) return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  double t0 = pg_wtime();
  size_t es = pg_dtype_size(dtype);
#ifdef PG_WITH_CUDA
  ncclComm_t nc = (n / unit) % g->size ? NULL : comm_nccl_for(ctx, m, buf);
  if (nc) {
    int64_t blk = n / g->size;
    if (comm_nccl_done(ncclAllGather((char *)buf + (size_t)g->rank * blk * es, buf, (size_t)blk, comm_nccl_type(dtype), nc,
                                NCCL_STREAM(ctx)),
                  "all_gather", m))
      return PG_ERR;
    comm_count(ctx, m, PG_COLL_ALL_GATHER, (double)n * es, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (comm_stage(ctx, m, &buf, (size_t)n * es, 1, &s)) return PG_ERR;
  int rc = comm_ring_all_gather_units(ctx, m, buf, n, unit, dtype);
  if (!rc) comm_count(ctx, m, PG_COLL_ALL_GATHER, (double)n * es, t0);
  return comm_unstage(&s, rc, 1);
}

int pg_reduce_scatter_inplace(pg_context *ctx, pg_mode m, float *buf, int64_t n, pg_reduce_op op) {
  return reduce_scatter_units(ctx, m, buf, n, op, 1, PG_FLOAT32);
}

int pg_all_gather_inplace(pg_context *ctx, pg_mode m, float *buf, int64_t n) {
  return all_gather_units(ctx, m, buf, n, 1, PG_FLOAT32);
}

/* Sequence parallelism: rows of `width` elements, float32 or bf16 (sums only). */
static int rows_numel(int64_t rows, int64_t width, pg_dtype dtype, pg_reduce_op op, int64_t *n, const char *what) {
  if (rows < 0 || width < 1 || pg_mul_overflows(rows, width, n) || *n > PG_MAX_NUMEL)
    return pg_fail("%s: %lld rows of width %lld", what, (long long)rows, (long long)width);
  if (dtype != PG_FLOAT32 && dtype != PG_BFLOAT16)
    return pg_fail("%s: float32 or bfloat16 rows, not %s", what, pg_dtype_name(dtype));
  if (dtype == PG_BFLOAT16 && op != PG_REDUCE_SUM) return pg_fail("%s: bfloat16 rows are summed only", what);
  return PG_OK;
}

int pg_reduce_scatter_rows(pg_context *ctx, pg_mode m, void *buf, int64_t rows, int64_t width, pg_dtype dtype,
                           pg_reduce_op op) {
  int64_t n = 0;
  return rows_numel(rows, width, dtype, op, &n, "reduce_scatter_rows") ||
                 reduce_scatter_units(ctx, m, buf, n, op, width, dtype)
             ? PG_ERR
             : PG_OK;
}

int pg_all_gather_rows(pg_context *ctx, pg_mode m, void *buf, int64_t rows, int64_t width, pg_dtype dtype) {
  int64_t n = 0;
  return rows_numel(rows, width, dtype, PG_REDUCE_SUM, &n, "all_gather_rows") ||
                 all_gather_units(ctx, m, buf, n, width, dtype)
             ? PG_ERR
             : PG_OK;
}

static int all_reduce_host(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype, pg_reduce_op op);

int pg_all_reduce_buf(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype, pg_reduce_op op) {
  if (check_ctx(ctx)) return PG_ERR;
  if (mpi_type(dtype) == MPI_DATATYPE_NULL) return pg_fail("all_reduce of %s is not supported", pg_dtype_name(dtype));
  if (op == PG_REDUCE_AVG && dtype != PG_FLOAT32) return pg_fail("op avg needs float32, not %s", pg_dtype_name(dtype));
  if (dtype == PG_BFLOAT16 && op != PG_REDUCE_SUM)
    return pg_fail("all_reduce of bfloat16 sums only, not %s", op == PG_REDUCE_MAX ? "max" : "min");
  if (comm_agree_coll(ctx, m, PG_COLL_ALL_REDUCE, dtype, op, -1, n)) return PG_ERR;
#ifdef PG_WITH_CUDA
  ncclComm_t nc = ctx->group[m].size > 1 && n > 0 ? comm_nccl_for(ctx, m, buf) : NULL;
  if (nc) {
    double t0 = pg_wtime();
    if (comm_nccl_done(ncclAllReduce(buf, buf, (size_t)n, comm_nccl_type(dtype), comm_nccl_op(op), nc, NCCL_STREAM(ctx)),
                  "all_reduce", m))
      return PG_ERR;
    comm_count(ctx, m, PG_COLL_ALL_REDUCE, (double)n * pg_dtype_size(dtype), t0);
    return PG_OK;
  }
#endif
  staged s;
  if (comm_stage(ctx, m, &buf, (size_t)n * pg_dtype_size(dtype), 1, &s)) return PG_ERR;
  return comm_unstage(&s, all_reduce_host(ctx, m, buf, n, dtype, op), 1);
}

static int all_reduce_host(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype, pg_reduce_op op) {
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  double t0 = pg_wtime();
  size_t es = pg_dtype_size(dtype);
  /* bf16 always round the ring: MPI's own sums cannot add bf16 */
  if ((dtype == PG_FLOAT32 && n >= PG_RING_MIN) || dtype == PG_BFLOAT16) {
    /* reduce-scatter + all-gather round the ring (the average folded into the last step) */
    if (comm_ring_reduce_scatter(ctx, m, buf, n, op, dtype) || comm_ring_all_gather(ctx, m, buf, n, dtype)) return PG_ERR;
    comm_count(ctx, m, PG_COLL_ALL_REDUCE, (double)n * es, t0);
    return PG_OK;
  }
  for (int64_t off = 0; off < n; off += PG_MPI_CHUNK) {
    int64_t c = n - off < PG_MPI_CHUNK ? n - off : PG_MPI_CHUNK;
    int rc = MPI_Allreduce(MPI_IN_PLACE, (char *)buf + off * es, (int)c, mpi_type(dtype), mpi_op(op), g->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "all_reduce", m);
  }
  if (op == PG_REDUCE_AVG) comm_scale_avg(buf, n, g->size);
  comm_count(ctx, m, PG_COLL_ALL_REDUCE, (double)n * es, t0);
  return PG_OK;
}

int pg_all_reduce(pg_context *ctx, pg_mode m, pg_tensor *t, pg_reduce_op op) {
  if (comm_check_dtype(t, op, 1)) return PG_ERR;
  return pg_all_reduce_buf(ctx, m, pg_tensor_data(t), t->numel, t->dtype, op);
}

static int check_dim(const pg_tensor *t, int dim) {
  if (dim < 0 || dim >= t->ndim) return pg_fail("dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  return PG_OK;
}

static int all_gather_host(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype);

/* pg_all_gather_buf once the members agreed. */
static int all_gather_agreed(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype) {
#ifdef PG_WITH_CUDA
  ncclComm_t nc = ctx->group[m].size > 1 && n > 0 ? comm_nccl_for(ctx, m, buf) : NULL;
  if (nc) { /* member r's block is [r n, (r+1) n): in place */
    double t0 = pg_wtime();
    size_t es = pg_dtype_size(dtype);
    if (comm_nccl_done(ncclAllGather((char *)buf + (size_t)ctx->group[m].rank * n * es, buf, (size_t)n, comm_nccl_type(dtype), nc,
                                NCCL_STREAM(ctx)),
                  "all_gather", m))
      return PG_ERR;
    comm_count(ctx, m, PG_COLL_ALL_GATHER, (double)n * es * ctx->group[m].size, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (comm_stage(ctx, m, &buf, (size_t)n * ctx->group[m].size * pg_dtype_size(dtype), 1, &s)) return PG_ERR;
  return comm_unstage(&s, all_gather_host(ctx, m, buf, n, dtype), 1);
}

int pg_all_gather_buf(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype) {
  if (check_ctx(ctx) || comm_agree_coll(ctx, m, PG_COLL_ALL_GATHER, dtype, -1, -1, n)) return PG_ERR;
  return all_gather_agreed(ctx, m, buf, n, dtype);
}

static int all_gather_host(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype) {
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  if (n > PG_MPI_CHUNK) return pg_fail("all_gather of %lld elements per member is too large", (long long)n);
  double t0 = pg_wtime();
  if (dtype == PG_FLOAT32 && n * g->size >= PG_RING_MIN) {
    if (comm_ring_all_gather(ctx, m, buf, n * g->size, dtype)) return PG_ERR; /* member r's block is [r n, (r+1) n) */
  } else {
    int rc = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, (int)n, mpi_type(dtype), g->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "all_gather", m);
  }
  comm_count(ctx, m, PG_COLL_ALL_GATHER, (double)n * pg_dtype_size(dtype) * g->size, t0);
  return PG_OK;
}

int pg_all_gather(pg_context *ctx, pg_mode m, const pg_tensor *in, pg_tensor *out, int dim) {
  if (check_ctx(ctx) || comm_check_dtype(in, PG_REDUCE_SUM, 0) || check_dim(in, dim) ||
      comm_agree_shape(ctx, m, PG_COLL_ALL_GATHER, in, dim, -1))
    return PG_ERR;
  pg_group *g = &ctx->group[m];
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, in->shape, sizeof shape);
  shape[dim] *= g->size;
  if (pg_tensor_init(out, in->dtype, in->ndim, shape)) return PG_ERR;
  size_t es = pg_dtype_size(in->dtype), bytes = (size_t)in->numel * es;
  if (g->size == 1) {
    memcpy(pg_tensor_data(out), pg_tensor_data(in), bytes);
    return PG_OK;
  }
  int inner_dim0 = 1; /* gathering along dim 0 (or after leading 1s) needs no reordering */
  for (int i = 0; i < dim; i++) inner_dim0 &= in->shape[i] == 1;
  void *tmp = inner_dim0 ? pg_tensor_data(out) : malloc(bytes * g->size);
  if (!tmp) return pg_fail("out of memory in all_gather");
  memcpy((char *)tmp + bytes * g->rank, pg_tensor_data(in), bytes);
  if (all_gather_agreed(ctx, m, tmp, in->numel, in->dtype)) {
    if (!inner_dim0) free(tmp);
    return PG_ERR;
  }
  if (!inner_dim0) {
    pg_tensor_blocks_to_dim(pg_tensor_data(out), tmp, es, in->ndim, in->shape, dim, g->size);
    free(tmp);
  }
  return PG_OK;
}

/* pg_reduce_scatter_buf once the members agreed. */
static int reduce_scatter_agreed(pg_context *ctx, pg_mode m, const void *in, void *out, int64_t n, pg_dtype dtype,
                                 pg_reduce_op op) {
  pg_group *g = &ctx->group[m];
  size_t es = pg_dtype_size(dtype);
  if (g->size == 1) {
    if (out != in) memmove(out, in, (size_t)n * es);
    return PG_OK;
  }
  if (n > PG_MPI_CHUNK) return pg_fail("reduce_scatter of %lld elements per member is too large", (long long)n);
  double t0 = pg_wtime();
  if (dtype == PG_FLOAT32 && n * g->size >= PG_RING_MIN) {
    if (in == out) { /* in place: the ring leaves our block at r n; the contract puts it in front */
      if (comm_ring_reduce_scatter(ctx, m, out, n * g->size, op, dtype)) return PG_ERR;
      if (g->rank) memmove(out, (float *)out + n * g->rank, (size_t)n * es);
    } else if (comm_ring_reduce_scatter_to(ctx, m, in, out, n, op)) {
      return PG_ERR;
    }
  } else {
    /* in == out: in place (the member's block lands at the front of the buffer) */
    int rc = MPI_Reduce_scatter_block(in == out ? MPI_IN_PLACE : in, out, (int)n, mpi_type(dtype), mpi_op(op), g->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "reduce_scatter", m);
    if (op == PG_REDUCE_AVG) comm_scale_avg(out, n, g->size);
  }
  comm_count(ctx, m, PG_COLL_REDUCE_SCATTER, (double)n * es * g->size, t0);
  return PG_OK;
}

int pg_reduce_scatter_buf(pg_context *ctx, pg_mode m, const void *in, void *out, int64_t n, pg_dtype dtype,
                          pg_reduce_op op) {
  if (dtype == PG_BFLOAT16) return pg_fail("reduce_scatter of bfloat16 is not supported (pg_reduce_scatter_rows is)");
  /* the record counts what each member puts in, as pg_reduce_scatter's does */
  if (check_ctx(ctx) || comm_agree_coll(ctx, m, PG_COLL_REDUCE_SCATTER, dtype, op, -1, n * ctx->group[m].size))
    return PG_ERR;
  return reduce_scatter_agreed(ctx, m, in, out, n, dtype, op);
}

int pg_reduce_scatter(pg_context *ctx, pg_mode m, const pg_tensor *in, pg_tensor *out, int dim, pg_reduce_op op) {
  /* agreed first: the divisibility below is then the same test on every member */
  if (check_ctx(ctx) || comm_check_dtype(in, op, 1) || check_dim(in, dim) ||
      comm_agree_shape(ctx, m, PG_COLL_REDUCE_SCATTER, in, dim, op))
    return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (in->shape[dim] % g->size)
    return pg_fail("reduce_scatter: dimension %d of size %lld is not divisible by the %s group size %d", dim + 1,
                   (long long)in->shape[dim], pg_mode_name(m), g->size);
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, in->shape, sizeof shape);
  shape[dim] /= g->size;
  if (pg_tensor_init(out, in->dtype, in->ndim, shape)) return PG_ERR;
  size_t es = pg_dtype_size(in->dtype);
  int leading = 1;
  for (int i = 0; i < dim; i++) leading &= in->shape[i] == 1;
  const void *src = pg_tensor_data(in);
  void *tmp = NULL;
  if (!leading && g->size > 1) {
    tmp = malloc((size_t)in->numel * es);
    if (!tmp) return pg_fail("out of memory in reduce_scatter");
    pg_tensor_dim_to_blocks(tmp, src, es, in->ndim, shape, dim, g->size);
    src = tmp;
  }
  int rc = reduce_scatter_agreed(ctx, m, src, pg_tensor_data(out), out->numel, in->dtype, op);
  free(tmp);
  return rc;
}

int pg_broadcast_buf(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype, int src) {
  if (check_ctx(ctx)) return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (src < 0 || src >= g->size)
    return pg_fail("broadcast source %d is not a local rank of the %s group (size %d)", src, pg_mode_name(m), g->size);
  if (comm_agree_coll(ctx, m, PG_COLL_BROADCAST, dtype, -1, src, n)) return PG_ERR;
  if (g->size == 1 || n == 0) return PG_OK;
  size_t es = pg_dtype_size(dtype);
  staged s;
  if (comm_stage(ctx, m, &buf, (size_t)n * es, g->rank == src, &s)) return PG_ERR;
  double t0 = pg_wtime();
  int rc = MPI_SUCCESS;
  for (int64_t off = 0; off < n && rc == MPI_SUCCESS; off += PG_MPI_CHUNK) {
    int64_t c = n - off < PG_MPI_CHUNK ? n - off : PG_MPI_CHUNK;
    rc = MPI_Bcast((char *)buf + off * es, (int)c, mpi_type(dtype), src, g->comm);
  }
  if (rc != MPI_SUCCESS) return comm_unstage(&s, mpi_fail(rc, "broadcast", m), 0);
  comm_count(ctx, m, PG_COLL_BROADCAST, (double)n * es, t0);
  return comm_unstage(&s, PG_OK, 1);
}

int pg_broadcast(pg_context *ctx, pg_mode m, pg_tensor *t, int src) {
  if (comm_check_dtype(t, PG_REDUCE_SUM, 0)) return PG_ERR;
  return pg_broadcast_buf(ctx, m, pg_tensor_data(t), t->numel, t->dtype, src);
}

static int check_peer(pg_context *ctx, pg_mode m, int peer, const char *what) {
  pg_group *g = &ctx->group[m];
  if (peer < 0 || peer >= g->size)
    return pg_fail("%s peer %d is not a local rank of the %s group (size %d)", what, peer, pg_mode_name(m), g->size);
  if (peer == g->rank) return pg_fail("%s to itself (local rank %d of the %s group); use sendrecv", what, peer, pg_mode_name(m));
  return PG_OK;
}

static int check_count(const pg_tensor *t) {
  if (t->numel > PG_MPI_CHUNK) return pg_fail("point-to-point transfer of %lld elements is too large", (long long)t->numel);
  return PG_OK;
}

int pg_send(pg_context *ctx, pg_mode m, const pg_tensor *t, int dst, int tag) {
  if (check_ctx(ctx) || comm_check_dtype(t, PG_REDUCE_SUM, 0) || check_peer(ctx, m, dst, "send") || check_count(t)) return PG_ERR;
  call_rec c = comm_make_rec(ctx, m, PG_COLL_SEND, t->dtype, -1, t->numel);
  c.dst = dst;
  c.tag = tag;
  if (comm_agree_pair(ctx, m, &c)) return PG_ERR;
  double t0 = pg_wtime();
  int rc = MPI_Send(pg_tensor_data(t), (int)t->numel, mpi_type(t->dtype), dst, tag, ctx->group[m].comm);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "send", m);
  comm_count(ctx, m, PG_COLL_SEND, (double)t->numel * pg_dtype_size(t->dtype), t0);
  return PG_OK;
}

int pg_recv(pg_context *ctx, pg_mode m, pg_tensor *t, int src, int tag) {
  if (check_ctx(ctx) || comm_check_dtype(t, PG_REDUCE_SUM, 0) || check_peer(ctx, m, src, "recv") || check_count(t)) return PG_ERR;
  call_rec c = comm_make_rec(ctx, m, PG_COLL_RECV, -1, -1, 0);
  c.src = src;
  c.tag = tag;
  c.recv_dtype = t->dtype;
  c.recv_count = t->numel;
  if (comm_agree_pair(ctx, m, &c)) return PG_ERR;
  double t0 = pg_wtime();
  MPI_Status st;
  int rc = MPI_Recv(pg_tensor_data(t), (int)t->numel, mpi_type(t->dtype), src, tag, ctx->group[m].comm, &st);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "recv", m);
  int got = 0;
  MPI_Get_count(&st, mpi_type(t->dtype), &got);
  if (got != t->numel)
    return pg_fail("recv: expected %lld elements from local rank %d of the %s group, got %d", (long long)t->numel, src,
                   pg_mode_name(m), got);
  comm_count(ctx, m, PG_COLL_RECV, (double)t->numel * pg_dtype_size(t->dtype), t0);
  return PG_OK;
}

int pg_sendrecv(pg_context *ctx, pg_mode m, const pg_tensor *send, int dst, pg_tensor *recv, int src, int tag) {
  if (check_ctx(ctx) || comm_check_dtype(send, PG_REDUCE_SUM, 0) || comm_check_dtype(recv, PG_REDUCE_SUM, 0) ||
      check_count(send) || check_count(recv))
    return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (dst < 0 || dst >= g->size || src < 0 || src >= g->size)
    return pg_fail("sendrecv peers %d and %d must be local ranks of the %s group (size %d)", dst, src, pg_mode_name(m), g->size);
  if (g->size == 1) {
    ctx->comm->site[0] = 0;
    return pg_tensor_copy(recv, send);
  }
  call_rec c = comm_make_rec(ctx, m, PG_KIND_SENDRECV, send->dtype, -1, send->numel);
  c.dst = dst;
  c.src = src;
  c.tag = tag;
  c.recv_dtype = recv->dtype;
  c.recv_count = recv->numel;
  if (comm_agree_pair(ctx, m, &c)) return PG_ERR;
  double t0 = pg_wtime();
  MPI_Status st;
  int rc = MPI_Sendrecv(pg_tensor_data(send), (int)send->numel, mpi_type(send->dtype), dst, tag, pg_tensor_data(recv),
                        (int)recv->numel, mpi_type(recv->dtype), src, tag, g->comm, &st);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "sendrecv", m);
  comm_count(ctx, m, PG_COLL_SEND, (double)send->numel * pg_dtype_size(send->dtype), t0);
  ctx->comm->stats.calls[m][PG_COLL_RECV]++;
  return PG_OK;
}

int pg_barrier(pg_context *ctx, pg_mode m) {
  if (check_ctx(ctx) || comm_agree_coll(ctx, m, PG_COLL_BARRIER, -1, -1, -1, 0)) return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (g->size == 1) return PG_OK;
  double t0 = pg_wtime();
  int rc = MPI_Barrier(g->comm);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "barrier", m);
  comm_count(ctx, m, PG_COLL_BARRIER, 0, t0);
  return PG_OK;
}
