#include "comm_impl.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- shared-memory collectives (pg_shm.h) ----
 *
 * Every member's buffer is mapped here, so a reduction is one pass: member r
 * adds up block r of every buffer (members in order 0, 1, ...: the same bits
 * whoever computes it, and for two members the a + b of the other paths) and
 * writes the result where it is needed. MPI_Barrier orders the passes: all
 * members have finished writing their buffers before anyone reads them, and
 * nobody returns before everyone has finished writing. */

#define PG_SHM_TILE 2048 /* floats summed in a stack buffer (vectorised loops over members) */

static int shm_barrier(pg_context *ctx, pg_mode m) {
  atomic_thread_fence(memory_order_seq_cst);
  int rc = MPI_Barrier(ctx->group[m].comm);
  atomic_thread_fence(memory_order_seq_cst);
  return rc == MPI_SUCCESS ? PG_OK : mpi_fail(rc, "barrier", m);
}

/* Block `rank` of the members' buffers reduced; written to every member's
 * buffer (everyone = 1) or to ours only. */
static void shm_reduce_block(const pg_shm *s, int64_t n, pg_reduce_op op, int everyone) {
  const int D = s->size;
  const int64_t lo = comm_block_start(n, D, s->rank), hi = comm_block_start(n, D, s->rank + 1);
  const float scale = op == PG_REDUCE_AVG ? 1.0f / (float)D : 1.0f;
  float *const *b = s->base;
#pragma omp parallel for schedule(static) if (hi - lo > 32768)
  for (int64_t t0 = lo; t0 < hi; t0 += PG_SHM_TILE) {
    int w = (int)(hi - t0 < PG_SHM_TILE ? hi - t0 : PG_SHM_TILE);
    float acc[PG_SHM_TILE];
    const float *x0 = b[0] + t0;
#pragma omp simd
    for (int j = 0; j < w; j++) acc[j] = x0[j];
    for (int m = 1; m < D; m++) {
      const float *x = b[m] + t0;
#pragma omp simd
      for (int j = 0; j < w; j++) acc[j] += x[j];
    }
    if (scale != 1.0f) {
#pragma omp simd
      for (int j = 0; j < w; j++) acc[j] *= scale;
    }
    for (int m = 0; m < D; m++) {
      if (!everyone && m != s->rank) continue;
      memcpy(b[m] + t0, acc, (size_t)w * sizeof(float));
    }
  }
}

static int check_shm(const pg_shm *s, pg_reduce_op op) {
  if (op != PG_REDUCE_SUM && op != PG_REDUCE_AVG) return pg_fail("shared-memory reductions are sum or avg");
  if (s->size < 2 || !s->base) return pg_fail("the buffers are not shared");
  return PG_OK;
}

/* Both reductions: barrier, reduce our block (into every member's buffer or
 * ours), barrier. The trailing barrier also keeps everyone from changing its
 * buffer (zero_grad, the next backward) while another member still reads it. */
static int shm_reduce(pg_context *ctx, const pg_shm *s, int64_t n, pg_reduce_op op, int everyone, pg_coll coll) {
  if (check_ctx(ctx) || check_shm(s, op) || comm_agree_coll(ctx, s->mode, coll, PG_FLOAT32, op, -1, n))
    return PG_ERR;
  double t0 = pg_wtime();
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  shm_reduce_block(s, n, op, everyone);
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  comm_count(ctx, s->mode, coll, (double)n * sizeof(float), t0);
  return PG_OK;
}

int pg_shm_all_reduce(pg_context *ctx, const pg_shm *s, int64_t n, pg_reduce_op op) {
  return shm_reduce(ctx, s, n, op, 1, PG_COLL_ALL_REDUCE);
}

int pg_shm_reduce_scatter(pg_context *ctx, const pg_shm *s, int64_t n, pg_reduce_op op) {
  return shm_reduce(ctx, s, n, op, 0, PG_COLL_REDUCE_SCATTER);
}

int pg_shm_all_gather(pg_context *ctx, const pg_shm *s, int64_t n) {
  if (check_ctx(ctx) || check_shm(s, PG_REDUCE_SUM) ||
      comm_agree_coll(ctx, s->mode, PG_COLL_ALL_GATHER, PG_FLOAT32, -1, -1, n))
    return PG_ERR;
  double t0 = pg_wtime();
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  float *mine = s->base[s->rank];
  for (int m = 0; m < s->size; m++) {
    if (m == s->rank) continue;
    int64_t lo = comm_block_start(n, s->size, m), len = comm_block_start(n, s->size, m + 1) - lo;
#pragma omp parallel for schedule(static) if (len > 32768)
    for (int64_t t = 0; t < len; t += 65536) {
      int64_t w = len - t < 65536 ? len - t : 65536;
      memcpy(mine + lo + t, s->base[m] + lo + t, (size_t)w * sizeof(float));
    }
  }
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  comm_count(ctx, s->mode, PG_COLL_ALL_GATHER, (double)n * sizeof(float), t0);
  return PG_OK;
}
