#include "comm_impl.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct pg_request {
  MPI_Request mpi;
  pg_mode mode;       /* for messages */
  void *host;         /* a device buffer's host copy, in flight until the wait */
  void *sent, *after; /* an NCCL send: its completion event, and the stream that waits for it */
  pg_context *ctx;
  call_rec rec;        /* what is sent (and, under PG_DEBUG=1, shipped ahead for the receiver to check) */
  MPI_Request rec_req; /* that record's send, or MPI_REQUEST_NULL */
  /* a bucket's reduction (pg_iall_reduce_buf, pg_ireduce_scatter_buf): what completion does */
  int coll;            /* 1 for those */
  float *buf;          /* the bucket */
  int64_t piece, displ; /* this member's reduced elements and where they go in buf */
  int avg_over;        /* avg: the group size the sum is divided by; 0: sum */
  int *counts;         /* reduce_scatter: every member's count (MPI reads it until completion) */
  int recv;            /* pg_irecv_buf's: the wait names the sender that never sent */
  staged in;           /* pg_irecv_buf into device memory: the host copy MPI fills, copied over at the wait */
};

/* A pipeline transfer's deadline, or 0 for none; PG_ERR when PG_COLLECTIVE_TIMEOUT is not a number. */
static int deadline_of(double *deadline, double *limit) {
  if (comm_timeout_ok(limit)) return PG_ERR;
  *deadline = *limit > 0 ? pg_wtime() + *limit : 0;
  return PG_OK;
}

/* The record a receive of n floats from src with tag is checked by under PG_DEBUG=1 (against the sender's). */
static call_rec recv_record(pg_context *ctx, pg_mode m, int src, int tag, int64_t n) {
  call_rec r = comm_make_rec(ctx, m, PG_COLL_RECV, -1, -1, 0);
  r.src = src;
  r.tag = tag;
  r.recv_dtype = PG_FLOAT32;
  r.recv_count = n;
  return r;
}

#ifdef PG_WITH_CUDA
/* Every device transfer queued off the engine's stream starts so: the side stream (a pipeline send's, the
 * context ring's, the data group's reduction stream) waits for what the engine's stream has queued so far (the
 * kernels that made the buffer: an event recorded there), and *done is made for the caller to record on the side
 * stream after its NCCL calls (pg_wait makes the engine's stream wait for it). The first event goes at once: a
 * stream's wait holds what it needs (CUDA releases an event a stream waits on when the wait is done). */
