#include "pg_comm.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h" /* pg_bf16_round / pg_bf16_value: the ring's bf16 sums */
#include "pg_clock.h"
#include "pg_cuda.h"
#include "pg_error.h"
#include "pg_size.h"

#ifdef PG_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

/* MPI counts are int: larger buffers go in chunks of this many elements. */
#define PG_MPI_CHUNK ((int64_t)1 << 30)

int pg_reduce_op_from_name(const char *name, pg_reduce_op *out) {
  if (!strcmp(name, "sum")) *out = PG_REDUCE_SUM;
  else if (!strcmp(name, "max")) *out = PG_REDUCE_MAX;
  else if (!strcmp(name, "min")) *out = PG_REDUCE_MIN;
  else if (!strcmp(name, "avg")) *out = PG_REDUCE_AVG;
  else return pg_fail("unknown reduce op '%s' (expected sum, max, min or avg)", name);
  return PG_OK;
}

static MPI_Datatype mpi_type(pg_dtype d) {
  switch (d) {
  case PG_FLOAT32: return MPI_FLOAT;
  case PG_INT32: return MPI_INT32_T;
  case PG_FLOAT64: return MPI_DOUBLE;
  case PG_INT64: return MPI_INT64_T;
  case PG_BFLOAT16: return MPI_UINT16_T; /* moved as bits; summed only by the ring (fold_bf16) */
  default: return MPI_DATATYPE_NULL;
  }
}

static MPI_Op mpi_op(pg_reduce_op op) {
  switch (op) {
  case PG_REDUCE_MAX: return MPI_MAX;
  case PG_REDUCE_MIN: return MPI_MIN;
  default: return MPI_SUM;
  }
}

static int mpi_fail(int rc, const char *what, pg_mode m) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return pg_fail("%s over the %s group failed: %s", what, pg_mode_name(m), msg);
}

static int check_ctx(pg_context *ctx) {
  if (!ctx || ctx->destroyed) return pg_fail("the parallel context was destroyed");
  if (ctx->broken) return pg_fail("the parallel context failed earlier and cannot be used: %s", ctx->broken);
  return PG_OK;
}

/* ---- agreement and the watchdog ----
 *
 * Before a call on a group of more than one rank moves data, the members it
 * involves exchange call records over the group's agreement communicator
 * (point to point, one FIFO per pair of members) and wait for them with a
 * deadline, PG_COLLECTIVE_TIMEOUT seconds (default 600; 0: no limit):
 *   - a record that differs from this member's is an error naming both
 *     sides: every member of a collective receives every record, so all of
 *     them print the same message (ranks calling all_reduce with different
 *     counts hung; float32 against int32, or sum against max, returned
 *     different values on each rank);
 *   - records that do not come in time name the ranks that never arrived
 *     (a rank that skipped a collective, a recv with no matching send).
 * Once every record is in, each member is committed to the same call, so the
 * blocking MPI call that follows cannot wait for a partner that is absent or
 * doing something else: the data calls stay the fast blocking ones. (Polling
 * nonblocking collectives instead was measured at 2.5x MPI_Allreduce for one
 * value and 1.5x at 64 KiB on two ranks; the exchange costs about one small
 * MPI_Allreduce.) A record says what (kind, dtype, reduction, count, root or
 * peers and tag) and where (the Lua call site pg.dist's bindings give; "" for
 * the runtime's own calls). Records pair up in call order (one FIFO per pair
 * of members and group), so a rank that skipped a call meets the others'
 * next call: a different one, or the same from the same line, which goes
 * unnoticed until the last call waits for a partner that never comes (the
 * timeout). Send and recv exchange both ways: a send waits until
 * its receiver has posted the recv (an MPI synchronous send). The pipeline's
 * sends (pg_isend_buf) must not wait (1F1B's warm-up sends ahead): its
 * receives and waits poll with the same deadline, and under PG_DEBUG=1 a
 * send ships its record ahead of the data for the receiver to check.
 * A call that timed out or disagreed marks the context broken (records or
 * data may be left in flight); pglua then ends the job. */

#define PG_AGREE_TAG 32767 /* the records' tag on the agreement communicators (MPI guarantees tags up to it) */
#define PG_KIND_SENDRECV PG_NUM_COLLS

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

/* PG_COLLECTIVE_TIMEOUT in seconds, read once: 600 when unset, 0 = no limit.
 * Anything else than a number of seconds is an error at the first call. */
static double collective_timeout(int *bad) {
  static double limit = -1;
  static int invalid;
  if (limit < 0) {
    const char *s = getenv("PG_COLLECTIVE_TIMEOUT");
    char *end = NULL;
    limit = 600;
    if (s && *s) {
      double v = strtod(s, &end);
      if (*end || !(v >= 0) || v > 1e9) invalid = 1;
      else limit = v;
    }
  }
  *bad = invalid;
  return limit;
}

static int timeout_ok(double *limit) {
  int bad = 0;
  *limit = collective_timeout(&bad);
  if (bad)
    return pg_fail("PG_COLLECTIVE_TIMEOUT=%s is not a number of seconds (0: no limit)",
                   getenv("PG_COLLECTIVE_TIMEOUT"));
  return PG_OK;
}

/* PG_DEBUG=1: the pipeline's transfers are checked too (records ahead of the data). */
static int debug_checks(void) {
  static int on = -1;
  if (on < 0) {
    const char *s = getenv("PG_DEBUG");
    on = s && *s && strcmp(s, "0") != 0;
  }
  return on;
}

/* Sites are copied by hand: snprintf was a tenth of a small all_reduce's time. */
static void copy_site(char *dst, const char *src) {
  size_t n = src ? strnlen(src, PG_SITE_MAX - 1) : 0;
  memcpy(dst, src ? src : "", n);
  dst[n] = 0;
}

void pg_comm_call_site(pg_context *ctx, const char *site) {
  if (ctx) copy_site(ctx->site, site);
}

static const char *kind_name(int kind) { return kind == PG_KIND_SENDRECV ? "sendrecv" : pg_coll_name((pg_coll)kind); }

static int global_rank(const pg_group *g, int local) { return local >= 0 && local < g->size ? g->ranks[local] : local; }

/* "all_reduce of 12 float32 values (op sum, spec.lua:10)": a record in words, peers as global ranks. */
static void describe(const pg_group *g, const call_rec *c, char *buf, size_t n) {
  static const char *ops[] = {"sum", "max", "min", "avg"};
  const char *dt = c->dtype >= 0 ? pg_dtype_name((pg_dtype)c->dtype) : "?";
  int k = 0;
  switch (c->kind) {
  case PG_COLL_ALL_REDUCE:
  case PG_COLL_REDUCE_SCATTER:
  case PG_COLL_ALL_GATHER:
    k = snprintf(buf, n, "%s of %lld %s values%s", kind_name(c->kind), (long long)c->count, dt,
                 c->kind == PG_COLL_ALL_GATHER ? " per rank" : "");
    break;
  case PG_COLL_BROADCAST:
    k = snprintf(buf, n, "broadcast of %lld %s values from rank %d", (long long)c->count, dt, global_rank(g, c->root));
    break;
  case PG_COLL_BARRIER: k = snprintf(buf, n, "barrier"); break;
  case PG_COLL_ALL_TO_ALL: k = snprintf(buf, n, "all_to_all of %s values", dt); break;
  case PG_COLL_SEND:
    k = snprintf(buf, n, "send of %lld %s values to rank %d", (long long)c->count, dt, global_rank(g, c->dst));
    break;
  case PG_COLL_RECV:
    k = snprintf(buf, n, "recv of %lld %s values from rank %d", (long long)c->recv_count,
                 c->recv_dtype >= 0 ? pg_dtype_name((pg_dtype)c->recv_dtype) : "?", global_rank(g, c->src));
    break;
  case PG_KIND_SENDRECV:
    k = snprintf(buf, n, "sendrecv of %lld %s values to rank %d and %lld %s values from rank %d", (long long)c->count,
                 dt, global_rank(g, c->dst), (long long)c->recv_count,
                 c->recv_dtype >= 0 ? pg_dtype_name((pg_dtype)c->recv_dtype) : "?", global_rank(g, c->src));
    break;
  default: k = snprintf(buf, n, "an unknown call (%d)", c->kind);
  }
  if (k < 0 || (size_t)k >= n) return;
  char extra[200] = "";
  size_t e = 0;
  if (c->op >= 0 && c->op < 4) e += (size_t)snprintf(extra + e, sizeof extra - e, "op %s, ", ops[c->op]);
  if (c->dst >= 0 || c->src >= 0) e += (size_t)snprintf(extra + e, sizeof extra - e, "tag %d, ", c->tag);
  for (int i = 0; i < c->ndim && i < PG_MAX_DIMS && e < sizeof extra; i++)
    e += (size_t)snprintf(extra + e, sizeof extra - e, i ? ", %lld" : "[%lld", (long long)c->shape[i]);
  if (c->ndim > 0 && e < sizeof extra)
    e += (size_t)snprintf(extra + e, sizeof extra - e, "] along dimension %d, ", c->dim + 1);
  snprintf(extra + e, sizeof extra - e, "%s", c->site[0] ? c->site : "in the runtime");
  snprintf(buf + k, n - (size_t)k, " (%s)", extra);
}

