#include "comm_impl.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- chunked ring collectives (float32) ----
 *
 * Large float reductions go round the ring in chunks instead of through
 * MPI_Allreduce: each step is one MPI_Sendrecv of a chunk (a single copy with
 * Open MPI's shared-memory transport) and one pass that folds it into the
 * local buffer, so the whole operation moves each byte the minimum number of
 * times, needs no buffer as large as the data (Open MPI's in-place
 * reduce_scatter allocates one), and the ZeRO shard ends up in place. Every
 * block is reduced along one fixed path and then copied, so all members get
 * the same bits, and the result does not depend on timing. For two members
 * the sum is a + b, the same bits as MPI_Allreduce's. */

int64_t comm_block_start(int64_t n, int size, int b) { return n * b / size; }

/* Elements of a block of `len` in the transfer that starts at `off` (0 past its end). */
static int piece(int64_t len, int64_t off) {
  int64_t c = len - off;
  return (int)(c <= 0 ? 0 : c < PG_RING_CHUNK ? c : PG_RING_CHUNK);
}

static int ring_scratch(pg_context *ctx) {
  if (!ctx->comm->ring_scratch && !(ctx->comm->ring_scratch = malloc((size_t)PG_RING_CHUNK * sizeof(float))))
    return pg_fail("out of memory for the ring collectives' buffer");
  return PG_OK;
}

/* y = op(x, t) over n floats (y may be x); the last step of an average also scales. */
static void fold(float *y, const float *x, const float *t, int64_t n, pg_reduce_op op, float scale) {
  switch (op) {
  case PG_REDUCE_MAX:
#pragma omp parallel for simd schedule(static) if (parallel : n > 32768)
    for (int64_t i = 0; i < n; i++) y[i] = t[i] > x[i] ? t[i] : x[i];
    break;
  case PG_REDUCE_MIN:
#pragma omp parallel for simd schedule(static) if (parallel : n > 32768)
    for (int64_t i = 0; i < n; i++) y[i] = t[i] < x[i] ? t[i] : x[i];
    break;
  default:
    if (scale != 1.0f) {
#pragma omp parallel for simd schedule(static) if (parallel : n > 32768)
      for (int64_t i = 0; i < n; i++) y[i] = (x[i] + t[i]) * scale;
    } else {
#pragma omp parallel for simd schedule(static) if (parallel : n > 32768)
      for (int64_t i = 0; i < n; i++) y[i] = x[i] + t[i];
    }
  }
}

/* y = x + t over n bf16 values (y may be x): the sum of the widened values, rounded, as NCCL's bf16 sum does at
 * each step. */
static void fold_bf16(uint16_t *y, const uint16_t *x, const uint16_t *t, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > 32768)
  for (int64_t i = 0; i < n; i++) y[i] = pg_bf16_round(pg_bf16_value(x[i]) + pg_bf16_value(t[i]));
}

/* Blocks of whole rows of `unit` floats: block b of n floats is rows
 * [R b / size, R (b+1) / size) of its R = n / unit rows (unit 1: elements;
 * sequence parallelism's row blocks, pg_reduce_scatter_rows, are rows of a
 * width). */
static int64_t unit_start(int64_t n, int size, int b, int64_t unit) { return comm_block_start(n / unit, size, b) * unit; }

/* The longest of the size blocks. Each ring step runs this many chunks' worth of exchanges on every member
 * (some of them empty), so every send meets its receive: a member whose own two blocks are short or empty (fewer
 * rows than members) still takes part in each exchange its neighbours make. */
static int64_t longest_block(int64_t n, int size, int64_t unit) {
  int64_t most = 0;
  for (int b = 0; b < size; b++) {
    int64_t len = unit_start(n, size, b + 1, unit) - unit_start(n, size, b, unit);
    if (len > most) most = len;
  }
  return most;
}

/* In place: buf holds `size` blocks (block b = [n b / size, n (b+1) / size),
 * in rows of `unit` floats: unit_start); afterwards this member's block holds
 * the reduction over the group (the other blocks hold partial sums). */