static cudaError_t side_stream_after_engine(pg_context *ctx, cudaStream_t side, cudaEvent_t *done) {
  cudaEvent_t made = NULL;
  *done = NULL;
  cudaError_t e = cudaEventCreateWithFlags(&made, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(made, NCCL_STREAM(ctx));
  if (e == cudaSuccess) e = cudaStreamWaitEvent(side, made, 0);
  if (made) cudaEventDestroy(made);
  return e;
}
#endif

int pg_isend_buf(pg_context *ctx, pg_mode m, const float *buf, int64_t n, int dst, int tag, pg_request **req) {
  if (check_ctx(ctx)) return PG_ERR;
  if (n > PG_MPI_CHUNK) return pg_fail("isend of %lld elements is too large", (long long)n);
  if (*req) return pg_fail("isend: the previous transfer of this request was not waited for");
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a send request");
  r->mode = m;
  r->ctx = ctx;
  r->rec = comm_make_rec(ctx, m, PG_COLL_SEND, PG_FLOAT32, -1, n);
  r->rec.dst = dst;
  r->rec.tag = tag;
  r->rec_req = MPI_REQUEST_NULL;
  if (comm_debug_checks() && ctx->group[m].size > 1) {
    int rc = MPI_Isend(&r->rec, (int)sizeof r->rec, MPI_BYTE, dst, PG_AGREE_TAG, ctx->group[m].agree, &r->rec_req);
    if (rc != MPI_SUCCESS) {
      free(r);
      return mpi_fail(rc, "isend", m);
    }
  }
#ifdef PG_WITH_CUDA
  /* To a pipeline neighbour, device to device: queued on the send stream once
   * the engine's stream has made the buffer; the wait makes the engine's
   * stream wait for the send, so the host never blocks. */
  int peer = 0;
  ncclComm_t link = m == PG_MODE_PIPELINE && n > 0 ? comm_pipeline_link(ctx, dst, 1, &peer) : NULL;
  if (link && pg_backend_is_device_memory(buf)) {
    cudaEvent_t sent = NULL;
    double t0 = pg_wtime();
    cudaError_t e = side_stream_after_engine(ctx, (cudaStream_t)ctx->comm->send_stream, &sent);
    ncclResult_t nr = e == cudaSuccess ? ncclSend(buf, (size_t)n, ncclFloat32, peer, link, ctx->comm->send_stream)
                                       : ncclSuccess;
    if (e == cudaSuccess && nr == ncclSuccess) e = cudaEventRecord(sent, (cudaStream_t)ctx->comm->send_stream);
    if (e != cudaSuccess || nr != ncclSuccess) {
      if (sent) cudaEventDestroy(sent);
      if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE);
      free(r);
      return e != cudaSuccess ? pg_fail("queueing a send over the pipeline group failed: %s", cudaGetErrorString(e))
                              : comm_nccl_done(nr, "send", m);
    }
    r->sent = sent;
    r->after = ctx->comm->device_stream;
    *req = r;
    comm_count_direct(ctx, m, PG_COLL_SEND, (double)n * 4, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (comm_stage(ctx, m, (void **)&buf, (size_t)n * sizeof(float), 1, &s)) {
    if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE);
    free(r);
    return PG_ERR;
  }
  r->host = s.host; /* NULL for host memory */
  double t0 = pg_wtime();
  int rc = MPI_Isend(buf, (int)n, MPI_FLOAT, dst, tag, ctx->group[m].comm, &r->mpi);
  if (rc != MPI_SUCCESS) {
    comm_host_give(r->host);
    if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE);
    free(r);
    return mpi_fail(rc, "isend", m);
  }
  *req = r;
  comm_count(ctx, m, PG_COLL_SEND, (double)n * 4, t0);
  return PG_OK;
}

static int check_shipped(pg_context *ctx, pg_mode m, const call_rec *mine, double deadline, double limit);

/* The receiving half of a ring exchange (context parallelism's keys and values): MPI_Irecv, counted at the start
 * as pg_isend_buf counts its send; pg_wait completes it with the pipeline's deadline. Device memory is staged:
 * MPI fills a host copy, which the wait copies over (comm_unstage). */
int pg_irecv_buf(pg_context *ctx, pg_mode m, float *buf, int64_t n, int src, int tag, pg_request **req) {
  if (check_ctx(ctx)) return PG_ERR;
  if (n > PG_MPI_CHUNK) return pg_fail("irecv of %lld elements is too large", (long long)n);
  if (*req) return pg_fail("irecv: the previous transfer of this request was not waited for");
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a receive request");
  if (comm_stage(ctx, m, (void **)&buf, (size_t)n * sizeof(float), 0, &r->in)) {
    free(r);
    return PG_ERR;
  }
  r->mode = m;
  r->ctx = ctx;
  r->recv = 1;
  r->rec = recv_record(ctx, m, src, tag, n);
  r->rec_req = MPI_REQUEST_NULL;
  /* PG_DEBUG=1: the sender's record (shipped at its isend, which a ring starts before its receive) checked
   * against this receive first, as pg_recv_buf does */
  double deadline, limit;
  if (comm_debug_checks() && ctx->group[m].size > 1 &&
      (deadline_of(&deadline, &limit) || check_shipped(ctx, m, &r->rec, deadline, limit))) {
    comm_unstage(&r->in, PG_ERR, 0);
    free(r);
    return PG_ERR;
  }
  double t0 = pg_wtime();
  int rc = MPI_Irecv(buf, (int)n, MPI_FLOAT, src, tag, ctx->group[m].comm, &r->mpi);
  if (rc != MPI_SUCCESS) {
    comm_unstage(&r->in, PG_ERR, 0);
    free(r);
    return mpi_fail(rc, "irecv", m);
  }
  *req = r;
  comm_count(ctx, m, PG_COLL_RECV, (double)n * 4, t0);
  return PG_OK;
}

