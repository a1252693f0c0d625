#include "comm_impl.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- all-to-all with variable counts ----
 *
 * The counts are the caller's (the receiver knows what comes, as in
 * MPI_Alltoallv): after the agreement step the members exchange their send
 * counts once (MPI_Alltoall of one int64 each) and compare them with the
 * receive counts; the first disagreement in member order, gathered to all,
 * is the same error everywhere, before any data moves. */
static int check_exchange(pg_context *ctx, pg_mode m, const int64_t *send_counts, const int64_t *recv_counts,
                          int64_t *got) {
  pg_group *g = &ctx->group[m];
  int n = g->size;
  int64_t bad[4] = {0, 0, 0, 0}, st = 0, rt = 0; /* kind, peer (local), sent, expected */
  for (int j = 0; j < n && !bad[0]; j++) {
    if (send_counts[j] < 0 || recv_counts[j] < 0) {
      bad[0] = 2;
      bad[1] = j;
      bad[2] = send_counts[j] < 0 ? send_counts[j] : recv_counts[j];
    }
    st += send_counts[j] > 0 ? send_counts[j] : 0;
    rt += recv_counts[j] > 0 ? recv_counts[j] : 0;
    if (!bad[0] && (st > INT_MAX || rt > INT_MAX)) bad[0] = 3;
  }
  int rc = MPI_Alltoall(send_counts, 1, MPI_INT64_T, got, 1, MPI_INT64_T, g->comm);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "all_to_all", m);
  for (int i = 0; i < n && !bad[0]; i++)
    if (got[i] != recv_counts[i]) {
      bad[0] = 1;
      bad[1] = i;
      bad[2] = got[i];
      bad[3] = recv_counts[i];
    }
  int64_t *all = got + n; /* [n][4] */
  rc = MPI_Allgather(bad, 4, MPI_INT64_T, all, 4, MPI_INT64_T, g->comm);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "all_to_all", m);
  for (int r = 0; r < n; r++) {
    const int64_t *b = all + 4 * (size_t)r;
    char msg[512];
    if (b[0] == 1)
      snprintf(msg, sizeof msg, "all_to_all over the %s group: rank %d sends %lld values to rank %d, which expects %lld",
               pg_mode_name(m), comm_global_rank(g, (int)b[1]), (long long)b[2], comm_global_rank(g, r), (long long)b[3]);
    else if (b[0] == 2)
      snprintf(msg, sizeof msg, "all_to_all over the %s group: rank %d gave a negative count (%lld) for rank %d",
               pg_mode_name(m), comm_global_rank(g, r), (long long)b[2], comm_global_rank(g, (int)b[1]));
    else if (b[0] == 3)
      snprintf(msg, sizeof msg, "all_to_all over the %s group: rank %d sends or receives more than %d values in all",
               pg_mode_name(m), comm_global_rank(g, r), INT_MAX);
    else
      continue;
    return comm_disagree(ctx, msg);
  }
  return PG_OK;
}

int pg_all_to_all_v(pg_context *ctx, pg_mode m, const void *send, const int64_t *send_counts, void *recv,
                    const int64_t *recv_counts, pg_dtype dtype) {
  if (check_ctx(ctx)) return PG_ERR;
  if (mpi_type(dtype) == MPI_DATATYPE_NULL)
    return pg_fail("all_to_all supports float32, float64, int32 and int64, not %s", pg_dtype_name(dtype));
  pg_group *g = &ctx->group[m];
  int n = g->size;
  size_t es = pg_dtype_size(dtype);
  if (comm_agree_coll(ctx, m, PG_COLL_ALL_TO_ALL, dtype, -1, -1, 0)) return PG_ERR;
  if (n == 1) {
    if (send_counts[0] != recv_counts[0] || send_counts[0] < 0)
      return pg_fail("all_to_all over a group of one: sends %lld values to itself but expects %lld",
                     (long long)send_counts[0], (long long)recv_counts[0]);
    size_t bytes = (size_t)send_counts[0] * es;
    if (!bytes) return PG_OK;
    if (pg_backend_is_device_memory(recv) || pg_backend_is_device_memory(send))
      return pg_cuda_memcpy(recv, send, bytes, PG_CUDA_DEVICE_TO_DEVICE);
    memmove(recv, send, bytes);
    return PG_OK;
  }
  int64_t *got = malloc((size_t)n * 5 * sizeof *got);
  int *ints = malloc((size_t)n * 4 * sizeof *ints);
  if (!got || !ints) {
    free(got);
    free(ints);
    return pg_fail("out of memory for the counts of %d ranks", n);
  }
  int rc = check_exchange(ctx, m, send_counts, recv_counts, got);
  int64_t st = 0, rt = 0;
  for (int j = 0; j < n; j++) {
    st += send_counts[j];
    rt += recv_counts[j];
  }
  double t0 = pg_wtime();
#ifdef PG_WITH_CUDA
  ncclComm_t comm = rc ? NULL : comm_nccl_for(ctx, m, st ? send : recv);
  if (comm && (!st || pg_backend_is_device_memory(send)) && (!rt || pg_backend_is_device_memory(recv))) {
    /* NCCL has no alltoallv: grouped sends and receives, one pair per peer */
    ncclDataType_t t = comm_nccl_type(dtype);
    int64_t so = 0, ro = 0;
    ncclResult_t r = ncclGroupStart();
    for (int j = 0; j < n && r == ncclSuccess; j++) {
      if (send_counts[j])
        r = ncclSend((const char *)send + so * es, (size_t)send_counts[j], t, j, comm, NCCL_STREAM(ctx));
      if (r == ncclSuccess && recv_counts[j])
        r = ncclRecv((char *)recv + ro * es, (size_t)recv_counts[j], t, j, comm, NCCL_STREAM(ctx));
      so += send_counts[j];
      ro += recv_counts[j];
    }
    ncclResult_t r2 = ncclGroupEnd();
    free(got);
    free(ints);
    if (comm_nccl_done(r != ncclSuccess ? r : r2, "all_to_all", m)) return PG_ERR;
    comm_count(ctx, m, PG_COLL_ALL_TO_ALL, (double)st * es, t0);
    return PG_OK;
  }
#endif
  staged ss = {0}, rs = {0};
  void *sb = (void *)send;
  if (!rc) rc = comm_stage(ctx, m, &sb, (size_t)st * es, 1, &ss);
  if (!rc && comm_stage(ctx, m, &recv, (size_t)rt * es, 0, &rs)) rc = comm_unstage(&ss, PG_ERR, 0);
  if (rc) {
    free(got);
    free(ints);
    return PG_ERR;
  }
  int *sc = ints, *sd = ints + n, *rcnt = ints + 2 * n, *rd = ints + 3 * n;
  for (int j = 0, so = 0, ro = 0; j < n; j++) { /* check_exchange bounded the totals by INT_MAX */
    sc[j] = (int)send_counts[j];
    rcnt[j] = (int)recv_counts[j];
    sd[j] = so;
    rd[j] = ro;
    so += sc[j];
    ro += rcnt[j];
  }
  t0 = pg_wtime();
  int mrc = MPI_Alltoallv(sb, sc, sd, mpi_type(dtype), recv, rcnt, rd, mpi_type(dtype), g->comm);
  free(got);
  free(ints);
  comm_unstage(&ss, PG_OK, 0);
  if (mrc != MPI_SUCCESS) return comm_unstage(&rs, mpi_fail(mrc, "all_to_all", m), 0);
  comm_count(ctx, m, PG_COLL_ALL_TO_ALL, (double)st * es, t0);
  return comm_unstage(&rs, PG_OK, 1);
}