/* The group's current call, as the records name it ("all_reduce over the data group"). */
static call_rec make_rec(pg_context *ctx, pg_mode m, int kind, int dtype, int op, int64_t count) {
  call_rec c;
  memset(&c, 0, sizeof c);
  c.kind = kind;
  c.dtype = (int32_t)dtype;
  c.op = op;
  c.root = c.dst = c.src = c.recv_dtype = -1;
  c.me = ctx->group[m].rank;
  c.count = count;
  copy_site(c.site, ctx->site);
  ctx->site[0] = 0; /* a site names one call */
  return c;
}

/* Scratch for n records, 2n requests and 3n ints (indices for MPI_Testsome,
 * then the member of each receive), kept on the context: a call that timed
 * out leaves sends and receives from it in flight, and the context, broken
 * then, never frees it. */
static int scratch(pg_context *ctx, int n, call_rec **recs, MPI_Request **reqs, int **idx) {
  size_t need = (size_t)n * (sizeof **recs + 2 * sizeof **reqs + 3 * sizeof **idx);
  if (need > ctx->agree_scratch_bytes) {
    void *p = realloc(ctx->agree_scratch, need);
    if (!p) return pg_fail("out of memory for the records of %d ranks", n);
    ctx->agree_scratch = p;
    ctx->agree_scratch_bytes = need;
  }
  *recs = ctx->agree_scratch;
  *reqs = (MPI_Request *)(*recs + n);
  *idx = (int *)(*reqs + 2 * n);
  return PG_OK;
}

/* Polls the n requests until all are done (0), the deadline passes (1; the
 * ones still pending are left so: the caller names them), or MPI fails
 * (PG_ERR). deadline <= 0: none. */
static int poll_all(int n, MPI_Request *reqs, int *idx, MPI_Status *st, double deadline, const char *what, pg_mode m) {
  for (unsigned spins = 1;; spins++) {
    int out = 0;
    int rc = MPI_Testsome(n, reqs, &out, idx, st ? st : MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, what, m);
    if (out == MPI_UNDEFINED) return 0;
    /* the clock every 64 polls: reading it each time was a tenth of a small all_reduce */
    if (spins % 64 == 0 && deadline > 0 && pg_wtime() > deadline) return 1;
  }
}

/* After a timeout: pending receives cancelled, pending sends let go; the
 * context is marked broken with the message, which is also the error. */
static int waited_in_vain; /* pg_comm_timed_out */

int pg_comm_timed_out(void) { return waited_in_vain; }

static int give_up(pg_context *ctx, int n, MPI_Request *reqs, const char *msg) {
  waited_in_vain = 1;
  for (int i = 0; i < n; i++) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&reqs[i]);
    MPI_Request_free(&reqs[i]);
  }
  if (!ctx->broken) ctx->broken = strdup(msg);
  return pg_fail("%s", msg);
}

static int disagree(pg_context *ctx, const char *msg) {
  if (!ctx->broken) ctx->broken = strdup(msg);
  return pg_fail("%s", msg);
}

/* "ranks 1, 3" of the members whose record (request i of reqs, member
 * members[i]) is still pending. */
static void pending_ranks(const pg_group *g, int n, const MPI_Request *reqs, const int *members, char *buf,
                          size_t len) {
  size_t k = 0;
  int count = 0;
  for (int i = 0; i < n; i++) count += reqs[i] != MPI_REQUEST_NULL;
  k += (size_t)snprintf(buf, len, count > 1 ? "ranks " : "rank ");
  for (int i = 0, first = 1; i < n && k < len; i++) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    k += (size_t)snprintf(buf + k, len - k, first ? "%d" : ", %d", global_rank(g, members[i]));
    first = 0;
  }
}

static int same_call(const call_rec *a, const call_rec *b) {
  return a->kind == b->kind && a->dtype == b->dtype && a->op == b->op && a->root == b->root && a->count == b->count &&
         a->ndim == b->ndim && a->dim == b->dim && !memcmp(a->shape, b->shape, sizeof a->shape) &&
         !strcmp(a->site, b->site);
}

/* A collective: every member sends its record to every other and waits for theirs. */
static int agree(pg_context *ctx, pg_mode m, call_rec *c) {
  pg_group *g = &ctx->group[m];
  double limit;
  if (timeout_ok(&limit)) return PG_ERR;
  int n = g->size;
  call_rec *recs = NULL;
  MPI_Request *reqs = NULL;
  int *idx = NULL;
  if (scratch(ctx, n, &recs, &reqs, &idx)) return PG_ERR;
  recs[g->rank] = *c;
  /* receives first (requests 0..n-1 by member; our own slot is a null request), then the sends */
  int *members = idx + 2 * (size_t)n; /* member of receive request i */
  for (int i = 0; i < n; i++) {
    members[i] = i;
    reqs[i] = reqs[n + i] = MPI_REQUEST_NULL;
    if (i == g->rank) continue;
    int rc = MPI_Irecv(&recs[i], (int)sizeof *recs, MPI_BYTE, i, PG_AGREE_TAG, g->agree, &reqs[i]);
    if (rc == MPI_SUCCESS)
      rc = MPI_Isend(&recs[g->rank], (int)sizeof *recs, MPI_BYTE, i, PG_AGREE_TAG, g->agree, &reqs[n + i]);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, kind_name(c->kind), m);
  }
  int late = poll_all(2 * n, reqs, idx, NULL, limit > 0 ? pg_wtime() + limit : 0, kind_name(c->kind), m);
  if (late < 0) return PG_ERR;
  char mine[256], msg[1024];
  if (late) {
    char who[512];
    describe(g, c, mine, sizeof mine);
    pending_ranks(g, n, reqs, members, who, sizeof who);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but %s never arrived", mine,
             pg_mode_name(m), limit, who);
    return give_up(ctx, 2 * n, reqs, msg);
  }
  for (int i = 1; i < n; i++)
    if (!same_call(&recs[i], &recs[0])) {
      char other[256];
      describe(g, &recs[i], other, sizeof other);
      describe(g, &recs[0], mine, sizeof mine);
      snprintf(msg, sizeof msg, "%s over the %s group: rank %d called %s, rank %d called %s", kind_name(recs[0].kind),
               pg_mode_name(m), global_rank(g, i), other, global_rank(g, 0), mine);
      return disagree(ctx, msg);
    }
  return PG_OK;
}