#ifdef PG_WITH_CUDA
/* The ring's step over NCCL: the context group's stream waits for what the engine's stream has queued (the block
 * made, the receiving buffer's last reader done), then sends and receives in one group (each rank sends to the
 * next and receives from the previous: apart, the sends would wait for receives queued behind them); the
 * request's event is what pg_wait makes the engine's stream wait for. */
static int exchange_nccl(pg_context *ctx, const float *send, float *recv, int64_t n, int dst, int src, int tag,
                         pg_request **req) {
  pg_mode m = PG_MODE_CONTEXT;
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a ring exchange's request");
  r->mpi = r->rec_req = MPI_REQUEST_NULL;
  /* PG_DEBUG=1: the send's record shipped to the next rank, the previous rank's checked against the receive, as
   * the staged pg_isend_buf / pg_irecv_buf do */
  if (comm_debug_checks()) {
    r->rec = comm_make_rec(ctx, m, PG_COLL_SEND, PG_FLOAT32, -1, n);
    r->rec.dst = dst;
    r->rec.tag = tag;
    call_rec mine = recv_record(ctx, m, src, tag, n);
    double deadline, limit;
    int rc = MPI_Isend(&r->rec, (int)sizeof r->rec, MPI_BYTE, dst, PG_AGREE_TAG, ctx->group[m].agree, &r->rec_req);
    if (rc != MPI_SUCCESS) {
      free(r);
      return mpi_fail(rc, "isend", m);
    }
    if (deadline_of(&deadline, &limit) || check_shipped(ctx, m, &mine, deadline, limit))
      return PG_ERR; /* r stays allocated: the record's send may still read it (the context is broken) */
  }
  cudaStream_t rs = (cudaStream_t)ctx->comm->ring_stream;
  ncclComm_t c = (ncclComm_t)ctx->comm->nccl_ring;
  cudaEvent_t done = NULL;
  double t0 = pg_wtime();
  cudaError_t e = side_stream_after_engine(ctx, rs, &done);
  ncclResult_t nr = ncclSuccess;
  if (e == cudaSuccess && (nr = ncclGroupStart()) == ncclSuccess) {
    ncclResult_t a = ncclSend(send, (size_t)n, ncclFloat32, dst, c, rs);
    ncclResult_t b = a == ncclSuccess ? ncclRecv(recv, (size_t)n, ncclFloat32, src, c, rs) : ncclSuccess;
    ncclResult_t end = ncclGroupEnd(); /* always: the group must be closed */
    nr = a != ncclSuccess ? a : b != ncclSuccess ? b : end;
  }
  if (e == cudaSuccess && nr == ncclSuccess) e = cudaEventRecord(done, rs);
  if (e != cudaSuccess || nr != ncclSuccess) {
    if (done) cudaEventDestroy(done);
    if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE);
    free(r);
    return e != cudaSuccess ? pg_fail("queueing a ring exchange over the context group failed: %s",
                                      cudaGetErrorString(e))
                            : comm_nccl_done(nr, "the ring's send/recv", m);
  }
  r->mode = m;
  r->ctx = ctx;
  r->sent = done;
  r->after = ctx->comm->device_stream;
  *req = r;
  comm_count_direct(ctx, m, PG_COLL_SEND, (double)n * 4, t0);
  comm_count_direct(ctx, m, PG_COLL_RECV, (double)n * 4, t0);
  return PG_OK;
}
#endif

