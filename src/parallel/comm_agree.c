#include "comm_impl.h"
#include "pg_env.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* PG_COLLECTIVE_TIMEOUT in seconds, read once: 600 when unset, 0 = no limit.
 * Anything else than a number of seconds is an error at the first call. */
static double collective_timeout(int *bad) {
  static double limit = -1;
  static int invalid;
  if (limit < 0) {
    double v = 600;
    invalid = pg_env_double("PG_COLLECTIVE_TIMEOUT", &v) != PG_OK;
    limit = invalid ? 600 : v;
  }
  *bad = invalid;
  return limit;
}

int comm_timeout_ok(double *limit) {
  int bad = 0;
  *limit = collective_timeout(&bad);
  if (bad) return pg_env_double("PG_COLLECTIVE_TIMEOUT", limit); /* the parser's error again */
  return PG_OK;
}

/* PG_DEBUG=1: the pipeline's transfers are checked too (records ahead of the data). */
int comm_debug_checks(void) {
  static int on = -1;
  if (on < 0) {
    if (pg_env_bool("PG_DEBUG", &on)) on = 0; /* refused at start-up */
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
  if (ctx && ctx->comm) copy_site(ctx->comm->site, site);
}

static const char *kind_name(int kind) { return kind == PG_KIND_SENDRECV ? "sendrecv" : pg_coll_name((pg_coll)kind); }

int comm_global_rank(const pg_group *g, int local) { return local >= 0 && local < g->size ? g->ranks[local] : local; }

/* "4", or "4 on pghost2" when the world spans more than one host: member
 * `local` of g as the watchdog names it (its rank in the context, its host
 * from the names exchanged at start-up: a rank that never arrived may be on
 * a host that is gone). */
void comm_rank_name(const pg_group *g, int local, char *buf, size_t n) {
  int rank = comm_global_rank(g, local);
  snprintf(buf, n, "%d", rank);
  if (pg_host_count() < 2 || local < 0 || local >= g->size) return;
  MPI_Group mine, world;
  int in_world = MPI_UNDEFINED;
  if (MPI_Comm_group(g->comm, &mine) != MPI_SUCCESS) return;
  if (MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
    MPI_Group_translate_ranks(mine, 1, &local, world, &in_world);
    MPI_Group_free(&world);
  }
  MPI_Group_free(&mine);
  if (in_world != MPI_UNDEFINED && pg_host_of_world_rank(in_world)[0])
    snprintf(buf, n, "%d on %s", rank, pg_host_of_world_rank(in_world));
}

/* "all_reduce of 12 float32 values (op sum, spec.lua:10)": a record in words, peers as global ranks. */
void comm_describe(const pg_group *g, const call_rec *c, char *buf, size_t n) {
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
    k = snprintf(buf, n, "broadcast of %lld %s values from rank %d", (long long)c->count, dt, comm_global_rank(g, c->root));
    break;
  case PG_COLL_BARRIER: k = snprintf(buf, n, "barrier"); break;
  case PG_COLL_ALL_TO_ALL: k = snprintf(buf, n, "all_to_all of %s values", dt); break;
  case PG_COLL_SEND:
    k = snprintf(buf, n, "send of %lld %s values to rank %d", (long long)c->count, dt, comm_global_rank(g, c->dst));
    break;
  case PG_COLL_RECV:
    k = snprintf(buf, n, "recv of %lld %s values from rank %d", (long long)c->recv_count,
                 c->recv_dtype >= 0 ? pg_dtype_name((pg_dtype)c->recv_dtype) : "?", comm_global_rank(g, c->src));
    break;
  case PG_KIND_SENDRECV:
    k = snprintf(buf, n, "sendrecv of %lld %s values to rank %d and %lld %s values from rank %d", (long long)c->count,
                 dt, comm_global_rank(g, c->dst), (long long)c->recv_count,
                 c->recv_dtype >= 0 ? pg_dtype_name((pg_dtype)c->recv_dtype) : "?", comm_global_rank(g, c->src));
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
call_rec comm_make_rec(pg_context *ctx, pg_mode m, int kind, int dtype, int op, int64_t count) {
  call_rec c;
  memset(&c, 0, sizeof c);
  c.kind = kind;
  c.dtype = (int32_t)dtype;
  c.op = op;
  c.root = c.dst = c.src = c.recv_dtype = -1;
  c.me = ctx->group[m].rank;
  c.count = count;
  copy_site(c.site, ctx->comm->site);
  ctx->comm->site[0] = 0; /* a site names one call */
  return c;
}

/* Scratch for n records, 2n requests and 3n ints (indices for MPI_Testsome,
 * then the member of each receive), kept on the context: a call that timed
 * out leaves sends and receives from it in flight, and the context, broken
 * then, never frees it. */
int comm_scratch(pg_context *ctx, int n, call_rec **recs, MPI_Request **reqs, int **idx) {
  size_t need = (size_t)n * (sizeof **recs + 2 * sizeof **reqs + 3 * sizeof **idx);
  if (need > ctx->comm->agree_scratch_bytes) {
    void *p = realloc(ctx->comm->agree_scratch, need);
    if (!p) return pg_fail("out of memory for the records of %d ranks", n);
    ctx->comm->agree_scratch = p;
    ctx->comm->agree_scratch_bytes = need;
  }
  *recs = ctx->comm->agree_scratch;
  *reqs = (MPI_Request *)(*recs + n);
  *idx = (int *)(*reqs + 2 * n);
  return PG_OK;
}

/* Polls the n requests until all are done (0), the deadline passes (1; the
 * ones still pending are left so: the caller names them), or MPI fails
 * (PG_ERR). deadline <= 0: none. */
int comm_poll_all(int n, MPI_Request *reqs, int *idx, MPI_Status *st, double deadline, const char *what, pg_mode m) {
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

int comm_give_up(pg_context *ctx, int n, MPI_Request *reqs, const char *msg) {
  waited_in_vain = 1;
  for (int i = 0; i < n; i++) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&reqs[i]);
    MPI_Request_free(&reqs[i]);
  }
  if (!ctx->comm->broken) ctx->comm->broken = strdup(msg);
  return pg_fail("%s", msg);
}

int comm_disagree(pg_context *ctx, const char *msg) {
  if (!ctx->comm->broken) ctx->comm->broken = strdup(msg);
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
    char name[PG_HOST_MAX + 16];
    comm_rank_name(g, members[i], name, sizeof name);
    k += (size_t)snprintf(buf + k, len - k, first ? "%s" : ", %s", name);
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
  if (comm_timeout_ok(&limit)) return PG_ERR;
  int n = g->size;
  call_rec *recs = NULL;
  MPI_Request *reqs = NULL;
  int *idx = NULL;
  if (comm_scratch(ctx, n, &recs, &reqs, &idx)) return PG_ERR;
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
  int late = comm_poll_all(2 * n, reqs, idx, NULL, limit > 0 ? pg_wtime() + limit : 0, kind_name(c->kind), m);
  if (late < 0) return PG_ERR;
  char mine[256], msg[1024];
  if (late) {
    char who[512];
    comm_describe(g, c, mine, sizeof mine);
    pending_ranks(g, n, reqs, members, who, sizeof who);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but %s never arrived", mine,
             pg_mode_name(m), limit, who);
    return comm_give_up(ctx, 2 * n, reqs, msg);
  }
  for (int i = 1; i < n; i++)
    if (!same_call(&recs[i], &recs[0])) {
      char other[256];
      comm_describe(g, &recs[i], other, sizeof other);
      comm_describe(g, &recs[0], mine, sizeof mine);
      snprintf(msg, sizeof msg, "%s over the %s group: rank %d called %s, rank %d called %s", kind_name(recs[0].kind),
               pg_mode_name(m), comm_global_rank(g, i), other, comm_global_rank(g, 0), mine);
      return comm_disagree(ctx, msg);
    }
  return PG_OK;
}