/* Whether sender s's record and receiver r's record describe one transfer. */
static int pair_matches(const call_rec *s, const call_rec *r) {
  return (s->kind == PG_COLL_SEND || s->kind == PG_KIND_SENDRECV) &&
         (r->kind == PG_COLL_RECV || r->kind == PG_KIND_SENDRECV) && s->dst == r->me && r->src == s->me &&
         s->tag == r->tag && s->dtype == r->recv_dtype && s->count == r->recv_count;
}

static int pair_message(pg_context *ctx, const pg_group *g, pg_mode m, const call_rec *s, const call_rec *r) {
  char a[256], b[256], msg[700];
  describe(g, s, a, sizeof a);
  describe(g, r, b, sizeof b);
  snprintf(msg, sizeof msg, "%s over the %s group: rank %d called %s, but rank %d called %s", kind_name(s->kind),
           pg_mode_name(m), global_rank(g, s->me), a, global_rank(g, r->me), b);
  return disagree(ctx, msg);
}

/* Point to point: records exchanged with the peers (dst and src, once each,
 * not ourselves), each transfer checked from both ends. */
static int agree_pair(pg_context *ctx, pg_mode m, call_rec *c) {
  pg_group *g = &ctx->group[m];
  double limit;
  if (timeout_ok(&limit)) return PG_ERR;
  int peers[2], np = 0;
  if (c->dst >= 0 && c->dst != g->rank) peers[np++] = c->dst;
  if (c->src >= 0 && c->src != g->rank && (np == 0 || peers[0] != c->src)) peers[np++] = c->src;
  if (np == 0) return PG_OK;
  call_rec *recs = NULL; /* [0], [1]: the peers'; [2]: ours, sent */
  MPI_Request *reqs = NULL;
  int *idx = NULL;
  if (scratch(ctx, 3, &recs, &reqs, &idx)) return PG_ERR;
  recs[2] = *c;
  for (int i = 0; i < 4; i++) reqs[i] = MPI_REQUEST_NULL;
  for (int i = 0; i < np; i++) {
    int rc = MPI_Irecv(&recs[i], (int)sizeof *recs, MPI_BYTE, peers[i], PG_AGREE_TAG, g->agree, &reqs[i]);
    if (rc == MPI_SUCCESS)
      rc = MPI_Isend(&recs[2], (int)sizeof *recs, MPI_BYTE, peers[i], PG_AGREE_TAG, g->agree, &reqs[2 + i]);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, kind_name(c->kind), m);
  }
  int late = poll_all(4, reqs, idx, NULL, limit > 0 ? pg_wtime() + limit : 0, kind_name(c->kind), m);
  if (late < 0) return PG_ERR;
  if (late) {
    char mine[256], who[256], msg[700];
    describe(g, c, mine, sizeof mine);
    pending_ranks(g, 2, reqs, peers, who, sizeof who);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but %s never arrived", mine,
             pg_mode_name(m), limit, who);
    return give_up(ctx, 4, reqs, msg);
  }
  for (int i = 0; i < np; i++) {
    const call_rec *p = &recs[i];
    if (peers[i] == c->dst && !pair_matches(c, p)) return pair_message(ctx, g, m, c, p);
    if (peers[i] == c->src && !pair_matches(p, c)) return pair_message(ctx, g, m, p, c);
  }
  return PG_OK;
}

/* The agreement step of a gather or scatter of tensor t along dim: the shapes agree too. */
static int agree_shape(pg_context *ctx, pg_mode m, pg_coll kind, const pg_tensor *t, int dim, int op) {
  if (ctx->group[m].size == 1) {
    ctx->site[0] = 0;
    return PG_OK;
  }
  call_rec c = make_rec(ctx, m, kind, t->dtype, op, t->numel);
  c.ndim = t->ndim;
  c.dim = dim;
  memcpy(c.shape, t->shape, sizeof c.shape);
  return agree(ctx, m, &c);
}

/* The agreement step of a collective on group m (none for a group of one). */
static int agree_coll(pg_context *ctx, pg_mode m, pg_coll kind, int dtype, int op, int root, int64_t count) {
  if (ctx->group[m].size == 1) {
    ctx->site[0] = 0;
    return PG_OK;
  }
  call_rec c = make_rec(ctx, m, kind, dtype, op, count);
  c.root = root;
  return agree(ctx, m, &c);
}

/* ---- device memory, staged through the host ----
 *
 * A device engine's modules hand device buffers to these collectives. Where
 * no NCCL communicator serves the group (pg_comm_attach_device), such a
 * buffer is copied to host memory (after the device has finished writing
 * it), reduced or moved there by the MPI algorithms below, and copied back:
 * the same arithmetic in the same order as for host memory, so results equal
 * the cpu backend's reductions. Said once per process, on stderr. */
typedef struct staged {
  void *dev, *host;
  size_t bytes;
} staged;

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

static void host_give(void *p) {
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

static int stage(pg_context *ctx, pg_mode m, void **buf, size_t bytes, int copy_in, staged *s) {
  s->dev = s->host = NULL;
  s->bytes = bytes;
  if (ctx->group[m].size == 1 || !bytes || !pg_cuda_is_device_memory(*buf)) return PG_OK;
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
    host_give(s->host);
    s->dev = s->host = NULL;
    return PG_ERR;
  }
  *buf = s->host;
  return PG_OK;
}

/* ---- NCCL: collectives on device memory, queued on the device engine's stream ---- */

#ifdef PG_WITH_CUDA

static ncclDataType_t nccl_type(pg_dtype d) {
  switch (d) {
  case PG_INT32: return ncclInt32;
  case PG_INT64: return ncclInt64;
  case PG_FLOAT64: return ncclFloat64;
  case PG_BFLOAT16: return ncclBfloat16;
  default: return ncclFloat32;
  }
}

static ncclRedOp_t nccl_op(pg_reduce_op op) {
  return op == PG_REDUCE_MAX ? ncclMax : op == PG_REDUCE_MIN ? ncclMin : op == PG_REDUCE_AVG ? ncclAvg : ncclSum;
}

static int nccl_done(ncclResult_t r, const char *what, pg_mode m) {
  if (r == ncclSuccess) return PG_OK;
  int dev = -1;
  cudaGetDevice(&dev);
  return pg_fail("%s over the %s group failed on cuda:%d: %s", what, pg_mode_name(m), dev, ncclGetErrorString(r));
}

/* The group's NCCL communicator when buf is device memory and there is one. */
static ncclComm_t nccl_for(pg_context *ctx, pg_mode m, const void *buf) {
  return ctx->group[m].nccl && pg_cuda_is_device_memory(buf) ? (ncclComm_t)ctx->group[m].nccl : NULL;
}
#define NCCL_STREAM(ctx) ((cudaStream_t)(ctx)->device_stream)

/* A communicator split from the world's: every rank of the world calls it,
 * members with their colour, the others with NCCL_SPLIT_NOCOLOR. */
