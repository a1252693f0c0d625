/* Lua bindings for collectives: pg.dist.*. Each takes an options table with
 * group= (a mode name, default "global"), and ctx= (default: the last
 * ParallelContext created). Peers (src, dst) are local ranks in the group.
 *
 * Every one is collective over its group (send, recv and sendrecv over the
 * two ends) and agrees with the other members first (pg_comm.h): the call
 * carries its Lua call site, so a mismatch names the lines on both sides, and
 * a member that never arrives ends the call after PG_COLLECTIVE_TIMEOUT
 * seconds. Options are read before the site is set: an option error must
 * not leave a site behind for the runtime's next call. */
#include <limits.h>
#include <stdio.h>

#include "lua_util.h"
#include "pg_comm.h"
#include "pg_size.h"

/* The largest group an ireduce_scatter takes (its counts live on the C stack). */
#define PG_MAX_GROUP_SIZE_LUA 1024

pg_context *pg_lua_default_context(lua_State *L);

static pg_context *opt_ctx(lua_State *L, int idx) {
  if (!lua_isnoneornil(L, idx)) {
    luaL_checktype(L, idx, LUA_TTABLE);
    if (lua_getfield(L, idx, "ctx") != LUA_TNIL) {
      pg_context *c = pg_lua_check_context(L, -1);
      lua_pop(L, 1); /* referenced by the options table */
      return c;
    }
    lua_pop(L, 1);
  }
  return pg_lua_default_context(L);
}

static pg_mode opt_mode(lua_State *L, int idx) {
  pg_mode m;
  PG_LUA_CHECK(L, pg_mode_from_name(pg_lua_opt_string(L, idx, "group", "global"), &m));
  return m;
}

static pg_reduce_op opt_op(lua_State *L, int idx) {
  pg_reduce_op op;
  PG_LUA_CHECK(L, pg_reduce_op_from_name(pg_lua_opt_string(L, idx, "op", "sum"), &op));
  return op;
}

static int opt_dim(lua_State *L, int idx, const pg_tensor *t) {
  lua_Integer d = pg_lua_opt_int(L, idx, "dim", 1);
  if (d < 1 || d > t->ndim) luaL_error(L, "dim=%I out of range for a %d-d tensor", d, t->ndim);
  return (int)d - 1;
}

static const char *const coll_keys[] = {"group", "ctx", "op", "dim", "src", "dst", "tag", NULL};

#define from_caller pg_lua_from_caller
#define done pg_lua_comm_done

static int tag_opt(lua_State *L, int idx) { return (int)pg_lua_opt_int_in(L, idx, "tag", 0, 0, 32766); }

static int l_all_reduce(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  pg_lua_check_keys(L, 2, "all_reduce", coll_keys);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  pg_reduce_op op = opt_op(L, 2);
  from_caller(L, c);
  done(L, c, pg_all_reduce(c, m, t, op));
  lua_settop(L, 1);
  return 1;
}

static int l_all_gather(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  pg_lua_check_keys(L, 2, "all_gather", coll_keys);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  int dim = opt_dim(L, 2, t);
  from_caller(L, c);
  done(L, c, pg_all_gather(c, m, t, &out, dim));
  pg_lua_push_tensor(L, &out);
  return 1;
}

static int l_reduce_scatter(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  pg_lua_check_keys(L, 2, "reduce_scatter", coll_keys);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  int dim = opt_dim(L, 2, t);
  pg_reduce_op op = opt_op(L, 2);
  from_caller(L, c);
  done(L, c, pg_reduce_scatter(c, m, t, &out, dim, op));
  pg_lua_push_tensor(L, &out);
  return 1;
}

static int l_broadcast(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  pg_lua_check_keys(L, 2, "broadcast", coll_keys);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  int src = (int)pg_lua_opt_int_in(L, 2, "src", 0, 0, INT_MAX);
  from_caller(L, c);
  done(L, c, pg_broadcast(c, m, t, src));
  lua_settop(L, 1);
  return 1;
}

static int peer(lua_State *L, int idx, const char *key) {
  lua_Integer p = pg_lua_opt_int(L, idx, key, -1);
  if (p < 0) luaL_error(L, "option '%s' (a local rank in the group) is required", key);
  if (p > INT_MAX) luaL_error(L, "option '%s' must be an integer from 0 to %d, got %I", key, INT_MAX, p);
  return (int)p;
}