int pg_iexchange_buf(pg_context *ctx, pg_mode m, const float *send, float *recv, int64_t n, int dst, int src,
                     int tag, pg_request **send_req, pg_request **recv_req) {
  if (check_ctx(ctx)) return PG_ERR;
  if (*send_req || *recv_req) return pg_fail("exchange: the previous transfer of this request was not waited for");
#ifdef PG_WITH_CUDA
  if (m == PG_MODE_CONTEXT && ctx->comm->nccl_ring && n > 0 && pg_backend_is_device_memory(send) &&
      pg_backend_is_device_memory(recv)) {
    if (n > PG_MPI_CHUNK) return pg_fail("exchange of %lld elements is too large", (long long)n);
    return exchange_nccl(ctx, send, recv, n, dst, src, tag, recv_req);
  }
#endif
  /* the send first: under PG_DEBUG=1 a receive waits for its sender's record, shipped at the send */
  return pg_isend_buf(ctx, m, send, n, dst, tag, send_req) || pg_irecv_buf(ctx, m, recv, n, src, tag, recv_req);
}

static void finish_coll(pg_request *r);

int pg_wait(pg_request **req) {
  pg_request *r = *req;
  if (!r) return PG_OK;
  *req = NULL;
#ifdef PG_WITH_CUDA
  if (r->sent) {
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)r->after, (cudaEvent_t)r->sent, 0);
    cudaEventDestroy((cudaEvent_t)r->sent);
    pg_mode m = r->mode;
    if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE); /* a small eager send */
    free(r);
    return e == cudaSuccess ? PG_OK
                            : pg_fail("waiting for a send over the %s group failed: %s", pg_mode_name(m),
                                      cudaGetErrorString(e));
  }
#endif
  /* polled with the deadline: a send the receiver never takes (rendezvous
   * sizes) would otherwise block here for ever */
  pg_mode m = r->mode;
  if (r->coll) { /* a bucket's reduction: a member that never started it is named by the deadline */
    MPI_Request one = r->mpi;
    int idx1;
    double deadline, limit;
    if (deadline_of(&deadline, &limit)) return PG_ERR;
    int late = one == MPI_REQUEST_NULL ? 0 : comm_poll_all(1, &one, &idx1, NULL, deadline, "a bucket's reduction", m);
    if (late < 0) return PG_ERR;
    if (late) { /* r stays allocated: MPI may still write the bucket */
      char what[256], msg[512];
      comm_describe(&r->ctx->group[m], &r->rec, what, sizeof what);
      snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but a member never joined",
               what, pg_mode_name(m), limit);
      if (!r->ctx->comm->broken) r->ctx->comm->broken = strdup(msg);
      return pg_fail("%s", msg);
    }
    finish_coll(r);
    return PG_OK;
  }
  MPI_Request two[2] = {r->mpi, r->rec_req};
  int idx[2];
  double deadline, limit;
  if (deadline_of(&deadline, &limit)) return PG_ERR;
  int late = comm_poll_all(2, two, idx, NULL, deadline, "waiting for a send", m);
  if (late < 0) return PG_ERR;
  if (late) { /* r, its record and a staged copy stay allocated: MPI may still read them */
    char what[256], msg[512], who[PG_HOST_MAX + 16];
    const pg_group *g = &r->ctx->group[m];
    comm_describe(g, &r->rec, what, sizeof what);
    if (r->recv) {
      comm_rank_name(g, r->rec.src, who, sizeof who);
      snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but rank %s never sent it",
               what, pg_mode_name(m), limit, who);
    } else {
      comm_rank_name(g, r->rec.dst, who, sizeof who);
      snprintf(msg, sizeof msg,
               "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but rank %s never received it", what,
               pg_mode_name(m), limit, who);
    }
    return comm_give_up(r->ctx, 2, two, msg);
  }
  comm_host_give(r->host);
  int rc = comm_unstage(&r->in, PG_OK, 1); /* a staged receive: its bytes to the device */
  free(r);
  return rc;
}