static int split(pg_context *ctx, int color, int key, void **out, pg_mode m) {
  ncclComm_t c = NULL;
  if (nccl_done(ncclCommSplit((ncclComm_t)ctx->nccl_world, color, key, &c, NULL), "creating the NCCL communicator", m))
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
static ncclComm_t pipeline_link(pg_context *ctx, int peer, int sending, int *peer_in_link) {
  int me = ctx->group[PG_MODE_PIPELINE].rank;
  *peer_in_link = peer == me + 1 ? 1 : 0;
  if (peer == me + 1) return (ncclComm_t)ctx->nccl_next[sending ? 0 : 1];
  if (peer == me - 1) return (ncclComm_t)ctx->nccl_prev[sending ? 1 : 0];
  return NULL;
}
#endif

int pg_comm_attach_device(pg_context *ctx, void *stream) {
  if (check_ctx(ctx)) return PG_ERR;
  if (ctx->device_attached) {
    if (ctx->device_stream != stream)
      return pg_fail("this parallel context already serves an engine on another device: one context per device");
    return PG_OK;
  }
  ctx->device_stream = stream;
  ctx->device_attached = 1;
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
  if (w->rank == 0 && nccl_done(ncclGetUniqueId(&id), "creating an NCCL id", PG_MODE_GLOBAL)) return PG_ERR;
  if (MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, w->comm) != MPI_SUCCESS)
    return pg_fail("sharing the NCCL id of the world failed");
  ncclComm_t world = NULL;
  if (nccl_done(ncclCommInitRank(&world, w->size, id, w->rank), "creating the NCCL communicator", PG_MODE_GLOBAL))
    return PG_ERR;
  ctx->nccl_world = world;
  const pg_mode modes[] = {PG_MODE_TENSOR, PG_MODE_DATA, PG_MODE_EMBEDDING, PG_MODE_EXPERT, PG_MODE_EXPERT_DATA};
  for (size_t i = 0; i < sizeof modes / sizeof *modes; i++) {
    pg_group *g = &ctx->group[modes[i]];
    if (split(ctx, g->size > 1 ? g->ranks[0] : NCCL_SPLIT_NOCOLOR, g->rank, &g->nccl, modes[i]))
      return PG_ERR;
  }
  /* Link (s, s + 1) of a pipeline group is named by its lower member's
   * global rank; in two rounds (even s, then odd s) so that a rank is in at
   * most one link per split. */
  pg_group *p = &ctx->group[PG_MODE_PIPELINE];
  for (int round = 0; round < 2; round++)
    for (int dir = 0; dir < 2; dir++) {
      int lower = p->rank % 2 == round ? p->rank : p->rank - 1, member = lower >= 0 && lower + 1 < p->size;
      void *c = NULL;
      if (split(ctx, member ? p->ranks[lower] : NCCL_SPLIT_NOCOLOR, p->rank, &c, PG_MODE_PIPELINE)) return PG_ERR;
      if (member) *(lower == p->rank ? &ctx->nccl_next[dir] : &ctx->nccl_prev[dir]) = c;
    }
  if (p->size > 1) {
    cudaStream_t st = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) return pg_fail("creating the pipeline's send stream failed: %s", cudaGetErrorString(e));
    ctx->send_stream = st;
  }
  if (ctx->group[PG_MODE_DATA].nccl) {
    cudaStream_t st = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) return pg_fail("creating the data group's reduction stream failed: %s", cudaGetErrorString(e));
    ctx->reduce_stream = st;
  }
#endif
  return PG_OK;
}

int pg_comm_device_overlap(const pg_context *ctx, pg_mode m) {
  return m == PG_MODE_DATA && ctx->reduce_stream != NULL;
}

void pg_comm_detach_device(pg_context *ctx) {
#ifdef PG_WITH_CUDA
  for (int m = 0; m < PG_NUM_MODES; m++)
    if (ctx->group[m].nccl) ncclCommDestroy((ncclComm_t)ctx->group[m].nccl);
  for (int d = 0; d < 2; d++) {
    if (ctx->nccl_next[d]) ncclCommDestroy((ncclComm_t)ctx->nccl_next[d]);
    if (ctx->nccl_prev[d]) ncclCommDestroy((ncclComm_t)ctx->nccl_prev[d]);
  }
  if (ctx->nccl_world) ncclCommDestroy((ncclComm_t)ctx->nccl_world);
  if (ctx->send_stream) cudaStreamDestroy((cudaStream_t)ctx->send_stream);
  if (ctx->reduce_stream) cudaStreamDestroy((cudaStream_t)ctx->reduce_stream);
#endif
  for (int m = 0; m < PG_NUM_MODES; m++) ctx->group[m].nccl = NULL;
  for (int d = 0; d < 2; d++) ctx->nccl_next[d] = ctx->nccl_prev[d] = NULL;
  ctx->nccl_world = ctx->send_stream = ctx->reduce_stream = NULL;
  if (ctx->device_attached && --attached_contexts == 0) host_release_all();
  ctx->device_attached = 0;
  ctx->device_stream = NULL;
}

/* Back to the device (when copy_out and the collective succeeded); rc passes through. */
static int unstage(staged *s, int rc, int copy_out) {
  if (!s->dev) return rc;
  if (rc == PG_OK && copy_out &&
      (pg_cuda_memcpy(s->dev, s->host, s->bytes, PG_CUDA_HOST_TO_DEVICE) || pg_cuda_synchronize()))
    rc = PG_ERR;
  host_give(s->host);
  return rc;
}

static int check_dtype(const pg_tensor *t, pg_reduce_op op, int reducing) {
  if (!t->storage) return pg_fail("the tensor was freed");
  if (mpi_type(t->dtype) == MPI_DATATYPE_NULL)
    return pg_fail("collectives support float32 and int32, not %s", pg_dtype_name(t->dtype));
  if (reducing && op == PG_REDUCE_AVG && t->dtype != PG_FLOAT32)
    return pg_fail("op avg needs a float32 tensor, not %s", pg_dtype_name(t->dtype));
  return PG_OK;
}

static void count(pg_context *ctx, pg_mode m, pg_coll c, double bytes, double t0) {
  ctx->stats.calls[m][c]++;
  ctx->stats.bytes[m][c] += bytes;
  ctx->stats.seconds[m][c] += pg_wtime() - t0;
}

