/* Lua bindings for the parallel context: pg.ParallelContext{...} and its
 * methods. Ranks are 0-based, as in MPI. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua_util.h"
#include "pg_clock.h"
#include "pg_comm.h"

/* Registry key of the default context used by pg.dist when no ctx= is given. */
static const char default_ctx_key = 'c';

static int started_mpi_here = 0;

static void finalize_at_exit(void) { pg_mpi_finalize(); }

/* In pglua MPI is up before any script runs; under a plain lua5.4 it starts
 * here, on first use, as a world of one (singleton) or under mpirun. */
static void ensure_mpi(lua_State *L) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) return;
  if (pg_mpi_init(NULL, NULL)) luaL_error(L, "%s", pg_error());
  if (pg_setup_threads() < 0) luaL_error(L, "%s", pg_error());
  if (!started_mpi_here) atexit(finalize_at_exit);
  started_mpi_here = 1;
}

pg_context *pg_lua_check_context(lua_State *L, int idx) {
  pg_context *c = luaL_checkudata(L, idx, PG_CONTEXT_MT);
  if (c->destroyed) luaL_error(L, "the parallel context was destroyed");
  return c;
}

static int size_field(lua_State *L, const char *key, int world) {
  if (lua_getfield(L, 1, key) == LUA_TNIL) {
    lua_pop(L, 1);
    return 1;
  }
  int isint = 0;
  lua_Integer v = lua_tointegerx(L, -1, &isint);
  if (!isint || v < 1 || v > 1 << 20)
    luaL_error(L, "ParallelContext: %s=%s must be a positive integer (world size %d)", key, luaL_tolstring(L, -1, NULL), world);
  lua_pop(L, 1);
  return (int)v;
}

/* data not given: the ranks tensor, pipeline and context leave, as
 * Megatron-LM and torchtitan infer it (an explicit data keeps
 * pg_context_init's check that the product is the world). */
static int infer_data(lua_State *L, int world, int tp, int pp, int cp) {
  long tpp = (long)tp * pp * cp;
  if (world % tpp) {
    if (cp > 1)
      luaL_error(L, "ParallelContext: tensor=%d x pipeline=%d x context=%d = %I ranks does not divide the world size "
                 "%d, so data (not given) cannot be inferred as world / (tensor x pipeline x context)", tp, pp, cp,
                 (lua_Integer)tpp, world);
    luaL_error(L, "ParallelContext: tensor=%d x pipeline=%d = %I ranks does not divide the world size %d, so data "
               "(not given) cannot be inferred as world / (tensor x pipeline)", tp, pp, (lua_Integer)tpp, world);
  }
  return (int)(world / tpp);
}

static int l_new(lua_State *L) {
  static const char *const keys[] = {"tensor", "pipeline", "data", "expert", "context", "seed", "self", "islands", NULL};
  pg_lua_check_keys(L, 1, "ParallelContext", keys); /* and that it is a table */
  lua_settop(L, 1);
  if (lua_isnil(L, 1)) {
    lua_newtable(L);
    lua_replace(L, 1);
  }
  ensure_mpi(L);
  /* self = true: a world of this process alone (a serial reference inside a job). */
  int self = pg_lua_opt_bool(L, 1, "self", 0);
  MPI_Comm world_comm = self ? MPI_COMM_SELF : MPI_COMM_WORLD;
  int world = 1;
  MPI_Comm_size(world_comm, &world);
  /* islands = k (DiLoCo): the layout below is each island's, of world / k ranks */
  int islands = size_field(L, "islands", world);
  if (world % islands)
    return luaL_error(L, "ParallelContext: islands=%d must divide the world size %d", islands, world);
  world /= islands;
  int tp = size_field(L, "tensor", world), pp = size_field(L, "pipeline", world);
  int cp = size_field(L, "context", world);
  int inferred = lua_getfield(L, 1, "data") == LUA_TNIL;
  lua_pop(L, 1);
  int dp = inferred ? infer_data(L, world, tp, pp, cp) : size_field(L, "data", world);
  int ep = size_field(L, "expert", world);
  uint64_t seed = (uint64_t)pg_lua_opt_int(L, 1, "seed", 1234);
  /* user value 1: whether data was inferred (tostring says so) */
  pg_context *c = lua_newuserdatauv(L, sizeof *c, 1);
  memset(c, 0, sizeof *c);
  c->destroyed = 1;
  luaL_setmetatable(L, PG_CONTEXT_MT);
  lua_pushboolean(L, inferred);
  lua_setiuservalue(L, -2, 1);
  if (pg_context_init_islands(c, world_comm, islands, tp, pp, dp, ep, cp, seed))
    return luaL_error(L, "ParallelContext: %s", pg_error());
  if (pg_comm_init(c)) {
    pg_context_destroy(c);
    return luaL_error(L, "ParallelContext: %s", pg_error());
  }
  if (!self) { /* the default for pg.dist stays the job-wide one */
    lua_pushvalue(L, -1);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &default_ctx_key);
  }
  return 1;
}