/* ---- a bucket's reduction in flight ----
 *
 * The engine's overlapped gradient reduction (pg_engine.c) starts one of
 * these per bucket while backward goes on. The members agreed once, for the
 * whole set, with pg_agree_batch; the buckets then start in the same order on
 * every member (the order their gradients become final, which the same
 * modules give everywhere), as MPI requires of nonblocking collectives.
 * MPI_IN_PLACE for reduce_scatter leaves this member's piece at the start of
 * the bucket: completion moves it to its place and, for avg, scales it as
 * the ring does (the sum times 1 / size: with two members the same bits). */

int pg_agree_batch(pg_context *ctx, pg_mode m, pg_coll kind, pg_reduce_op op, int64_t count, const char *what) {
  if (check_ctx(ctx)) return PG_ERR;
  pg_comm_call_site(ctx, what);
  return comm_agree_coll(ctx, m, kind, PG_FLOAT32, op, -1, count);
}

#ifdef PG_WITH_CUDA
/* Whether a collective of buf over group m runs on the data group's
 * reduction stream: device memory, NCCL (one GPU per rank), more than one
 * member. */
static int on_reduce_stream(pg_context *ctx, pg_mode m, const void *buf) {
  return ctx->group[m].size > 1 && m == PG_MODE_DATA && ctx->comm->reduce_stream && comm_nccl_for(ctx, m, buf);
}

/* Device memory: the NCCL collective (kind: all-reduce of buf[0, n); reduce-
 * scatter or all-gather of the pieces `counts`, comm_nccl_reduce_v /
 * _all_gather_v) on the reduction stream, after what the engine's stream has
 * queued so far (the bucket's last gradient kernel, the copy of this
 * member's piece of a gather: an event recorded there, waited for by the
 * reduction stream); the wait makes the engine's stream wait for the
 * collective's event, so the kernels queued after it come after the
 * collective and the host never blocks. Each request has its own event:
 * the engine's stream waits for exactly the bucket or unit it needs. */
static int start_device(pg_context *ctx, pg_mode m, void *buf, int64_t n, const int64_t *counts, pg_coll kind,
                        pg_dtype dtype, pg_reduce_op op, pg_request **req) {
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a collective request");
  cudaStream_t rs = (cudaStream_t)ctx->comm->reduce_stream;
  ncclComm_t comm = (ncclComm_t)ctx->comm->nccl[m];
  int size = ctx->group[m].size;
  cudaEvent_t done = NULL;
  double t0 = pg_wtime();
  cudaError_t e = side_stream_after_engine(ctx, rs, &done);
  ncclResult_t nr = ncclSuccess;
  if (e == cudaSuccess)
    nr = kind == PG_COLL_ALL_REDUCE ? ncclAllReduce(buf, buf, (size_t)n, ncclFloat32, comm_nccl_op(op), comm, rs)
         : kind == PG_COLL_REDUCE_SCATTER ? comm_nccl_reduce_v(buf, counts, size, comm_nccl_op(op), comm, rs)
                                          : comm_nccl_all_gather_v(buf, counts, size, comm_nccl_type(dtype), comm, rs);
  if (e == cudaSuccess && nr == ncclSuccess) e = cudaEventRecord(done, rs);
  const char *what = pg_coll_name(kind);
  if (e != cudaSuccess || nr != ncclSuccess) {
    if (done) cudaEventDestroy(done);
    free(r);
    return e != cudaSuccess ? pg_fail("queueing a bucket's or gather's %s failed: %s", what, cudaGetErrorString(e))
                            : comm_nccl_done(nr, what, m);
  }
  r->mode = m;
  r->ctx = ctx;
  r->mpi = r->rec_req = MPI_REQUEST_NULL;
  r->sent = done;
  r->after = ctx->comm->device_stream;
  *req = r;
  comm_count(ctx, m, kind, (double)n * (double)pg_dtype_size(dtype), t0);
  return PG_OK;
}
#endif