static void scale_avg(void *buf, int64_t n, int size) {
  float *x = buf, s = 1.0f / (float)size;
#pragma omp parallel for simd schedule(static) if (parallel : n > 32768)
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

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

#define PG_RING_CHUNK ((int64_t)1 << 18) /* floats per transfer (1 MiB) */
#define PG_RING_TAG 0x5067               /* collectives are blocking: no user message can be in flight */
#define PG_RING_MIN ((int64_t)1 << 18)   /* floats: at 1 MiB ring and MPI_Allreduce were even (bench_comm); below, MPI's latency-optimised algorithms */

static int64_t block_start(int64_t n, int size, int b) { return n * b / size; }

/* Elements of a block of `len` in the transfer that starts at `off` (0 past its end). */
static int piece(int64_t len, int64_t off) {
  int64_t c = len - off;
  return (int)(c <= 0 ? 0 : c < PG_RING_CHUNK ? c : PG_RING_CHUNK);
}

static int ring_scratch(pg_context *ctx) {
  if (!ctx->ring_scratch && !(ctx->ring_scratch = malloc((size_t)PG_RING_CHUNK * sizeof(float))))
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
static int64_t unit_start(int64_t n, int size, int b, int64_t unit) { return block_start(n / unit, size, b) * unit; }

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
static int ring_reduce_scatter_units(pg_context *ctx, pg_mode m, void *data, int64_t n, pg_reduce_op op,
                                     int64_t unit, pg_dtype dtype) {
  pg_group *g = &ctx->group[m];
  int D = g->size, r = g->rank, next = (r + 1) % D, prev = (r + D - 1) % D;
  int64_t most = longest_block(n, D, unit);
  if (ring_scratch(ctx)) return PG_ERR;
  size_t es = pg_dtype_size(dtype); /* float32, or bf16 (sums only: fold_bf16) */
  MPI_Datatype type = mpi_type(dtype);
  char *buf = data, *tmp = (char *)ctx->ring_scratch; /* PG_RING_CHUNK floats: room for a chunk of either */
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
static int ring_reduce_scatter_to(pg_context *ctx, pg_mode m, const float *in, float *out, int64_t per,
                                  pg_reduce_op op) {
  pg_group *g = &ctx->group[m];
  int D = g->size, r = g->rank, next = (r + 1) % D, prev = (r + D - 1) % D;
  if (ring_scratch(ctx)) return PG_ERR;
  float *tmp = ctx->ring_scratch;
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

static int ring_reduce_scatter(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_reduce_op op, pg_dtype dtype) {
  return ring_reduce_scatter_units(ctx, m, buf, n, op, 1, dtype);
}

/* In place: every member's block (as above) copied to all the others (float32 or bf16 elements). */
static int ring_all_gather_units(pg_context *ctx, pg_mode m, void *data, int64_t n, int64_t unit, pg_dtype dtype) {
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

static int ring_all_gather(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype) {
  return ring_all_gather_units(ctx, m, buf, n, 1, dtype);
}

/* In place over blocks of whole rows of `unit` floats (unit_start): the
 * ZeRO shards (unit 1) and sequence parallelism's rows. NCCL's blocks are
 * equal: it serves a device buffer whose rows split evenly; otherwise the
 * buffer is staged through the host. */
static int reduce_scatter_units(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_reduce_op op, int64_t unit,
                                pg_dtype dtype) {
  if (check_ctx(ctx) || agree_coll(ctx, m, PG_COLL_REDUCE_SCATTER, dtype, op, -1, n)) return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  double t0 = pg_wtime();
  size_t es = pg_dtype_size(dtype);
#ifdef PG_WITH_CUDA
  ncclComm_t nc = (n / unit) % g->size ? NULL : nccl_for(ctx, m, buf); /* NCCL's blocks are equal */
  if (nc) {
    int64_t blk = n / g->size;
    if (nccl_done(ncclReduceScatter(buf, (char *)buf + (size_t)g->rank * blk * es, (size_t)blk, nccl_type(dtype),
                                    nccl_op(op), nc, NCCL_STREAM(ctx)),
                  "reduce_scatter", m))
      return PG_ERR;
    count(ctx, m, PG_COLL_REDUCE_SCATTER, (double)n * es, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (stage(ctx, m, &buf, (size_t)n * es, 1, &s)) return PG_ERR;
  int rc = ring_reduce_scatter_units(ctx, m, buf, n, op, unit, dtype);
  if (!rc) count(ctx, m, PG_COLL_REDUCE_SCATTER, (double)n * es, t0);
  return unstage(&s, rc, 1);
}

static int all_gather_units(pg_context *ctx, pg_mode m, void *buf, int64_t n, int64_t unit, pg_dtype dtype) {
  if (check_ctx(ctx) || agree_coll(ctx, m, PG_COLL_ALL_GATHER, dtype, -1, -1, n)) return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  double t0 = pg_wtime();
  size_t es = pg_dtype_size(dtype);
#ifdef PG_WITH_CUDA
  ncclComm_t nc = (n / unit) % g->size ? NULL : nccl_for(ctx, m, buf);
  if (nc) {
    int64_t blk = n / g->size;
    if (nccl_done(ncclAllGather((char *)buf + (size_t)g->rank * blk * es, buf, (size_t)blk, nccl_type(dtype), nc,
                                NCCL_STREAM(ctx)),
                  "all_gather", m))
      return PG_ERR;
    count(ctx, m, PG_COLL_ALL_GATHER, (double)n * es, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (stage(ctx, m, &buf, (size_t)n * es, 1, &s)) return PG_ERR;
  int rc = ring_all_gather_units(ctx, m, buf, n, unit, dtype);
  if (!rc) count(ctx, m, PG_COLL_ALL_GATHER, (double)n * es, t0);
  return unstage(&s, rc, 1);
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
  if (agree_coll(ctx, m, PG_COLL_ALL_REDUCE, dtype, op, -1, n)) return PG_ERR;
#ifdef PG_WITH_CUDA
  ncclComm_t nc = ctx->group[m].size > 1 && n > 0 ? nccl_for(ctx, m, buf) : NULL;
  if (nc) {
    double t0 = pg_wtime();
    if (nccl_done(ncclAllReduce(buf, buf, (size_t)n, nccl_type(dtype), nccl_op(op), nc, NCCL_STREAM(ctx)),
                  "all_reduce", m))
      return PG_ERR;
    count(ctx, m, PG_COLL_ALL_REDUCE, (double)n * pg_dtype_size(dtype), t0);
    return PG_OK;
  }
#endif
  staged s;
  if (stage(ctx, m, &buf, (size_t)n * pg_dtype_size(dtype), 1, &s)) return PG_ERR;
  return unstage(&s, all_reduce_host(ctx, m, buf, n, dtype, op), 1);
}

static int all_reduce_host(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype, pg_reduce_op op) {
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  double t0 = pg_wtime();
  size_t es = pg_dtype_size(dtype);
  /* bf16 always round the ring: MPI's own sums cannot add bf16 */
  if ((dtype == PG_FLOAT32 && n >= PG_RING_MIN) || dtype == PG_BFLOAT16) {
    /* reduce-scatter + all-gather round the ring (the average folded into the last step) */
    if (ring_reduce_scatter(ctx, m, buf, n, op, dtype) || ring_all_gather(ctx, m, buf, n, dtype)) return PG_ERR;
    count(ctx, m, PG_COLL_ALL_REDUCE, (double)n * es, t0);
    return PG_OK;
  }
  for (int64_t off = 0; off < n; off += PG_MPI_CHUNK) {
    int64_t c = n - off < PG_MPI_CHUNK ? n - off : PG_MPI_CHUNK;
    int rc = MPI_Allreduce(MPI_IN_PLACE, (char *)buf + off * es, (int)c, mpi_type(dtype), mpi_op(op), g->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "all_reduce", m);
  }
  if (op == PG_REDUCE_AVG) scale_avg(buf, n, g->size);
  count(ctx, m, PG_COLL_ALL_REDUCE, (double)n * es, t0);
  return PG_OK;
}

int pg_all_reduce(pg_context *ctx, pg_mode m, pg_tensor *t, pg_reduce_op op) {
  if (check_dtype(t, op, 1)) return PG_ERR;
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
  ncclComm_t nc = ctx->group[m].size > 1 && n > 0 ? nccl_for(ctx, m, buf) : NULL;
  if (nc) { /* member r's block is [r n, (r+1) n): in place */
    double t0 = pg_wtime();
    size_t es = pg_dtype_size(dtype);
    if (nccl_done(ncclAllGather((char *)buf + (size_t)ctx->group[m].rank * n * es, buf, (size_t)n, nccl_type(dtype), nc,
                                NCCL_STREAM(ctx)),
                  "all_gather", m))
      return PG_ERR;
    count(ctx, m, PG_COLL_ALL_GATHER, (double)n * es * ctx->group[m].size, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (stage(ctx, m, &buf, (size_t)n * ctx->group[m].size * pg_dtype_size(dtype), 1, &s)) return PG_ERR;
  return unstage(&s, all_gather_host(ctx, m, buf, n, dtype), 1);
}

int pg_all_gather_buf(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype) {
  if (check_ctx(ctx) || agree_coll(ctx, m, PG_COLL_ALL_GATHER, dtype, -1, -1, n)) return PG_ERR;
  return all_gather_agreed(ctx, m, buf, n, dtype);
}

static int all_gather_host(pg_context *ctx, pg_mode m, void *buf, int64_t n, pg_dtype dtype) {
  pg_group *g = &ctx->group[m];
  if (g->size == 1 || n == 0) return PG_OK;
  if (n > PG_MPI_CHUNK) return pg_fail("all_gather of %lld elements per member is too large", (long long)n);
  double t0 = pg_wtime();
  if (dtype == PG_FLOAT32 && n * g->size >= PG_RING_MIN) {
    if (ring_all_gather(ctx, m, buf, n * g->size, dtype)) return PG_ERR; /* member r's block is [r n, (r+1) n) */
  } else {
    int rc = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, (int)n, mpi_type(dtype), g->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "all_gather", m);
  }
  count(ctx, m, PG_COLL_ALL_GATHER, (double)n * pg_dtype_size(dtype) * g->size, t0);
  return PG_OK;
}

int pg_all_gather(pg_context *ctx, pg_mode m, const pg_tensor *in, pg_tensor *out, int dim) {
  if (check_ctx(ctx) || check_dtype(in, PG_REDUCE_SUM, 0) || check_dim(in, dim) ||
      agree_shape(ctx, m, PG_COLL_ALL_GATHER, in, dim, -1))
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
      if (ring_reduce_scatter(ctx, m, out, n * g->size, op, dtype)) return PG_ERR;
      if (g->rank) memmove(out, (float *)out + n * g->rank, (size_t)n * es);
    } else if (ring_reduce_scatter_to(ctx, m, in, out, n, op)) {
      return PG_ERR;
    }
  } else {
    /* in == out: in place (the member's block lands at the front of the buffer) */
    int rc = MPI_Reduce_scatter_block(in == out ? MPI_IN_PLACE : in, out, (int)n, mpi_type(dtype), mpi_op(op), g->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "reduce_scatter", m);
    if (op == PG_REDUCE_AVG) scale_avg(out, n, g->size);
  }
  count(ctx, m, PG_COLL_REDUCE_SCATTER, (double)n * es * g->size, t0);
  return PG_OK;
}

int pg_reduce_scatter_buf(pg_context *ctx, pg_mode m, const void *in, void *out, int64_t n, pg_dtype dtype,
                          pg_reduce_op op) {
  if (dtype == PG_BFLOAT16) return pg_fail("reduce_scatter of bfloat16 is not supported (pg_reduce_scatter_rows is)");
  /* the record counts what each member puts in, as pg_reduce_scatter's does */
  if (check_ctx(ctx) || agree_coll(ctx, m, PG_COLL_REDUCE_SCATTER, dtype, op, -1, n * ctx->group[m].size))
    return PG_ERR;
  return reduce_scatter_agreed(ctx, m, in, out, n, dtype, op);
}

int pg_reduce_scatter(pg_context *ctx, pg_mode m, const pg_tensor *in, pg_tensor *out, int dim, pg_reduce_op op) {
  /* agreed first: the divisibility below is then the same test on every member */
  if (check_ctx(ctx) || check_dtype(in, op, 1) || check_dim(in, dim) ||
      agree_shape(ctx, m, PG_COLL_REDUCE_SCATTER, in, dim, op))
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
  if (agree_coll(ctx, m, PG_COLL_BROADCAST, dtype, -1, src, n)) return PG_ERR;
  if (g->size == 1 || n == 0) return PG_OK;
  size_t es = pg_dtype_size(dtype);
  staged s;
  if (stage(ctx, m, &buf, (size_t)n * es, g->rank == src, &s)) return PG_ERR;
  double t0 = pg_wtime();
  int rc = MPI_SUCCESS;
  for (int64_t off = 0; off < n && rc == MPI_SUCCESS; off += PG_MPI_CHUNK) {
    int64_t c = n - off < PG_MPI_CHUNK ? n - off : PG_MPI_CHUNK;
    rc = MPI_Bcast((char *)buf + off * es, (int)c, mpi_type(dtype), src, g->comm);
  }
  if (rc != MPI_SUCCESS) return unstage(&s, mpi_fail(rc, "broadcast", m), 0);
  count(ctx, m, PG_COLL_BROADCAST, (double)n * es, t0);
  return unstage(&s, PG_OK, 1);
}

int pg_broadcast(pg_context *ctx, pg_mode m, pg_tensor *t, int src) {
  if (check_dtype(t, PG_REDUCE_SUM, 0)) return PG_ERR;
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
  if (check_ctx(ctx) || check_dtype(t, PG_REDUCE_SUM, 0) || check_peer(ctx, m, dst, "send") || check_count(t)) return PG_ERR;
  call_rec c = make_rec(ctx, m, PG_COLL_SEND, t->dtype, -1, t->numel);
  c.dst = dst;
  c.tag = tag;
  if (agree_pair(ctx, m, &c)) return PG_ERR;
  double t0 = pg_wtime();
  int rc = MPI_Send(pg_tensor_data(t), (int)t->numel, mpi_type(t->dtype), dst, tag, ctx->group[m].comm);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "send", m);
  count(ctx, m, PG_COLL_SEND, (double)t->numel * pg_dtype_size(t->dtype), t0);
  return PG_OK;
}

int pg_recv(pg_context *ctx, pg_mode m, pg_tensor *t, int src, int tag) {
  if (check_ctx(ctx) || check_dtype(t, PG_REDUCE_SUM, 0) || check_peer(ctx, m, src, "recv") || check_count(t)) return PG_ERR;
  call_rec c = make_rec(ctx, m, PG_COLL_RECV, -1, -1, 0);
  c.src = src;
  c.tag = tag;
  c.recv_dtype = t->dtype;
  c.recv_count = t->numel;
  if (agree_pair(ctx, m, &c)) return PG_ERR;
  double t0 = pg_wtime();
  MPI_Status st;
  int rc = MPI_Recv(pg_tensor_data(t), (int)t->numel, mpi_type(t->dtype), src, tag, ctx->group[m].comm, &st);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "recv", m);
  int got = 0;
  MPI_Get_count(&st, mpi_type(t->dtype), &got);
  if (got != t->numel)
    return pg_fail("recv: expected %lld elements from local rank %d of the %s group, got %d", (long long)t->numel, src,
                   pg_mode_name(m), got);
  count(ctx, m, PG_COLL_RECV, (double)t->numel * pg_dtype_size(t->dtype), t0);
  return PG_OK;
}

int pg_sendrecv(pg_context *ctx, pg_mode m, const pg_tensor *send, int dst, pg_tensor *recv, int src, int tag) {
  if (check_ctx(ctx) || check_dtype(send, PG_REDUCE_SUM, 0) || check_dtype(recv, PG_REDUCE_SUM, 0) ||
      check_count(send) || check_count(recv))
    return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (dst < 0 || dst >= g->size || src < 0 || src >= g->size)
    return pg_fail("sendrecv peers %d and %d must be local ranks of the %s group (size %d)", dst, src, pg_mode_name(m), g->size);
  if (g->size == 1) {
    ctx->site[0] = 0;
    return pg_tensor_copy(recv, send);
  }
  call_rec c = make_rec(ctx, m, PG_KIND_SENDRECV, send->dtype, -1, send->numel);
  c.dst = dst;
  c.src = src;
  c.tag = tag;
  c.recv_dtype = recv->dtype;
  c.recv_count = recv->numel;
  if (agree_pair(ctx, m, &c)) return PG_ERR;
  double t0 = pg_wtime();
  MPI_Status st;
  int rc = MPI_Sendrecv(pg_tensor_data(send), (int)send->numel, mpi_type(send->dtype), dst, tag, pg_tensor_data(recv),
                        (int)recv->numel, mpi_type(recv->dtype), src, tag, g->comm, &st);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "sendrecv", m);
  count(ctx, m, PG_COLL_SEND, (double)send->numel * pg_dtype_size(send->dtype), t0);
  ctx->stats.calls[m][PG_COLL_RECV]++;
  return PG_OK;
}

int pg_barrier(pg_context *ctx, pg_mode m) {
  if (check_ctx(ctx) || agree_coll(ctx, m, PG_COLL_BARRIER, -1, -1, -1, 0)) return PG_ERR;
  pg_group *g = &ctx->group[m];
  if (g->size == 1) return PG_OK;
  double t0 = pg_wtime();
  int rc = MPI_Barrier(g->comm);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "barrier", m);
  count(ctx, m, PG_COLL_BARRIER, 0, t0);
  return PG_OK;
}

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
               pg_mode_name(m), global_rank(g, (int)b[1]), (long long)b[2], global_rank(g, r), (long long)b[3]);
    else if (b[0] == 2)
      snprintf(msg, sizeof msg, "all_to_all over the %s group: rank %d gave a negative count (%lld) for rank %d",
               pg_mode_name(m), global_rank(g, r), (long long)b[2], global_rank(g, (int)b[1]));
    else if (b[0] == 3)
      snprintf(msg, sizeof msg, "all_to_all over the %s group: rank %d sends or receives more than %d values in all",
               pg_mode_name(m), global_rank(g, r), INT_MAX);
    else
      continue;
    return disagree(ctx, msg);
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
  if (agree_coll(ctx, m, PG_COLL_ALL_TO_ALL, dtype, -1, -1, 0)) return PG_ERR;
  if (n == 1) {
    if (send_counts[0] != recv_counts[0] || send_counts[0] < 0)
      return pg_fail("all_to_all over a group of one: sends %lld values to itself but expects %lld",
                     (long long)send_counts[0], (long long)recv_counts[0]);
    size_t bytes = (size_t)send_counts[0] * es;
    if (!bytes) return PG_OK;
    if (pg_cuda_is_device_memory(recv) || pg_cuda_is_device_memory(send))
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
  ncclComm_t comm = rc ? NULL : nccl_for(ctx, m, st ? send : recv);
  if (comm && (!st || pg_cuda_is_device_memory(send)) && (!rt || pg_cuda_is_device_memory(recv))) {
    /* NCCL has no alltoallv: grouped sends and receives, one pair per peer */
    ncclDataType_t t = nccl_type(dtype);
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
    if (nccl_done(r != ncclSuccess ? r : r2, "all_to_all", m)) return PG_ERR;
    count(ctx, m, PG_COLL_ALL_TO_ALL, (double)st * es, t0);
    return PG_OK;
  }
#endif
  staged ss = {0}, rs = {0};
  void *sb = (void *)send;
  if (!rc) rc = stage(ctx, m, &sb, (size_t)st * es, 1, &ss);
  if (!rc && stage(ctx, m, &recv, (size_t)rt * es, 0, &rs)) rc = unstage(&ss, PG_ERR, 0);
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
  unstage(&ss, PG_OK, 0);
  if (mrc != MPI_SUCCESS) return unstage(&rs, mpi_fail(mrc, "all_to_all", m), 0);
  count(ctx, m, PG_COLL_ALL_TO_ALL, (double)st * es, t0);
  return unstage(&rs, PG_OK, 1);
}

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
};

/* A pipeline transfer's deadline, or 0 for none; PG_ERR when PG_COLLECTIVE_TIMEOUT is not a number. */
static int deadline_of(double *deadline, double *limit) {
  if (timeout_ok(limit)) return PG_ERR;
  *deadline = *limit > 0 ? pg_wtime() + *limit : 0;
  return PG_OK;
}

int pg_isend_buf(pg_context *ctx, pg_mode m, const float *buf, int64_t n, int dst, int tag, pg_request **req) {
  if (check_ctx(ctx)) return PG_ERR;
  if (n > PG_MPI_CHUNK) return pg_fail("isend of %lld elements is too large", (long long)n);
  if (*req) return pg_fail("isend: the previous transfer of this request was not waited for");
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a send request");
  r->mode = m;
  r->ctx = ctx;
  r->rec = make_rec(ctx, m, PG_COLL_SEND, PG_FLOAT32, -1, n);
  r->rec.dst = dst;
  r->rec.tag = tag;
  r->rec_req = MPI_REQUEST_NULL;
  if (debug_checks() && ctx->group[m].size > 1) {
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
  ncclComm_t link = m == PG_MODE_PIPELINE && n > 0 ? pipeline_link(ctx, dst, 1, &peer) : NULL;
  if (link && pg_cuda_is_device_memory(buf)) {
    cudaEvent_t made = NULL, sent = NULL;
    double t0 = pg_wtime();
    cudaError_t e = cudaEventCreateWithFlags(&made, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&sent, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(made, NCCL_STREAM(ctx));
    if (e == cudaSuccess) e = cudaStreamWaitEvent((cudaStream_t)ctx->send_stream, made, 0);
    ncclResult_t nr = e == cudaSuccess ? ncclSend(buf, (size_t)n, ncclFloat32, peer, link, ctx->send_stream)
                                       : ncclSuccess;
    if (e == cudaSuccess && nr == ncclSuccess) e = cudaEventRecord(sent, (cudaStream_t)ctx->send_stream);
    if (made) cudaEventDestroy(made);
    if (e != cudaSuccess || nr != ncclSuccess) {
      if (sent) cudaEventDestroy(sent);
      if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE);
      free(r);
      return e != cudaSuccess ? pg_fail("queueing a send over the pipeline group failed: %s", cudaGetErrorString(e))
                              : nccl_done(nr, "send", m);
    }
    r->sent = sent;
    r->after = ctx->device_stream;
    *req = r;
    count(ctx, m, PG_COLL_SEND, (double)n * 4, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (stage(ctx, m, (void **)&buf, (size_t)n * sizeof(float), 1, &s)) {
    if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE);
    free(r);
    return PG_ERR;
  }
  r->host = s.host; /* NULL for host memory */
  double t0 = pg_wtime();
  int rc = MPI_Isend(buf, (int)n, MPI_FLOAT, dst, tag, ctx->group[m].comm, &r->mpi);
  if (rc != MPI_SUCCESS) {
    host_give(r->host);
    if (r->rec_req != MPI_REQUEST_NULL) MPI_Wait(&r->rec_req, MPI_STATUS_IGNORE);
    free(r);
    return mpi_fail(rc, "isend", m);
  }
  *req = r;
  count(ctx, m, PG_COLL_SEND, (double)n * 4, t0);
  return PG_OK;
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
    int late = one == MPI_REQUEST_NULL ? 0 : poll_all(1, &one, &idx1, NULL, deadline, "a bucket's reduction", m);
    if (late < 0) return PG_ERR;
    if (late) { /* r stays allocated: MPI may still write the bucket */
      char what[256], msg[512];
      describe(&r->ctx->group[m], &r->rec, what, sizeof what);
      snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but a member never joined",
               what, pg_mode_name(m), limit);
      if (!r->ctx->broken) r->ctx->broken = strdup(msg);
      return pg_fail("%s", msg);
    }
    finish_coll(r);
    return PG_OK;
  }
  MPI_Request two[2] = {r->mpi, r->rec_req};
  int idx[2];
  double deadline, limit;
  if (deadline_of(&deadline, &limit)) return PG_ERR;
  int late = poll_all(2, two, idx, NULL, deadline, "waiting for a send", m);
  if (late < 0) return PG_ERR;
  if (late) { /* r, its record and a staged copy stay allocated: MPI may still read them */
    char what[256], msg[512];
    const pg_group *g = &r->ctx->group[m];
    describe(g, &r->rec, what, sizeof what);
    snprintf(msg, sizeof msg,
             "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but rank %d never received it", what,
             pg_mode_name(m), limit, global_rank(g, r->rec.dst));
    return give_up(r->ctx, 2, two, msg);
  }
  host_give(r->host);
  free(r);
  return PG_OK;
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
  return agree_coll(ctx, m, kind, PG_FLOAT32, op, -1, count);
}

static int start_coll(pg_context *ctx, pg_mode m, float *buf, int64_t n, pg_reduce_op op, const int64_t *counts,
                      pg_request **req) {
  if (check_ctx(ctx)) return PG_ERR;
  if (*req) return pg_fail("a bucket's reduction was started twice without a wait");
  if (op != PG_REDUCE_SUM && op != PG_REDUCE_AVG) return pg_fail("bucket reductions are sum or avg");
  if (n > PG_MPI_CHUNK) return pg_fail("a bucket of %lld elements is too large (at most 2^30)", (long long)n);
  pg_group *g = &ctx->group[m];
#ifdef PG_WITH_CUDA
  /* Device memory: an NCCL all-reduce on the reduction stream, after what
   * the engine's stream has queued so far (the bucket's last gradient
   * kernel: an event recorded there, waited for by the reduction stream);
   * the wait makes the engine's stream wait for the reduction's event, so
   * the optimizer's kernels come after it and the host never blocks. */
  if (!counts && g->size > 1 && n > 0 && m == PG_MODE_DATA && ctx->reduce_stream && nccl_for(ctx, m, buf)) {
    pg_request *r = calloc(1, sizeof *r);
    if (!r) return pg_fail("out of memory for a reduction request");
    cudaStream_t rs = (cudaStream_t)ctx->reduce_stream;
    cudaEvent_t made = NULL, done = NULL;
    double t0 = pg_wtime();
    cudaError_t e = cudaEventCreateWithFlags(&made, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(made, NCCL_STREAM(ctx));
    if (e == cudaSuccess) e = cudaStreamWaitEvent(rs, made, 0);
    ncclResult_t nr = e == cudaSuccess ? ncclAllReduce(buf, buf, (size_t)n, ncclFloat32, nccl_op(op),
                                                       (ncclComm_t)g->nccl, rs)
                                       : ncclSuccess;
    if (e == cudaSuccess && nr == ncclSuccess) e = cudaEventRecord(done, rs);
    if (made) cudaEventDestroy(made);
    if (e != cudaSuccess || nr != ncclSuccess) {
      if (done) cudaEventDestroy(done);
      free(r);
      return e != cudaSuccess ? pg_fail("queueing a bucket's reduction failed: %s", cudaGetErrorString(e))
                              : nccl_done(nr, "all_reduce", m);
    }
    r->mode = m;
    r->ctx = ctx;
    r->mpi = r->rec_req = MPI_REQUEST_NULL;
    r->sent = done;
    r->after = ctx->device_stream;
    *req = r;
    count(ctx, m, PG_COLL_ALL_REDUCE, (double)n * sizeof(float), t0);
    return PG_OK;
  }
#endif
  if (pg_cuda_is_device_memory(buf))
    return pg_fail("bucket reductions take host memory, or device memory all-reduced over the data group's NCCL");
  pg_request *r = calloc(1, sizeof *r);
  if (!r) return pg_fail("out of memory for a reduction request");
  r->mode = m;
  r->ctx = ctx;
  r->coll = 1;
  r->buf = buf;
  r->mpi = MPI_REQUEST_NULL;
  r->rec_req = MPI_REQUEST_NULL;
  r->rec = make_rec(ctx, m, counts ? PG_COLL_REDUCE_SCATTER : PG_COLL_ALL_REDUCE, PG_FLOAT32, op, n);
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
  count(ctx, m, counts ? PG_COLL_REDUCE_SCATTER : PG_COLL_ALL_REDUCE, (double)n * sizeof(float), t0);
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

/* The reduced piece to its place, scaled; the request freed. */
static void finish_coll(pg_request *r) {
  if (r->displ && r->piece) memmove(r->buf + r->displ, r->buf, (size_t)r->piece * sizeof(float));
  if (r->avg_over > 1) scale_avg(r->buf + r->displ, r->piece, r->avg_over);
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
  if (scratch(ctx, 1, &recs, &reqs, &idx)) return PG_ERR;
  int rc = MPI_Irecv(recs, (int)sizeof *recs, MPI_BYTE, mine->src, PG_AGREE_TAG, g->agree, reqs);
  if (rc != MPI_SUCCESS) return mpi_fail(rc, "recv", m);
  int late = poll_all(1, reqs, idx, NULL, deadline, "recv", m);
  if (late < 0) return PG_ERR;
  if (late) {
    char what[256], msg[512];
    describe(g, mine, what, sizeof what);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but rank %d never sent it",
             what, pg_mode_name(m), limit, global_rank(g, mine->src));
    return give_up(ctx, 1, reqs, msg);
  }
  return pair_matches(recs, mine) ? PG_OK : pair_message(ctx, g, m, recs, mine);
}

int pg_recv_buf(pg_context *ctx, pg_mode m, float *buf, int64_t n, int src, int tag) {
  if (check_ctx(ctx)) return PG_ERR;
  if (n > PG_MPI_CHUNK) return pg_fail("recv of %lld elements is too large", (long long)n);
  call_rec mine = make_rec(ctx, m, PG_COLL_RECV, -1, -1, 0);
  mine.src = src;
  mine.tag = tag;
  mine.recv_dtype = PG_FLOAT32;
  mine.recv_count = n;
  double deadline, limit;
  if (deadline_of(&deadline, &limit)) return PG_ERR;
  if (debug_checks() && ctx->group[m].size > 1 && check_shipped(ctx, m, &mine, deadline, limit)) return PG_ERR;
#ifdef PG_WITH_CUDA
  /* from a pipeline neighbour into device memory: queued on the engine's stream */
  int peer = 0;
  ncclComm_t link = m == PG_MODE_PIPELINE && n > 0 ? pipeline_link(ctx, src, 0, &peer) : NULL;
  if (link && pg_cuda_is_device_memory(buf)) {
    double t0 = pg_wtime();
    if (nccl_done(ncclRecv(buf, (size_t)n, ncclFloat32, peer, link, NCCL_STREAM(ctx)), "recv", m)) return PG_ERR;
    count(ctx, m, PG_COLL_RECV, (double)n * 4, t0);
    return PG_OK;
  }
#endif
  staged s;
  if (stage(ctx, m, (void **)&buf, (size_t)n * sizeof(float), 0, &s)) return PG_ERR;
  double t0 = pg_wtime();
  /* polled with the deadline: the sender may never come */
  MPI_Request q = MPI_REQUEST_NULL;
  int idx[1];
  int rc = MPI_Irecv(buf, (int)n, MPI_FLOAT, src, tag, ctx->group[m].comm, &q);
  if (rc != MPI_SUCCESS) return unstage(&s, mpi_fail(rc, "recv", m), 0);
  int late = poll_all(1, &q, idx, NULL, deadline, "recv", m);
  if (late < 0) return unstage(&s, PG_ERR, 0);
  if (late) { /* a staged host buffer stays allocated: MPI may still write into it */
    char what[256], msg[512];
    describe(&ctx->group[m], &mine, what, sizeof what);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but rank %d never sent it",
             what, pg_mode_name(m), limit, global_rank(&ctx->group[m], src));
    return give_up(ctx, 1, &q, msg);
  }
  count(ctx, m, PG_COLL_RECV, (double)n * 4, t0);
  return unstage(&s, PG_OK, 1);
}

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
  const int64_t lo = block_start(n, D, s->rank), hi = block_start(n, D, s->rank + 1);
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
  if (check_ctx(ctx) || check_shm(s, op) || agree_coll(ctx, s->mode, coll, PG_FLOAT32, op, -1, n))
    return PG_ERR;
  double t0 = pg_wtime();
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  shm_reduce_block(s, n, op, everyone);
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  count(ctx, s->mode, coll, (double)n * sizeof(float), t0);
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
      agree_coll(ctx, s->mode, PG_COLL_ALL_GATHER, PG_FLOAT32, -1, -1, n))
    return PG_ERR;
  double t0 = pg_wtime();
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  float *mine = s->base[s->rank];
  for (int m = 0; m < s->size; m++) {
    if (m == s->rank) continue;
    int64_t lo = block_start(n, s->size, m), len = block_start(n, s->size, m + 1) - lo;
#pragma omp parallel for schedule(static) if (len > 32768)
    for (int64_t t = 0; t < len; t += 65536) {
      int64_t w = len - t < 65536 ? len - t : 65536;
      memcpy(mine + lo + t, s->base[m] + lo + t, (size_t)w * sizeof(float));
    }
  }
  if (shm_barrier(ctx, s->mode)) return PG_ERR;
  count(ctx, s->mode, PG_COLL_ALL_GATHER, (double)n * sizeof(float), t0);
  return PG_OK;
}