pg_context *pg_lua_default_context(lua_State *L) {
  lua_rawgetp(L, LUA_REGISTRYINDEX, &default_ctx_key);
  pg_context *c = luaL_testudata(L, -1, PG_CONTEXT_MT);
  lua_pop(L, 1); /* kept alive by the registry */
  if (!c || c->destroyed) luaL_error(L, "no parallel context: create one with pg.ParallelContext{...} or pass ctx=");
  return c;
}

static pg_mode check_mode(lua_State *L, int idx, const char *def) {
  const char *name = def ? luaL_optstring(L, idx, def) : luaL_checkstring(L, idx);
  pg_mode m;
  PG_LUA_CHECK(L, pg_mode_from_name(name, &m));
  return m;
}

/* rank(): the global rank; rank(group): the place in that group (as local_rank). */
static int l_rank(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  lua_pushinteger(L, lua_isnoneornil(L, 2) ? c->rank : c->group[check_mode(L, 2, NULL)].rank);
  return 1;
}

static int l_world_size(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  lua_pushinteger(L, c->group[check_mode(L, 2, "global")].size);
  return 1;
}

static int l_local_rank(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  lua_pushinteger(L, c->group[check_mode(L, 2, "global")].rank);
  return 1;
}

static int l_ranks(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  pg_group *g = &c->group[check_mode(L, 2, "global")];
  lua_createtable(L, g->size, 0);
  for (int i = 0; i < g->size; i++) {
    lua_pushinteger(L, g->ranks[i]);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_next_rank(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  lua_pushinteger(L, pg_context_ring_rank(c, check_mode(L, 2, "global"), 1));
  return 1;
}

static int l_prev_rank(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  lua_pushinteger(L, pg_context_ring_rank(c, check_mode(L, 2, "global"), -1));
  return 1;
}

static int l_is_first(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  lua_pushboolean(L, c->group[check_mode(L, 2, "global")].rank == 0);
  return 1;
}

static int l_is_last(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  pg_group *g = &c->group[check_mode(L, 2, "global")];
  lua_pushboolean(L, g->rank == g->size - 1);
  return 1;
}

static int l_barrier(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  pg_mode m = check_mode(L, 2, "global");
  pg_lua_from_caller(L, c);
  pg_lua_comm_done(L, c, pg_barrier(c, m));
  return 0;
}

static int l_sizes(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  lua_createtable(L, 0, 6);
  lua_pushinteger(L, c->islands);
  lua_setfield(L, -2, "islands");
  lua_pushinteger(L, c->tensor);
  lua_setfield(L, -2, "tensor");
  lua_pushinteger(L, c->context);
  lua_setfield(L, -2, "context");
  lua_pushinteger(L, c->pipeline);
  lua_setfield(L, -2, "pipeline");
  lua_pushinteger(L, c->data);
  lua_setfield(L, -2, "data");
  lua_pushinteger(L, c->expert);
  lua_setfield(L, -2, "expert");
  lua_pushinteger(L, c->world_size);
  lua_setfield(L, -2, "world");
  return 1;
}

static int l_seed(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)pg_lua_check_context(L, 1)->seed);
  return 1;
}

/* stream_seed(name): the derived seed of a random stream (see pg_context.h). */
static int l_stream_seed(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  static const char *const names[] = {"weights", "replicated", "sharded", "data", NULL};
  int s = luaL_checkoption(L, 2, NULL, names);
  lua_pushinteger(L, (lua_Integer)pg_context_stream_seed(c, (pg_stream)s));
  return 1;
}

/* comm_stats() -> { [mode] = { [kind] = {calls=, bytes=, seconds=} } } for kinds with calls; send and recv
 * also {direct=}: those NCCL carried device to device. */
static int l_comm_stats(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  const pg_comm_stats *st = pg_comm_stats_of(c);
  lua_newtable(L);
  for (int m = 0; m < PG_NUM_MODES; m++) {
    lua_newtable(L);
    for (int k = 0; k < PG_NUM_COLLS; k++) {
      lua_createtable(L, 0, 3);
      lua_pushinteger(L, st->calls[m][k]);
      lua_setfield(L, -2, "calls");
      lua_pushnumber(L, st->bytes[m][k]);
      lua_setfield(L, -2, "bytes");
      lua_pushnumber(L, st->seconds[m][k]);
      lua_setfield(L, -2, "seconds");
      if (k == PG_COLL_SEND || k == PG_COLL_RECV) {
        lua_pushinteger(L, st->direct[m][k]);
        lua_setfield(L, -2, "direct");
      }
      lua_setfield(L, -2, pg_coll_name((pg_coll)k));
    }
    lua_setfield(L, -2, pg_mode_name((pg_mode)m));
  }
  return 1;
}

static int l_reset_comm_stats(lua_State *L) {
  pg_context *c = pg_lua_check_context(L, 1);
  pg_comm_stats_reset(c);
  return 0;
}