static int start_coll(pg_context *ctx, pg_mode m, float *buf, int64_t n, pg_reduce_op op, const int64_t *counts,
                      pg_request **req) {
  if (check_ctx(ctx)) return PG_ERR;
  if (*req) return pg_fail("a bucket's reduction was started twice without a wait");
  if (op != PG_REDUCE_SUM && op != PG_REDUCE_AVG) return pg_fail("bucket reductions are sum or avg");
  if (n > PG_MPI_CHUNK) return pg_fail("a bucket of %lld elements is too large (at most 2^30)", (long long)n);
  pg_group *g = &ctx->group[m];
#ifdef PG_WITH_CUDA
  if (n > 0 && on_reduce_stream(ctx, m, buf))
    return start_device(ctx, m, buf, n, counts, counts ? PG_COLL_REDUCE_SCATTER : PG_COLL_ALL_REDUCE, PG_FLOAT32, op,
                        req);
#endif
  if (pg_backend_is_device_memory(buf))
    return pg_fail("bucket reductions take host memory, or device memory reduced over the data group's NCCL");
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a reduction request");
  r->mode = m;
  r->ctx = ctx;
  r->coll = 1;
  r->buf = buf;
  r->mpi = MPI_REQUEST_NULL;
  r->rec_req = MPI_REQUEST_NULL;
  r->rec = comm_make_rec(ctx, m, counts ? PG_COLL_REDUCE_SCATTER : PG_COLL_ALL_REDUCE, PG_FLOAT32, op, n);
  r->avg_over = op == PG_REDUCE_AVG ? g->size : 0;
  r->piece = n;
  double t0 = pg_wtime();
  int rc = MPI_SUCCESS;
  if (counts) {
    if (!(r->counts = malloc((size_t)g->size * sizeof *r->counts))) {
      free(r);
      return pg_fail("out of memory for a reduction request");
    }
    for (int i = 0; i < g->size; i++) {
      r->counts[i] = (int)counts[i]; /* each at most n <= 2^30 */
      if (i < g->rank) r->displ += counts[i];
    }
    r->piece = counts[g->rank];
    if (g->size > 1) rc = MPI_Ireduce_scatter(MPI_IN_PLACE, buf, r->counts, MPI_FLOAT, MPI_SUM, g->comm, &r->mpi);
  } else if (g->size > 1) {
    rc = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, g->comm, &r->mpi);
  }
  if (rc != MPI_SUCCESS) {
    free(r->counts);
    free(r);
    return mpi_fail(rc, counts ? "reduce_scatter" : "all_reduce", m);
  }
  *req = r;
  comm_count(ctx, m, counts ? PG_COLL_REDUCE_SCATTER : PG_COLL_ALL_REDUCE, (double)n * sizeof(float), t0);
  return PG_OK;
}

int pg_iall_reduce_buf(pg_context *ctx, pg_mode m, float *buf, int64_t n, pg_reduce_op op, pg_request **req) {
  return start_coll(ctx, m, buf, n, op, NULL, req);
}

int pg_ireduce_scatter_buf(pg_context *ctx, pg_mode m, float *buf, const int64_t *counts, pg_reduce_op op,
                           pg_request **req) {
  int64_t n = 0;
  for (int i = 0; i < ctx->group[m].size; i++) {
    if (counts[i] < 0 || counts[i] > PG_MPI_CHUNK) return pg_fail("reduce_scatter: bad count %lld", (long long)counts[i]);
    n += counts[i];
  }
  return start_coll(ctx, m, buf, n, op, counts, req);
}

/* ZeRO-3's parameter gathers: buf holds the members' pieces one after
 * another (counts[i] elements for member i, this member's already in its
 * place), and completion leaves every piece in every member's buf. Started
 * like the buckets' reductions: the members agreed for the set with
 * pg_agree_batch, and start them in the same order. Host memory only. */