static int l_send(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  pg_lua_check_keys(L, 2, "send", coll_keys);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  int dst = peer(L, 2, "dst"), tag = tag_opt(L, 2);
  from_caller(L, c);
  done(L, c, pg_send(c, m, t, dst, tag));
  return 0;
}

static int l_recv(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  pg_lua_check_keys(L, 2, "recv", coll_keys);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  int src = peer(L, 2, "src"), tag = tag_opt(L, 2);
  from_caller(L, c);
  done(L, c, pg_recv(c, m, t, src, tag));
  lua_settop(L, 1);
  return 1;
}

/* sendrecv(send_tensor, recv_tensor, {dst=, src=}) */
static int l_sendrecv(lua_State *L) {
  pg_tensor *s = pg_lua_check_tensor(L, 1), *r = pg_lua_check_tensor(L, 2);
  pg_lua_check_keys(L, 3, "sendrecv", coll_keys);
  pg_context *c = opt_ctx(L, 3);
  pg_mode m = opt_mode(L, 3);
  int dst = peer(L, 3, "dst"), src = peer(L, 3, "src"), tag = tag_opt(L, 3);
  from_caller(L, c);
  done(L, c, pg_sendrecv(c, m, s, dst, r, src, tag));
  lua_settop(L, 2);
  return 1;
}

static int l_barrier(lua_State *L) {
  pg_lua_check_keys(L, 1, "barrier", coll_keys);
  pg_context *c = opt_ctx(L, 1);
  pg_mode m = opt_mode(L, 1);
  from_caller(L, c);
  done(L, c, pg_barrier(c, m));
  return 0;
}

/* The row counts of an all_to_all (option `key`, one per member of a group of
 * n), or the even split of `rows` when the option is absent. */
static void split_counts(lua_State *L, int idx, const char *key, int n, int64_t rows, int64_t *out) {
  if (lua_getfield(L, idx, key) == LUA_TNIL) {
    lua_pop(L, 1);
    if (rows % n) luaL_error(L, "all_to_all: %I rows do not split evenly over %d ranks; give %s= (rows per rank)",
                             (lua_Integer)rows, n, key);
    for (int j = 0; j < n; j++) out[j] = rows / n;
    return;
  }
  if (!lua_istable(L, -1)) luaL_error(L, "all_to_all: %s= must be a list of %d row counts, one per rank", key, n);
  char what[32];
  snprintf(what, sizeof what, "all_to_all: %s", key);
  int got = pg_lua_int_list(L, -1, what, out, n);
  if (got != n) luaL_error(L, "all_to_all: %s= has %d entries, but the group has %d ranks", key, got, n);
  for (int j = 0; j < n; j++)
    if (out[j] < 0 || out[j] > PG_MAX_NUMEL) luaL_error(L, "all_to_all: %s[%d] = %I is not a row count", key, j + 1,
                                                       (lua_Integer)out[j]);
  lua_pop(L, 1);
}

/* all_to_all(t, {send = {rows per rank}, recv = {rows per rank}, group=, ctx=}) -> new tensor:
 * t's rows (dimension 1) cut into consecutive blocks of send[j] rows, block j
 * to member j; the result stacks what member i sent here, recv[i] rows, in
 * member order (torch.distributed.all_to_all_single's input/output splits).
 * Both default to an even split. */