static int l_destroy(lua_State *L) {
  pg_context *c = luaL_checkudata(L, 1, PG_CONTEXT_MT);
  pg_comm_release(c); /* communication first: it uses the groups */
  pg_context_destroy(c);
  return 0;
}

static int l_tostring(lua_State *L) {
  pg_context *c = luaL_checkudata(L, 1, PG_CONTEXT_MT);
  if (c->destroyed) {
    lua_pushstring(L, "ParallelContext(destroyed)");
    return 1;
  }
  lua_getiuservalue(L, 1, 1);
  const char *how = "";
  if (lua_toboolean(L, -1))
    how = lua_pushfstring(L, " (inferred from %d rank%s)", c->world_size, c->world_size == 1 ? "" : "s");
  if (c->islands > 1) how = lua_pushfstring(L, "%s, island %d/%d", how, c->island, c->islands);
  if (c->context > 1) /* its own form: the dimension is named only where it is used */
    lua_pushfstring(L,
                    "ParallelContext(rank %d of %d: tensor %d/%d, context %d/%d, pipeline %d/%d, data %d/%d%s, "
                    "expert %d/%d, seed %I)",
                    c->rank, c->world_size, c->tp_rank, c->tensor, c->cp_rank, c->context, c->pp_rank, c->pipeline,
                    c->dp_rank, c->data, how, c->ep_rank, c->expert, (lua_Integer)c->seed);
  else if (c->expert > 1)
    lua_pushfstring(L,
                    "ParallelContext(rank %d of %d: tensor %d/%d, pipeline %d/%d, data %d/%d%s, expert %d/%d, seed %I)",
                    c->rank, c->world_size, c->tp_rank, c->tensor, c->pp_rank, c->pipeline, c->dp_rank, c->data, how,
                    c->ep_rank, c->expert, (lua_Integer)c->seed);
  else
    lua_pushfstring(L, "ParallelContext(rank %d of %d: tensor %d/%d, pipeline %d/%d, data %d/%d%s, seed %I)", c->rank,
                    c->world_size, c->tp_rank, c->tensor, c->pp_rank, c->pipeline, c->dp_rank, c->data, how,
                    (lua_Integer)c->seed);
  return 1;
}

static const luaL_Reg context_methods[] = {
    {"rank", l_rank}, {"world_size", l_world_size}, {"local_rank", l_local_rank}, {"ranks", l_ranks},
    {"next_rank", l_next_rank}, {"prev_rank", l_prev_rank}, {"is_first", l_is_first}, {"is_last", l_is_last},
    {"barrier", l_barrier}, {"sizes", l_sizes}, {"seed", l_seed}, {"stream_seed", l_stream_seed},
    {"comm_stats", l_comm_stats}, {"reset_comm_stats", l_reset_comm_stats}, {"destroy", l_destroy},
    {NULL, NULL}};

static int l_mpi_rank(lua_State *L) {
  lua_pushinteger(L, pg_mpi_world_rank());
  return 1;
}

static int l_mpi_size(lua_State *L) {
  lua_pushinteger(L, pg_mpi_world_size());
  return 1;
}

/* pg.wtime(): the runtime's clock (pg_clock.h), monotonic seconds. */
static int l_wtime(lua_State *L) {
  lua_pushnumber(L, pg_wtime());
  return 1;
}

static int l_num_threads(lua_State *L) {
  lua_pushinteger(L, pg_num_threads());
  return 1;
}

/* pg.node() -> { host =, rank =, size =, hosts = }: this process's host name, its place among the
 * ranks on its node (pg_node_split: MPI_COMM_TYPE_SHARED or PG_RANKS_PER_NODE) and how many distinct
 * host names the world has, as start-up found them. */
static int l_node(lua_State *L) {
  lua_createtable(L, 0, 4);
  lua_pushstring(L, pg_host_of_world_rank(pg_mpi_world_rank()));
  lua_setfield(L, -2, "host");
  lua_pushinteger(L, pg_node_rank());
  lua_setfield(L, -2, "rank");
  lua_pushinteger(L, pg_node_size());
  lua_setfield(L, -2, "size");
  lua_pushinteger(L, pg_host_count());
  lua_setfield(L, -2, "hosts");
  return 1;
}

void pg_lua_open_context(lua_State *L) {
  if (luaL_newmetatable(L, PG_CONTEXT_MT)) {
    luaL_newlib(L, context_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_destroy);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_tostring);
    lua_setfield(L, -2, "__tostring");
  }
  lua_pop(L, 1);
  lua_pushcfunction(L, l_new);
  lua_setfield(L, -2, "ParallelContext");
  lua_pushcfunction(L, l_mpi_rank);
  lua_setfield(L, -2, "world_rank");
  lua_pushcfunction(L, l_mpi_size);
  lua_setfield(L, -2, "world_size");
  lua_pushcfunction(L, l_num_threads);
  lua_setfield(L, -2, "num_threads");
  lua_pushcfunction(L, l_wtime);
  lua_setfield(L, -2, "wtime");
  lua_pushcfunction(L, l_node);
  lua_setfield(L, -2, "node");
}