/* Whether sender s's record and receiver r's record describe one transfer. */
int comm_pair_matches(const call_rec *s, const call_rec *r) {
  return (s->kind == PG_COLL_SEND || s->kind == PG_KIND_SENDRECV) &&
         (r->kind == PG_COLL_RECV || r->kind == PG_KIND_SENDRECV) && s->dst == r->me && r->src == s->me &&
         s->tag == r->tag && s->dtype == r->recv_dtype && s->count == r->recv_count;
}

int comm_pair_message(pg_context *ctx, const pg_group *g, pg_mode m, const call_rec *s, const call_rec *r) {
  char a[256], b[256], msg[700];
  comm_describe(g, s, a, sizeof a);
  comm_describe(g, r, b, sizeof b);
  snprintf(msg, sizeof msg, "%s over the %s group: rank %d called %s, but rank %d called %s", kind_name(s->kind),
           pg_mode_name(m), comm_global_rank(g, s->me), a, comm_global_rank(g, r->me), b);
  return comm_disagree(ctx, msg);
}

/* Point to point: records exchanged with the peers (dst and src, once each,
 * not ourselves), each transfer checked from both ends. */
int comm_agree_pair(pg_context *ctx, pg_mode m, call_rec *c) {
  pg_group *g = &ctx->group[m];
  double limit;
  if (comm_timeout_ok(&limit)) return PG_ERR;
  int peers[2], np = 0;
  if (c->dst >= 0 && c->dst != g->rank) peers[np++] = c->dst;
  if (c->src >= 0 && c->src != g->rank && (np == 0 || peers[0] != c->src)) peers[np++] = c->src;
  if (np == 0) return PG_OK;
  call_rec *recs = NULL; /* [0], [1]: the peers'; [2]: ours, sent */
  MPI_Request *reqs = NULL;
  int *idx = NULL;
  if (comm_scratch(ctx, 3, &recs, &reqs, &idx)) return PG_ERR;
  recs[2] = *c;
  for (int i = 0; i < 4; i++) reqs[i] = MPI_REQUEST_NULL;
  for (int i = 0; i < np; i++) {
    int rc = MPI_Irecv(&recs[i], (int)sizeof *recs, MPI_BYTE, peers[i], PG_AGREE_TAG, g->agree, &reqs[i]);
    if (rc == MPI_SUCCESS)
      rc = MPI_Isend(&recs[2], (int)sizeof *recs, MPI_BYTE, peers[i], PG_AGREE_TAG, g->agree, &reqs[2 + i]);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, kind_name(c->kind), m);
  }
  int late = comm_poll_all(4, reqs, idx, NULL, limit > 0 ? pg_wtime() + limit : 0, kind_name(c->kind), m);
  if (late < 0) return PG_ERR;
  if (late) {
    char mine[256], who[256], msg[700];
    comm_describe(g, c, mine, sizeof mine);
    pending_ranks(g, 2, reqs, peers, who, sizeof who);
    snprintf(msg, sizeof msg, "%s over the %s group: waited %g s (PG_COLLECTIVE_TIMEOUT) but %s never arrived", mine,
             pg_mode_name(m), limit, who);
    return comm_give_up(ctx, 4, reqs, msg);
  }
  for (int i = 0; i < np; i++) {
    const call_rec *p = &recs[i];
    if (peers[i] == c->dst && !comm_pair_matches(c, p)) return comm_pair_message(ctx, g, m, c, p);
    if (peers[i] == c->src && !comm_pair_matches(p, c)) return comm_pair_message(ctx, g, m, p, c);
  }
  return PG_OK;
}

/* The agreement step of a gather or scatter of tensor t along dim: the shapes agree too. */
int comm_agree_shape(pg_context *ctx, pg_mode m, pg_coll kind, const pg_tensor *t, int dim, int op) {
  if (ctx->group[m].size == 1) {
    ctx->comm->site[0] = 0;
    return PG_OK;
  }
  call_rec c = comm_make_rec(ctx, m, kind, t->dtype, op, t->numel);
  c.ndim = t->ndim;
  c.dim = dim;
  memcpy(c.shape, t->shape, sizeof c.shape);
  return agree(ctx, m, &c);
}

/* The agreement step of a collective on group m (none for a group of one). */
int comm_agree_coll(pg_context *ctx, pg_mode m, pg_coll kind, int dtype, int op, int root, int64_t count) {
  if (ctx->group[m].size == 1) {
    ctx->comm->site[0] = 0;
    return PG_OK;
  }
  call_rec c = comm_make_rec(ctx, m, kind, dtype, op, count);
  c.root = root;
  return agree(ctx, m, &c);
}