int pg_iall_gather_v_buf(pg_context *ctx, pg_mode m, void *buf, const int64_t *counts, pg_dtype dtype,
                         pg_request **req) {
  if (check_ctx(ctx)) return PG_ERR;
  if (mpi_type(dtype) == MPI_DATATYPE_NULL) return pg_fail("a parameter gather of an unknown element type");
  if (*req) return pg_fail("a parameter gather was started twice without a wait");
  pg_group *g = &ctx->group[m];
  int64_t n = 0;
  for (int i = 0; i < g->size; i++) {
    if (counts[i] < 0 || counts[i] > PG_MPI_CHUNK) return pg_fail("all_gather_v: bad count %lld", (long long)counts[i]);
    n += counts[i];
  }
  if (n > PG_MPI_CHUNK) return pg_fail("a parameter gather of %lld elements is too large (at most 2^30)", (long long)n);
#ifdef PG_WITH_CUDA
  if (n > 0 && on_reduce_stream(ctx, m, buf)) return start_device(ctx, m, buf, n, counts, PG_COLL_ALL_GATHER, dtype, PG_REDUCE_SUM, req);
#endif
  if (pg_backend_is_device_memory(buf))
    return pg_fail("parameter gathers take host memory, or device memory gathered over the data group's NCCL");
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a gather request");
  r->mode = m;
  r->ctx = ctx;
  r->coll = 1;
  r->buf = buf; /* the float32 view is not read: an all-gather has no piece to move nor average */
  r->mpi = MPI_REQUEST_NULL;
  r->rec_req = MPI_REQUEST_NULL;
  r->rec = comm_make_rec(ctx, m, PG_COLL_ALL_GATHER, dtype, -1, n);
  int rc = MPI_SUCCESS;
  double t0 = pg_wtime();
  if (g->size > 1) {
    if (!(r->counts = malloc(2 * (size_t)g->size * sizeof *r->counts))) {
      free(r);
      return pg_fail("out of memory for a gather request");
    }
    int *displs = r->counts + g->size; /* both read by MPI until completion */
    for (int i = 0, at = 0; i < g->size; i++) {
      r->counts[i] = (int)counts[i];
      displs[i] = at;
      at += (int)counts[i]; /* the total is at most 2^30 */
    }
    rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, r->counts, displs, mpi_type(dtype), g->comm,
                        &r->mpi);
  }
  if (rc != MPI_SUCCESS) {
    free(r->counts);
    free(r);
    return mpi_fail(rc, "all_gather", m);
  }
  *req = r;
  comm_count(ctx, m, PG_COLL_ALL_GATHER, (double)n * (double)pg_dtype_size(dtype), t0); /* the whole buffer, as the others count */
  return PG_OK;
}

/* The reduced piece to its place, scaled; the request freed. */
static void finish_coll(pg_request *r) {
  if (r->displ && r->piece) memmove(r->buf + r->displ, r->buf, (size_t)r->piece * sizeof(float));
  if (r->avg_over > 1) comm_scale_avg(r->buf + r->displ, r->piece, r->avg_over);
  free(r->counts);
  free(r);
}

int pg_test(pg_request **req, int *done) {
  pg_request *r = *req;
  *done = 1;
  if (!r) return PG_OK;
  if (r->sent) { /* a device reduction: the GPU completes it; the wait orders the engine's stream after it */
    *done = 0;
    return PG_OK;
  }
  if (!r->coll) return pg_fail("pg_test takes a bucket's reduction, not a send");
  int flag = 1;
  if (r->mpi != MPI_REQUEST_NULL) {
    int rc = MPI_Test(&r->mpi, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "testing a bucket's reduction", r->mode);
  }
  *done = flag;
  if (flag) {
    *req = NULL;
    finish_coll(r);
  }
  return PG_OK;
}