int comm_ring_reduce_scatter_units(pg_context *ctx, pg_mode m, void *data, int64_t n, pg_reduce_op op,
                                     int64_t unit, pg_dtype dtype) {
  pg_group *g = &ctx->group[m];
  int D = g->size, r = g->rank, next = (r + 1) % D, prev = (r + D - 1) % D;
  int64_t most = longest_block(n, D, unit);
  if (ring_scratch(ctx)) return PG_ERR;
  size_t es = pg_dtype_size(dtype); /* float32, or bf16 (sums only: fold_bf16) */
  MPI_Datatype type = mpi_type(dtype);
  char *buf = data, *tmp = (char *)ctx->comm->ring_scratch; /* PG_RING_CHUNK floats: room for a chunk of either */
  /* Step k: send block r-1-k (our partial sum of it) on, receive block
   * r-2-k from the previous member and fold ours in. After D-1 steps the
   * last block received is our own, complete. */
  for (int k = 0; k < D - 1; k++) {
    int sb = ((r - 1 - k) % D + D) % D, rb = ((r - 2 - k) % D + D) % D;
    int64_t s0 = unit_start(n, D, sb, unit), slen = unit_start(n, D, sb + 1, unit) - s0;
    int64_t r0 = unit_start(n, D, rb, unit), rlen = unit_start(n, D, rb + 1, unit) - r0;
    float scale = (op == PG_REDUCE_AVG && k == D - 2) ? 1.0f / (float)D : 1.0f;
    for (int64_t off = 0; off < most; off += PG_RING_CHUNK) {
      int sc = piece(slen, off), rcv = piece(rlen, off);
      char *mine = buf + (r0 + off) * es;
      int rc = MPI_Sendrecv(buf + (s0 + off) * es, sc, type, next, PG_RING_TAG, tmp, rcv, type, prev, PG_RING_TAG,
                            g->comm, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return mpi_fail(rc, "reduce_scatter", m);
      if (dtype == PG_BFLOAT16) fold_bf16((uint16_t *)mine, (uint16_t *)mine, (uint16_t *)tmp, rcv);
      else fold((float *)mine, (float *)mine, (float *)tmp, rcv, op, scale);
    }
  }
  return PG_OK;
}

/* The same steps with the input left alone: `in` holds the size blocks of
 * `per` floats, `out` (per floats) receives this member's reduced block and
 * holds the partial sum passed on at each step in the meantime (it is sent
 * before it is overwritten, chunk by chunk). */
int comm_ring_reduce_scatter_to(pg_context *ctx, pg_mode m, const float *in, float *out, int64_t per,
                                  pg_reduce_op op) {
  pg_group *g = &ctx->group[m];
  int D = g->size, r = g->rank, next = (r + 1) % D, prev = (r + D - 1) % D;
  if (ring_scratch(ctx)) return PG_ERR;
  float *tmp = ctx->comm->ring_scratch;
  for (int k = 0; k < D - 1; k++) {
    int sb = ((r - 1 - k) % D + D) % D, rb = ((r - 2 - k) % D + D) % D;
    const float *send = k == 0 ? in + (int64_t)sb * per : out; /* out: last step's block rb = this step's sb */
    float scale = (op == PG_REDUCE_AVG && k == D - 2) ? 1.0f / (float)D : 1.0f;
    for (int64_t off = 0; off < per; off += PG_RING_CHUNK) {
      int c = piece(per, off);
      int rc = MPI_Sendrecv(send + off, c, MPI_FLOAT, next, PG_RING_TAG, tmp, c, MPI_FLOAT, prev, PG_RING_TAG, g->comm,
                            MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return mpi_fail(rc, "reduce_scatter", m);
      fold(out + off, in + (int64_t)rb * per + off, tmp, c, op, scale);
    }
  }
  return PG_OK;
}

int comm_ring_reduce_scatter(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_reduce_op op, pg_dtype dtype) {
  return comm_ring_reduce_scatter_units(ctx, m, buf, n, op, 1, dtype);
}

/* In place: every member's block (as above) copied to all the others (float32 or bf16 elements). */
int comm_ring_all_gather_units(pg_context *ctx, pg_mode m, void *data, int64_t n, int64_t unit, pg_dtype dtype) {
  pg_group *g = &ctx->group[m];
  int D = g->size, r = g->rank, next = (r + 1) % D, prev = (r + D - 1) % D;
  int64_t most = longest_block(n, D, unit);
  size_t es = pg_dtype_size(dtype);
  MPI_Datatype type = mpi_type(dtype);
  char *buf = data;
  /* Step k: pass on block r-k (ours first), receive block r-1-k. */
  for (int k = 0; k < D - 1; k++) {
    int sb = ((r - k) % D + D) % D, rb = ((r - 1 - k) % D + D) % D;
    int64_t s0 = unit_start(n, D, sb, unit), slen = unit_start(n, D, sb + 1, unit) - s0;
    int64_t r0 = unit_start(n, D, rb, unit), rlen = unit_start(n, D, rb + 1, unit) - r0;
    for (int64_t off = 0; off < most; off += PG_RING_CHUNK) {
      int sc = piece(slen, off), rcv = piece(rlen, off);
      int rc = MPI_Sendrecv(buf + (s0 + off) * es, sc, type, next, PG_RING_TAG + 1, buf + (r0 + off) * es, rcv, type,
                            prev, PG_RING_TAG + 1, g->comm, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return mpi_fail(rc, "all_gather", m);
    }
  }
  return PG_OK;
}

int comm_ring_all_gather(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype) {
  return comm_ring_all_gather_units(ctx, m, buf, n, 1, dtype);
}