static int l_all_to_all(lua_State *L) {
  static const char *const keys[] = {"group", "ctx", "send", "recv", NULL};
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  pg_lua_check_keys(L, 2, "all_to_all", keys);
  lua_settop(L, 2); /* the counts' userdata goes above the options */
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  if (!t->storage) return luaL_error(L, "all_to_all: the tensor was freed");
  int n = c->group[m].size;
  int64_t rows = t->ndim ? t->shape[0] : 1, row = rows ? t->numel / rows : 0;
  int64_t *counts = lua_newuserdatauv(L, 4 * (size_t)n * sizeof *counts, 0); /* freed by the GC, also on errors */
  int64_t *sc = counts, *rc = counts + n, *se = counts + 2 * n, *re = counts + 3 * n;
  int64_t st = 0, rt = 0;
  if (!lua_isnoneornil(L, 2)) {
    split_counts(L, 2, "send", n, rows, sc);
    split_counts(L, 2, "recv", n, rows, rc);
  } else {
    if (rows % n) luaL_error(L, "all_to_all: %I rows do not split evenly over %d ranks; give send= and recv=",
                             (lua_Integer)rows, n);
    for (int j = 0; j < n; j++) sc[j] = rc[j] = rows / n;
  }
  for (int j = 0; j < n; j++) {
    st += sc[j];
    rt += rc[j];
    se[j] = sc[j] * row;
    re[j] = rc[j] * row;
  }
  if (st != rows) return luaL_error(L, "all_to_all: send= adds up to %I rows, but the tensor has %I", (lua_Integer)st,
                                    (lua_Integer)rows);
  int64_t shape[PG_MAX_DIMS];
  int ndim = t->ndim ? t->ndim : 1;
  for (int d = 0; d < ndim; d++) shape[d] = t->ndim ? t->shape[d] : 1;
  shape[0] = rt;
  PG_LUA_CHECK(L, pg_tensor_init(&out, t->dtype, ndim, shape));
  from_caller(L, c);
  int r = pg_all_to_all_v(c, m, pg_tensor_data(t), se, pg_tensor_data(&out), re, t->dtype);
  if (r) pg_tensor_release(&out);
  done(L, c, r);
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* mpi_alltoall(t, {ctx=, group=}): the bare MPI_Alltoall of t (float32, equal
 * blocks) into a new tensor, no checks or counters: the peer that benchmarks
 * compare all_to_all against. */
static int l_mpi_alltoall(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  int n = c->group[m].size;
  if (t->dtype != PG_FLOAT32) return luaL_error(L, "mpi_alltoall: float32 only");
  if (t->numel % n || t->numel / n > INT_MAX) return luaL_error(L, "mpi_alltoall: %d ranks do not split %I values",
                                                                n, (lua_Integer)t->numel);
  PG_LUA_CHECK(L, pg_tensor_init(&out, t->dtype, t->ndim, t->shape));
  if (MPI_Alltoall(pg_tensor_data(t), (int)(t->numel / n), MPI_FLOAT, pg_tensor_data(&out), (int)(t->numel / n),
                   MPI_FLOAT, c->group[m].comm) != MPI_SUCCESS) {
    pg_tensor_release(&out);
    return luaL_error(L, "MPI_Alltoall failed");
  }
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* mpi_allreduce(t, {ctx=, group=}): the bare MPI_Allreduce (sum, in place) with
 * no checks or counters — the peer that benchmarks compare all_reduce against. */
static int l_mpi_allreduce(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  if (t->dtype != PG_FLOAT32) return luaL_error(L, "mpi_allreduce: float32 only");
  if (MPI_Allreduce(MPI_IN_PLACE, pg_tensor_data(t), (int)t->numel, MPI_FLOAT, MPI_SUM, c->group[m].comm) != MPI_SUCCESS)
    return luaL_error(L, "MPI_Allreduce failed");
  return 0;
}

/* ---- nonblocking reductions: iall_reduce, ireduce_scatter -> request ----
 *
 * For a reduction overlapped with compute (DiLoCo's streaming fragments):
 * the members agree on the call first, as a blocking call does (call site,
 * kind, op, count: pg_agree_batch), then start it (pg_iall_reduce_buf /
 * pg_ireduce_scatter_buf, counted in comm_stats) and return a request.
 * request:wait() completes it (the collective deadline applies),
 * request:test() completes it if it is done and says whether it is. The
 * tensor is the buffer: it must not be read or written until the request
 * completes (the request keeps it alive). A request collected while in
 * flight is waited for first (MPI must not write freed memory). Host float32
 * tensors only. */
#define PG_REQUEST_MT "pipegoose.request"

typedef struct {
  pg_request *req;
  pg_context *ctx;
  int64_t lo, hi; /* the tensor's elements the reduction left final: [lo, hi) */
} lua_request;

static lua_request *check_request(lua_State *L) { return luaL_checkudata(L, 1, PG_REQUEST_MT); }

static int request_wait(lua_State *L) {
  lua_request *r = check_request(L);
  if (r->req && pg_wait(&r->req)) return luaL_error(L, "%s", pg_error());
  lua_getiuservalue(L, 1, 1); /* the tensor */
  return 1;
}

static int request_test(lua_State *L) {
  lua_request *r = check_request(L);
  int done_ = 1;
  if (r->req && pg_test(&r->req, &done_)) return luaL_error(L, "%s", pg_error());
  lua_pushboolean(L, done_);
  return 1;
}

static int request_gc(lua_State *L) {
  lua_request *r = check_request(L);
  if (r->req) pg_wait(&r->req); /* an error here has no one to go to: the job's watchdog reports it */
  return 0;
}

static int request_range(lua_State *L) {
  lua_request *r = check_request(L);
  lua_pushinteger(L, (lua_Integer)r->lo);
  lua_pushinteger(L, (lua_Integer)r->hi);
  return 2;
}

static int start_request(lua_State *L, int scatter) {
  static const char *const keys[] = {"group", "ctx", "op", NULL};
  const char *name = scatter ? "ireduce_scatter" : "iall_reduce";
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  pg_lua_check_keys(L, 2, name, keys);
  pg_context *c = opt_ctx(L, 2);
  pg_mode m = opt_mode(L, 2);
  pg_reduce_op op = opt_op(L, 2);
  if (t->dtype != PG_FLOAT32) return luaL_error(L, "%s: takes a float32 tensor, got %s", name, pg_dtype_name(t->dtype));
  if (!t->storage) return luaL_error(L, "%s: the tensor was freed", name);
  int n = c->group[m].size;
  int64_t counts[PG_MAX_GROUP_SIZE_LUA];
  if (scatter) {
    if (n > PG_MAX_GROUP_SIZE_LUA) return luaL_error(L, "%s: a group of %d ranks (at most %d)", name, n,
                                                     PG_MAX_GROUP_SIZE_LUA);
    if (t->numel % n) return luaL_error(L, "%s: %I elements do not split evenly over %d ranks", name,
                                        (lua_Integer)t->numel, n);
    for (int j = 0; j < n; j++) counts[j] = t->numel / n;
  }
  lua_request *r = lua_newuserdatauv(L, sizeof *r, 2);
  r->req = NULL;
  r->ctx = c;
  int me = c->group[m].rank;
  r->lo = scatter ? (int64_t)me * (t->numel / n) : 0;
  r->hi = scatter ? r->lo + t->numel / n : t->numel;
  luaL_setmetatable(L, PG_REQUEST_MT);
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1);
  if (lua_getfield(L, 2, "ctx") != LUA_TNIL) lua_setiuservalue(L, -2, 2); /* the context outlives the request */
  else lua_pop(L, 1);
  char site[PG_SITE_MAX] = "";
  lua_Debug ar;
  if (lua_getstack(L, 1, &ar) && lua_getinfo(L, "Sl", &ar) && ar.currentline > 0)
    snprintf(site, sizeof site, "%s:%d", ar.short_src, ar.currentline);
  int rc = pg_agree_batch(c, m, scatter ? PG_COLL_REDUCE_SCATTER : PG_COLL_ALL_REDUCE, op, t->numel, site);
  if (rc == PG_OK)
    rc = scatter ? pg_ireduce_scatter_buf(c, m, pg_tensor_data(t), counts, op, &r->req)
                 : pg_iall_reduce_buf(c, m, pg_tensor_data(t), t->numel, op, &r->req);
  done(L, c, rc);
  return 1;
}

/* iall_reduce(t, {group=, ctx=, op = "sum" | "avg"}) -> request: t reduced in place once it completes. */
static int l_iall_reduce(lua_State *L) { return start_request(L, 0); }

/* ireduce_scatter(t, {group=, ctx=, op=}) -> request: t cut into equal pieces, one per member; once it
 * completes, this member's piece (request:range(), 0-based [lo, hi)) holds the reduction of everyone's, in
 * its place; the rest of t holds partial results. */
static int l_ireduce_scatter(lua_State *L) { return start_request(L, 1); }

static const luaL_Reg dist_functions[] = {{"iall_reduce", l_iall_reduce}, {"ireduce_scatter", l_ireduce_scatter}, {"mpi_allreduce", l_mpi_allreduce}, {"mpi_alltoall", l_mpi_alltoall}, {"all_to_all", l_all_to_all},{"all_reduce", l_all_reduce}, {"all_gather", l_all_gather},
                                          {"reduce_scatter", l_reduce_scatter}, {"broadcast", l_broadcast},
                                          {"send", l_send}, {"recv", l_recv}, {"sendrecv", l_sendrecv},
                                          {"barrier", l_barrier}, {NULL, NULL}};

void pg_lua_open_dist(lua_State *L) {
  if (luaL_newmetatable(L, PG_REQUEST_MT)) {
    static const luaL_Reg methods[] = {{"wait", request_wait}, {"test", request_test}, {"range", request_range},
                                       {NULL, NULL}};
    luaL_newlib(L, methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, request_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  luaL_newlib(L, dist_functions);
  lua_setfield(L, -2, "dist");
}