/* Under PG_DEBUG=1: the sender's record, shipped ahead of the data by
 * pg_isend_buf, must describe the transfer this receive expects. */
static int check_shipped(pg_context *ctx, pg_mode m, const call_rec *mine, double deadline, double limit) {
  pg_group *g = &ctx->group[m];
  call_rec *recs = NULL;
  MPI_Request *reqs = NULL;
  int *idx = NULL;
  if (comm_scratch(ctx, 1, &recs, &reqs, &idx)) return PG_ERR;
  int rc = MPI_Irecv(recs, (int)sizeof *recs, MPI_BYTE, mine->src, PG_AGREE_TAG, g->agree, reqs);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "recv", m);
  int late = comm_poll_all(1, reqs, idx, NULL, deadline, "recv", m);
  if (late < 0) return PG_ERR;
  if (late) {
    char what[256], msg[512], who[PG_HOST_MAX + 16];
    comm_describe(g, mine, what, sizeof what);
    comm_rank_name(g, mine->src, who, sizeof who);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but rank %s never sent it",
             what, pg_mode_name(m), limit, who);
    return comm_give_up(ctx, 1, reqs, msg);
  }
  return comm_pair_matches(recs, mine) ? PG_OK : comm_pair_message(ctx, g, m, recs, mine);
}

int pg_recv_buf(pg_context *ctx, pg_mode m, float *buf, int64_t n, int src, int tag) {
  if (check_ctx(ctx)) return PG_ERR;
  if (n > PG_MPI_CHUNK) return pg_fail("recv of %lld elements is too large", (long long)n);
  call_rec mine = recv_record(ctx, m, src, tag, n);
  double deadline, limit;
  if (deadline_of(&deadline, &limit)) return PG_ERR;
  if (comm_debug_checks() && ctx->group[m].size > 1 && check_shipped(ctx, m, &mine, deadline, limit)) return PG_ERR;
#ifdef PG_WITH_CUDA
  /* from a pipeline neighbour into device memory: queued on the engine's stream */
  int peer = 0;
  ncclComm_t link = m == PG_MODE_PIPELINE && n > 0 ? comm_pipeline_link(ctx, src, 0, &peer) : NULL;
  if (link && pg_backend_is_device_memory(buf)) {
    double t0 = pg_wtime();
    if (comm_nccl_done(ncclRecv(buf, (size_t)n, ncclFloat32, peer, link, NCCL_STREAM(ctx)), "recv", m)) return PG_ERR;
    comm_count_direct(ctx, m, PG_COLL_RECV, (double)n * 4, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (comm_stage(ctx, m, (void **)&buf, (size_t)n * sizeof(float), 0, &s)) return PG_ERR;
  double t0 = pg_wtime();
  /* polled with the deadline: the sender may never come */
  MPI_Request q = MPI_REQUEST_NULL;
  int idx[1];
  int rc = MPI_Irecv(buf, (int)n, MPI_FLOAT, src, tag, ctx->group[m].comm, &q);
  if (rc != MPI_SUCCESS) return comm_unstage(&s, mpi_fail(rc, "recv", m), 0);
  int late = comm_poll_all(1, &q, idx, NULL, deadline, "recv", m);
  if (late < 0) return comm_unstage(&s, PG_ERR, 0);
  if (late) { /* a staged host buffer stays allocated: MPI may still write into it */
    char what[256], msg[512], who[PG_HOST_MAX + 16];
    comm_describe(&ctx->group[m], &mine, what, sizeof what);
    comm_rank_name(&ctx->group[m], src, who, sizeof who);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but rank %s never sent it",
             what, pg_mode_name(m), limit, who);
    return comm_give_up(ctx, 1, &q, msg);
  }
  comm_count(ctx, m, PG_COLL_RECV, (double)n * 4, t0);
  return comm_unstage(&s, PG_OK, 1);
}
