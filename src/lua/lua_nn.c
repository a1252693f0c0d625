/* Lua bindings for building a stage and running the engine:
 *   core.Engine(ctx, stage_desc, opts) -> engine userdata
 *   core.module_kinds() -> {name = {traits...}}: the runtime's registry of kinds
 * stage_desc is a tree of plain tables made by lua/pipegoose/parallel.lua
 * ({kind=, name=, ...}). This file walks the tree, asking the registry how
 * each kind is assembled: containers (sequential, residual, recompute) from
 * the children it builds first, modules written in Lua (kind "lua") through
 * pg_custom_new with callbacks into the table, and every other kind by the
 * runtime (pg_module_build) through a pg_desc that reads the table. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua_util.h"
#include "pg_backend.h"
#include "pg_engine.h"
#include "pg_size.h"

#define PG_ENGINE_MT "pg.Engine"

typedef struct engine_ud {
  pg_engine *e;
  lua_State *current; /* the thread calling into the engine: Lua modules run on it */
  lua_State *owner;   /* the state holding objective_ref */
  int objective_ref;  /* the Lua objective the stage's objective module calls (LUA_NOREF: none set) */
} engine_ud;

/* ---------------------------------------------------------------- Lua modules */

typedef struct lua_module_ud {
  lua_State **current; /* -> engine_ud.current (userdata memory does not move) */
  lua_State *owner;    /* the state holding the registry reference */
  int ref;             /* the Lua module table */
  int in_w, out_w;
} lua_module_ud;

/* Calls module:method(slot, x, info) with x copied into a [rows, in] tensor
 * (rows = B*T, batch-major) on the module's backend be and info = {batch = B,
 * seq_len = T, device = "cpu" | "cuda:N"}; copies the returned [rows, out]
 * tensor, which must be on be too, to y. x and y are be's memory. The
 * argument is a copy, not a view of the engine's buffer, because the module
 * may keep it (for its backward) and a view would outlive the buffer when the
 * engine goes first. */
static int call_lua_module(lua_module_ud *u, const pg_backend *be, const char *method, int slot, const pg_io *io,
                           const float *x, int rows, int in_w, float *y, int out_w) {
  lua_State *L = *u->current;
  int top = lua_gettop(L);
  char where[48];
  pg_backend_place(be, where, sizeof where);
  lua_rawgeti(L, LUA_REGISTRYINDEX, u->ref);
  if (lua_getfield(L, -1, method) != LUA_TFUNCTION) {
    lua_settop(L, top);
    return pg_fail("module written in Lua has no %s method", method);
  }
  lua_pushvalue(L, -2);
  lua_pushinteger(L, slot + 1);
  int64_t shape[2] = {rows, in_w};
  pg_tensor *t = lua_newuserdatauv(L, sizeof *t, 0);
  memset(t, 0, sizeof *t);
  luaL_setmetatable(L, PG_TENSOR_MT);
  size_t in_bytes = (size_t)rows * in_w * sizeof(float), out_bytes = (size_t)rows * out_w * sizeof(float);
  if (pg_backend_tensor(be, t, PG_FLOAT32, 2, shape) ||
      be->ops->copy(be, pg_tensor_data(t), x, in_bytes, PG_COPY_DEVICE_TO_DEVICE)) { /* be's memory to be's */
    lua_settop(L, top);
    return PG_ERR;
  }
  lua_createtable(L, 0, 3);
  lua_pushinteger(L, io->B);
  lua_setfield(L, -2, "batch");
  lua_pushinteger(L, io->T);
  lua_setfield(L, -2, "seq_len");
  lua_pushstring(L, where);
  lua_setfield(L, -2, "device");
  if (lua_pcall(L, 4, 1, 0) != LUA_OK) {
    int rc = pg_fail("%s", lua_tostring(L, -1));
    lua_settop(L, top);
    return rc;
  }
  pg_tensor *r = pg_lua_test_tensor(L, -1);
  int ok = r && r->storage && r->dtype == PG_FLOAT32 && r->numel == (int64_t)rows * out_w;
  if (!ok) {
    char d[128] = "a non-tensor";
    if (r && r->storage) pg_tensor_describe(r, d, sizeof d);
    lua_settop(L, top);
    return pg_fail("module written in Lua: %s returned %s, expected %d x %d float32 values", method, d, rows, out_w);
  }
  const pg_backend *rb = pg_backend_of(r->storage);
  if (rb != be) {
    char got[48] = "?";
    if (rb) pg_backend_place(rb, got, sizeof got);
    lua_settop(L, top);
    return pg_fail("module written in Lua: %s returned a %s tensor, but the engine runs on %s: return one on its "
                   "device (pg.ops on the argument make one there; t:to(info.device) copies)",
                   method, got, where);
  }
  int rc = be->ops->copy(be, y, pg_tensor_data(r), out_bytes, PG_COPY_DEVICE_TO_DEVICE);
  lua_settop(L, top);
  return rc;
}

static int lua_module_forward(void *ud, const pg_backend *be, int slot, const pg_io *io, const float *x, int rows,
                              float *y) {
  lua_module_ud *u = ud;
  return call_lua_module(u, be, "forward", slot, io, x, rows, u->in_w, y, u->out_w);
}

static int lua_module_backward(void *ud, const pg_backend *be, int slot, const pg_io *io, const float *dy, int rows,
                               float *dx) {
  lua_module_ud *u = ud;
  return call_lua_module(u, be, "backward", slot, io, dy, rows, u->out_w, dx, u->in_w);
}

static void lua_module_release(void *ud) {
  lua_module_ud *u = ud;
  luaL_unref(u->owner, LUA_REGISTRYINDEX, u->ref);
  free(u);
}

/* ---------------------------------------------------------------- the objective written in Lua */

/* Calls objective(out, batch) for one micro-batch: out is the stage's last
 * output [rows, width] (a copy), batch = {targets = [B, T] int32 (a copy; nil
 * without targets), batch = B, seq_len = T, micro_batch = i, first_row = r,
 * want_grad = bool} (1-based). It returns the micro-batch's loss and, when
 * want_grad, d loss / d out [rows, width]; dx gets it times the step's
 * scale (grad_scale / micro_batches: the engine's per-row dloss x rows). */
static int call_objective(void *ud, const pg_io *io, const float *x, int rows, int width, float *dx, double *loss) {
  engine_ud *u = ud;
  lua_State *L = u->current;
  int top = lua_gettop(L);
  if (u->objective_ref == LUA_NOREF || u->objective_ref == LUA_REFNIL)
    return pg_fail("the model ends without a loss (its last module outputs width %d): give an objective "
                   "(pg.parallelize{objective = fn} or forward_backward's objective=)", width);
  lua_rawgeti(L, LUA_REGISTRYINDEX, u->objective_ref);
  int64_t shape[2] = {rows, width};
  pg_tensor *out = pg_lua_new_tensor(L, PG_FLOAT32, 2, shape);
  memcpy(pg_tensor_f32(out), x, (size_t)rows * width * sizeof(float));
  lua_createtable(L, 0, 6);
  if (io->host_targets) {
    int64_t tshape[2] = {io->B, io->T};
    pg_tensor *t = pg_lua_new_tensor(L, PG_INT32, 2, tshape);
    memcpy(pg_tensor_i32(t), io->host_targets, (size_t)rows * sizeof(int32_t));
    lua_setfield(L, -2, "targets");
  }
  lua_pushinteger(L, io->B);
  lua_setfield(L, -2, "batch");
  lua_pushinteger(L, io->T);
  lua_setfield(L, -2, "seq_len");
  lua_pushinteger(L, io->mb + 1);
  lua_setfield(L, -2, "micro_batch");
  lua_pushinteger(L, (lua_Integer)io->row0 + 1);
  lua_setfield(L, -2, "first_row");
  lua_pushboolean(L, dx != NULL);
  lua_setfield(L, -2, "want_grad");
  if (lua_pcall(L, 2, 2, 0) != LUA_OK) {
    int rc = pg_fail("%s", lua_tostring(L, -1));
    lua_settop(L, top);
    return rc;
  }
  if (lua_type(L, -2) != LUA_TNUMBER) {
    int rc = pg_fail("the objective returned %s, expected the loss (a number) and its gradient", luaL_typename(L, -2));
    lua_settop(L, top);
    return rc;
  }
  *loss = lua_tonumber(L, -2);
  if (dx) {
    pg_tensor *g = pg_lua_test_tensor(L, -1);
    if (!(g && g->storage && g->dtype == PG_FLOAT32 && g->numel == (int64_t)rows * width)) {
      char d[128] = "no tensor";
      if (g && g->storage) pg_tensor_describe(g, d, sizeof d);
      lua_settop(L, top);
      return pg_fail("the objective returned %s as the gradient, expected %d x %d float32 values (the shape of out)",
                     d, rows, width);
    }
    const float *gd = pg_tensor_data(g);
    float scale = io->dloss * (float)rows;
    for (int64_t i = 0; i < (int64_t)rows * width; i++) dx[i] = gd[i] * scale;
  }
  lua_settop(L, top);
  return PG_OK;
}

/* engine:set_objective(fn | nil): what the objective module calls from now on. */
static int l_set_objective(lua_State *L) {
  engine_ud *u = luaL_checkudata(L, 1, PG_ENGINE_MT);
  if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_settop(L, 2);
  if (u->objective_ref != LUA_NOREF) luaL_unref(u->owner, LUA_REGISTRYINDEX, u->objective_ref);
  u->objective_ref = lua_isnil(L, 2) ? LUA_NOREF : luaL_ref(L, LUA_REGISTRYINDEX);
  u->owner = L;
  return 0;
}

/* ---------------------------------------------------------------- building */

typedef struct build_state {
  lua_State *L;
  lua_State **current;
  pg_context *ctx;
  pg_module_env env; /* what the runtime's kind builders share (a tied head's embedding) */
} build_state;

/* pg_desc over a Lua table at a stack index: the runtime's kind builders read
 * a module description through it. */
typedef struct lua_desc {
  lua_State *L;
  int idx;
} lua_desc;

static int64_t desc_integer(const pg_desc *d, const char *key, int64_t def) {
  const lua_desc *u = d->ud;
  return (int64_t)pg_lua_opt_int(u->L, u->idx, key, (lua_Integer)def);
}

static double desc_number(const pg_desc *d, const char *key, double def) {
  const lua_desc *u = d->ud;
  return (double)pg_lua_opt_number(u->L, u->idx, key, def);
}

static const char *desc_string(const pg_desc *d, const char *key, const char *def) {
  const lua_desc *u = d->ud; /* the string stays referenced by the description table */
  return pg_lua_opt_string(u->L, u->idx, key, def);
}

static int desc_boolean(const pg_desc *d, const char *key, int def) {
  const lua_desc *u = d->ud;
  return pg_lua_opt_bool(u->L, u->idx, key, def);
}

static int desc_integers(const pg_desc *d, const char *key, int64_t *out, int max) {
  const lua_desc *u = d->ud;
  lua_State *L = u->L;
  if (lua_getfield(L, u->idx, key) != LUA_TTABLE) {
    lua_pop(L, 1);
    return -1;
  }
  int n = pg_lua_int_list(L, -1, key, out, max); /* 65.5 used to be read as 0 */
  lua_pop(L, 1);
  return n;
}

static const pg_desc_ops lua_desc_ops = {desc_integer, desc_number, desc_string, desc_boolean, desc_integers};

static int field_int(lua_State *L, int idx, const char *key, int def) { return pg_lua_opt_cint(L, idx, key, def); }

static pg_module *build(build_state *b, int idx);

static pg_module *build_children(build_state *b, int idx, const char *kind, const char *name) {
  lua_State *L = b->L;
  if (lua_getfield(L, idx, "children") != LUA_TTABLE) {
    lua_pop(L, 1);
    return pg_fail_null("%s: a sequential description needs children", name);
  }
  int n = (int)luaL_len(L, -1), ci = lua_gettop(L);
  pg_module **kids = calloc((size_t)(n > 0 ? n : 1), sizeof *kids);
  if (!kids) return pg_fail_null("out of memory");
  pg_module *m = NULL;
  int ok = 1;
  for (int i = 0; i < n && ok; i++) {
    lua_geti(L, ci, i + 1);
    kids[i] = build(b, lua_gettop(L));
    lua_pop(L, 1);
    ok = kids[i] != NULL;
  }
  if (ok) m = pg_module_assemble(b->ctx, kind, name, kids, n);
  if (!m)
    for (int i = 0; i < n; i++) pg_module_free(kids[i]);
  free(kids);
  lua_pop(L, 1);
  return m;
}

static pg_module *build_lua(build_state *b, int idx, const char *name) {
  lua_State *L = b->L;
  int in_w = field_int(L, idx, "in_width", 0), out_w = field_int(L, idx, "out_width", 0);
  const char *in_r = pg_lua_opt_string(L, idx, "input", "replicated"), *out_r = pg_lua_opt_string(L, idx, "output", "replicated");
  pg_tp_region input, output;
  if (pg_tp_region_from_name(in_r, 1, &input) || pg_tp_region_from_name(out_r, 0, &output))
    return pg_fail_null("%s: %s", name, pg_error());
  /* context parallelism hands a module two chunks of each sequence as its rows: only a module whose output row
   * depends on its input row alone (and nothing on where the row sits) computes the same there */
  if (b->ctx && b->ctx->context > 1 && !pg_lua_opt_bool(L, idx, "position_wise", 0))
    return pg_fail_null("Lua module '%s': context=%d gives it two chunks of each sequence as its rows; declare "
                        "position_wise = true if each output row depends on its input row alone, or use context = 1",
                        name, b->ctx->context);
  int np = 0;
  pg_param *params[32];
  if (lua_getfield(L, idx, "params") == LUA_TTABLE) {
    int n = (int)luaL_len(L, -1);
    if (n > 32) {
      lua_pop(L, 1);
      return pg_fail_null("%s: at most 32 parameters per Lua module", name);
    }
    for (int i = 0; i < n; i++) {
      lua_geti(L, -1, i + 1);
      int pi = lua_gettop(L);
      const char *pname = pg_lua_opt_string(L, pi, "name", "weight");
      /* init and std: pg.nn's parameter schema (nn.lua) owns their defaults and always gives them */
      const char *init = pg_lua_opt_string(L, pi, "init", NULL);
      lua_Number std_v = pg_lua_opt_number(L, pi, "std", NAN);
      if (!init || isnan(std_v)) {
        for (int k2 = 0; k2 < np; k2++) pg_param_free(params[k2]);
        lua_pop(L, 2);
        return pg_fail_null("parameter '%s%s%s': %s is required (pg.nn's option schemas give it)", name, *name ? "." : "",
                            pname, init ? "std" : "init");
      }
      float std = (float)std_v;
      int64_t shape[PG_PARAM_MAX_DIMS];
      lua_getfield(L, pi, "shape");
      int nd = lua_istable(L, -1) ? pg_lua_check_shape(L, lua_gettop(L), shape) : 0;
      lua_pop(L, 1);
      char full[512];
      snprintf(full, sizeof full, "%s%s%s", name, *name ? "." : "", pname);
      pg_init_kind k;
      if (pg_init_from_name(init, &k)) {
        for (int k2 = 0; k2 < np; k2++) pg_param_free(params[k2]);
        lua_pop(L, 2);
        return pg_fail_null("parameter '%s': %s", full, pg_error());
      }
      /* split = {dim = d (1-based), blocks = k, sizes = {...}}: sharded over the tensor group */
      int split_dim = 0, blocks = 1, nsizes = 0;
      int64_t sizes[PG_PARAM_MAX_BLOCKS];
      if (lua_getfield(L, pi, "split") == LUA_TTABLE) {
        int si = lua_gettop(L);
        split_dim = pg_lua_opt_cint(L, si, "dim", 0);
        blocks = pg_lua_opt_cint(L, si, "blocks", 1);
        if (lua_getfield(L, si, "sizes") == LUA_TTABLE)
          nsizes = pg_lua_int_list(L, -1, "sizes", sizes, PG_PARAM_MAX_BLOCKS);
        lua_pop(L, 1);
      }
      lua_pop(L, 1);
      if (nd < 1 || nd > PG_PARAM_MAX_DIMS) params[np] = NULL;
      else if (split_dim > 0 && (nsizes == 0 || nsizes == blocks))
        params[np] = pg_param_new_split(b->ctx, full, nd, shape, split_dim - 1, blocks, nsizes ? sizes : NULL, k, std);
      else if (split_dim > 0)
        params[np] = pg_fail_null("parameter '%s': %d sizes for %d blocks", full, nsizes, blocks);
      else params[np] = pg_param_new(full, nd, shape, k, std);
      lua_pop(L, 1);
      if (!params[np]) {
        for (int k2 = 0; k2 < np; k2++) pg_param_free(params[k2]);
        lua_pop(L, 1);
        return nd ? NULL : pg_fail_null("%s: parameter '%s' needs a shape", name, pname);
      }
      np++;
    }
  }
  lua_pop(L, 1);
  lua_module_ud *u = calloc(1, sizeof *u);
  if (!u) return pg_fail_null("out of memory");
  u->current = b->current;
  u->owner = L;
  u->in_w = in_w;
  u->out_w = out_w;
  lua_getfield(L, idx, "module");
  u->ref = luaL_ref(L, LUA_REGISTRYINDEX);
  pg_custom_fns fns = {lua_module_forward, lua_module_backward, lua_module_release, u};
  pg_module *m = pg_custom_new(b->ctx, name, in_w, out_w, input, output, &fns, params, np);
  if (!m) lua_module_release(u);
  return m;
}

static pg_module *build_kind(build_state *b, int idx);

/* A module of the stage, with sequence parallelism on when its description
 * says so (parallel.lua marks the modules whose rows are this rank's share,
 * pg_module_sequence_parallel). */
static pg_module *build(build_state *b, int idx) {
  pg_module *m = build_kind(b, idx);
  if (m && pg_lua_opt_bool(b->L, idx, "sequence_parallel", 0) && pg_module_sequence_parallel(m)) {
    pg_module_free(m);
    return NULL;
  }
  return m;
}

static pg_module *build_kind(build_state *b, int idx) {
  lua_State *L = b->L;
  if (!lua_istable(L, idx)) return pg_fail_null("a module description must be a table");
  const char *kind = pg_lua_opt_string(L, idx, "kind", "?");
  const char *name = pg_lua_opt_string(L, idx, "name", "");
  const pg_kind_traits *k = pg_module_kind_named(kind);
  /* an unknown kind goes to pg_module_build, which names it */
  pg_kind_assembly how = k ? k->assembly : PG_KIND_BUILT;
  if (how == PG_KIND_LIST) return build_children(b, idx, kind, name);
  if (how == PG_KIND_WRAPPER) { /* residual; recompute: full recomputation around a block */
    lua_getfield(L, idx, "inner");
    pg_module *inner = build(b, lua_gettop(L));
    lua_pop(L, 1);
    if (!inner) return NULL;
    pg_module *m = pg_module_assemble(b->ctx, kind, name, &inner, 1);
    if (!m) pg_module_free(inner);
    return m;
  }
  if (how == PG_KIND_LUA) return build_lua(b, idx, name);
  lua_desc u = {L, lua_absindex(L, idx)};
  pg_desc d = {&lua_desc_ops, &u};
  return pg_module_build(b->ctx, kind, name, &d, &b->env);
}

#define PG_MAX_CHUNKS 64 /* model chunks per rank (virtual stages) */

/* core.Engine(ctx, stage_desc | {chunk_desc, ...}, {micro_batches=, schedule=, vocab=, width=, seed=, router_experts=,
 *   tied_name=, bucket_mb=, overlap_grad_reduce=, shared_memory=, device=, objective=, precision=,
 *   sequence_parallel=}): one description for the rank's stage, or
 * a list of them, one per chunk (the interleaved schedule: chunk v is the model's piece v*P + pp_rank). */
static int l_engine_new(lua_State *L) {
  pg_context *ctx = pg_lua_check_context(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  luaL_checktype(L, 3, LUA_TTABLE);
  pg_engine_opts o = {0};
  o.micro_batches = pg_lua_opt_cint(L, 3, "micro_batches", 1);
  {
    int n;
    const pg_schedule_kind *offered = pg_schedule_offered(&n); /* the default first */
    PG_LUA_CHECK(L, pg_schedule_from_name(pg_lua_opt_string(L, 3, "schedule", pg_schedule_name(offered[0])), &o.schedule));
  }
  o.vocab = pg_lua_opt_cint(L, 3, "vocab", 0);
  o.width = pg_lua_opt_cint(L, 3, "width", 0);
  o.bucket_elems = (int64_t)(pg_lua_opt_number(L, 3, "bucket_mb", 25) * 1024 * 1024 / 4);
  if (o.bucket_elems < 1) o.bucket_elems = 1; /* a bucket of a few bytes: one parameter each */
  o.overlap_grad_reduce = pg_lua_opt_bool(L, 3, "overlap_grad_reduce", 1);
  o.tied_name = pg_lua_opt_string(L, 3, "tied_name", NULL);
  o.private_buffers = !pg_lua_opt_bool(L, 3, "shared_memory", 1);
  if (!(o.backend = pg_backend_named(pg_lua_opt_string(L, 3, "device", "cpu"))))
    return luaL_error(L, "parallelize: %s", pg_error());
  uint64_t seed = (uint64_t)pg_lua_opt_int(L, 3, "seed", (lua_Integer)ctx->seed);
  int with_objective = pg_lua_opt_bool(L, 3, "objective", 0);
  o.objective = with_objective;
  o.router_experts = pg_lua_opt_cint(L, 3, "router_experts", 0);
  const char *precision = pg_lua_opt_string(L, 3, "precision", "fp32");
  if (!strcmp(precision, "bf16")) o.precision = PG_PRECISION_BF16;
  else if (strcmp(precision, "fp32"))
    return luaL_error(L, "parallelize: precision must be \"fp32\" or \"bf16\", not \"%s\"", precision);
  o.sequence_parallel = pg_lua_opt_bool(L, 3, "sequence_parallel", 0);
  o.zero = pg_lua_opt_cint(L, 3, "zero", 0);
  int one = lua_getfield(L, 2, "kind") != LUA_TNIL;
  lua_pop(L, 1);
  lua_Integer nchunks = one ? 1 : luaL_len(L, 2);
  if (nchunks < 1 || nchunks > PG_MAX_CHUNKS)
    return luaL_error(L, "parallelize: %d chunks per stage (expected 1 to %d)", (int)nchunks, PG_MAX_CHUNKS);
  engine_ud *u = lua_newuserdatauv(L, sizeof *u, 1);
  u->e = NULL;
  u->current = L;
  u->owner = L;
  u->objective_ref = LUA_NOREF;
  luaL_setmetatable(L, PG_ENGINE_MT);
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1); /* the engine uses the context: keep it alive */
  build_state b = {.L = L, .current = &u->current, .ctx = ctx};
  pg_module *stages[PG_MAX_CHUNKS] = {0};
  for (int v = 0; v < nchunks; v++) {
    int idx = 2;
    if (!one) {
      lua_geti(L, 2, v + 1);
      idx = lua_gettop(L);
    }
    stages[v] = build(&b, idx);
    if (!one) lua_pop(L, 1);
    if (!stages[v]) {
      for (int j = 0; j < v; j++) pg_module_free(stages[j]);
      return luaL_error(L, "%s", pg_error());
    }
  }
  /* the last piece of the model ends in the objective */
  if (with_objective && ctx->pp_rank == ctx->pipeline - 1) {
    pg_module *last = stages[nchunks - 1];
    stages[nchunks - 1] = NULL;
    pg_objective_fns fns = {call_objective, NULL, u};
    pg_module *kids[2] = {last, pg_objective_new(ctx, "objective", last->out_width, &fns)};
    pg_module *seq = kids[1] ? pg_sequential_new(ctx, "", kids, 2) : NULL;
    if (!seq) {
      pg_module_free(kids[0]);
      pg_module_free(kids[1]);
      for (int j = 0; j < nchunks - 1; j++) pg_module_free(stages[j]);
      return luaL_error(L, "%s", pg_error());
    }
    stages[nchunks - 1] = seq;
  }
  u->e = pg_engine_new(ctx, stages, (int)nchunks, seed, &o);
  if (!u->e) return luaL_error(L, "%s", pg_error());
  return 1;
}

static pg_engine *check_engine(lua_State *L, int idx) {
  engine_ud *u = luaL_checkudata(L, idx, PG_ENGINE_MT);
  if (!u->e) luaL_error(L, "the engine was freed");
  u->current = L;
  return u->e;
}

pg_engine *pg_lua_check_engine(lua_State *L, int idx) { return check_engine(L, idx); }

/* Checks a [B, T] int32 batch tensor; sets B and T. */
static const int32_t *check_batch(lua_State *L, int idx, const char *what, int *B, int *T) {
  if (!pg_lua_test_tensor(L, idx))
    luaL_error(L, "%s: expected an int32 tensor [batch, seq_len], got %s", what, luaL_typename(L, idx));
  pg_tensor *t = pg_lua_check_tensor(L, idx);
  char d[128];
  if (t->dtype != PG_INT32 || t->ndim != 2)
    luaL_error(L, "%s: expected an int32 tensor [batch, seq_len], got %s", what, pg_tensor_describe(t, d, sizeof d));
  if (*B >= 0 && (t->shape[0] != *B || t->shape[1] != *T))
    luaL_error(L, "%s: shape %s differs from the inputs' [%d, %d]", what, pg_tensor_describe(t, d, sizeof d), *B, *T);
  if (t->shape[0] * t->shape[1] > INT_MAX) /* the engine counts rows (B x T) in an int */
    luaL_error(L, "%s: %s has more than 2^31 - 1 tokens", what, pg_tensor_describe(t, d, sizeof d));
  *B = (int)t->shape[0];
  *T = (int)t->shape[1];
  return pg_tensor_i32(t);
}

/* engine:forward_backward(inputs, targets, grad_scale, sync) -> loss */
static int l_forward_backward(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  int B = -1, T = -1;
  const int32_t *x = check_batch(L, 2, "inputs", &B, &T);
  const int32_t *y = check_batch(L, 3, "targets", &B, &T);
  float scale = (float)luaL_optnumber(L, 4, 1.0);
  int sync = lua_isnoneornil(L, 5) ? 1 : lua_toboolean(L, 5);
  double loss;
  PG_LUA_CHECK(L, pg_engine_forward_backward(e, x, y, B, T, scale, sync, &loss));
  lua_pushnumber(L, loss);
  return 1;
}

/* engine:evaluate(inputs, targets_or_nil, want_logits) -> loss_or_nil, logits_or_nil */
static int l_evaluate(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  int B = -1, T = -1;
  const int32_t *x = check_batch(L, 2, "inputs", &B, &T);
  const int32_t *y = lua_isnoneornil(L, 3) ? NULL : check_batch(L, 3, "targets", &B, &T);
  int want_logits = lua_toboolean(L, 4);
  pg_tensor *logits = NULL;
  if (want_logits) {
    int64_t shape[3] = {B, T, e->opts.vocab};
    logits = pg_lua_new_tensor(L, PG_FLOAT32, 3, shape);
  }
  double loss = 0;
  PG_LUA_CHECK(L, pg_engine_evaluate(e, x, y, B, T, y ? &loss : NULL, logits ? pg_tensor_f32(logits) : NULL));
  if (y) lua_pushnumber(L, loss);
  else lua_pushnil(L);
  if (logits) lua_pushvalue(L, -2);
  else lua_pushnil(L);
  return 2;
}

/* engine:decode(inputs [B, T] int32, positions {B integers}, row0 (0-based), cache_rows) -> logits [B, T, vocab]
 * (pg_engine_decode: the key/value cache path) */
static int l_decode(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  int B = -1, T = -1;
  const int32_t *x = check_batch(L, 2, "inputs", &B, &T);
  luaL_checktype(L, 3, LUA_TTABLE);
  int row0 = (int)luaL_checkinteger(L, 4), cache_rows = (int)luaL_checkinteger(L, 5);
  if (lua_rawlen(L, 3) != (lua_Unsigned)B)
    return luaL_error(L, "decode: %d positions for %d sequences", (int)lua_rawlen(L, 3), B);
  int32_t *pos = lua_newuserdatauv(L, (size_t)B * sizeof *pos, 0);
  for (int b = 0; b < B; b++) {
    lua_rawgeti(L, 3, b + 1);
    int ok;
    lua_Integer p = lua_tointegerx(L, -1, &ok);
    if (!ok || p < 0 || p > INT32_MAX) return luaL_error(L, "decode: position %d is not an integer >= 0", b + 1);
    pos[b] = (int32_t)p;
    lua_pop(L, 1);
  }
  int64_t shape[3] = {B, T, e->opts.vocab};
  pg_tensor *logits = pg_lua_new_tensor(L, PG_FLOAT32, 3, shape);
  PG_LUA_CHECK(L, pg_engine_decode(e, x, B, T, row0, pos, cache_rows, pg_tensor_f32(logits)));
  return 1;
}

/* engine:decode_check() -> true, or false and why there is no cache path */
static int l_decode_check(lua_State *L) {
  int ok = pg_engine_check_decode(check_engine(L, 1)) == PG_OK;
  lua_pushboolean(L, ok);
  if (ok) return 1;
  lua_pushstring(L, pg_error());
  return 2;
}

static int l_release_cache(lua_State *L) {
  pg_engine_release_cache(check_engine(L, 1));
  return 0;
}

static int l_zero_grad(lua_State *L) {
  PG_LUA_CHECK(L, pg_engine_zero_grad(check_engine(L, 1)));
  return 0;
}

static int l_sync_grads(lua_State *L) {
  PG_LUA_CHECK(L, pg_engine_sync_grads(check_engine(L, 1)));
  return 0;
}

static void push_shape(lua_State *L, int ndim, const int64_t *shape) {
  lua_createtable(L, ndim, 0);
  for (int i = 0; i < ndim; i++) {
    lua_pushinteger(L, shape[i]);
    lua_rawseti(L, -2, i + 1);
  }
}

/* {name=, shape=, full_shape=, split={dim=, blocks=, parts=, index= [, sizes=]}, valid_rows=,
 *  replicated=, tied_copy=, expert= (held by one member of an expert group), sequence_parallel=, weight_decay=,
 *  offset=, tensor=, grad=} for one parameter (no grad when gstore is NULL: ZeRO-2 keeps no gradient of the
 *  whole parameter) */
static void push_param(lua_State *L, pg_param *p, pg_storage *pstore, pg_storage *gstore) {
  lua_createtable(L, 0, 12);
  lua_pushstring(L, p->name);
  lua_setfield(L, -2, "name");
  push_shape(L, p->ndim, p->shape);
  lua_setfield(L, -2, "shape");
  push_shape(L, p->ndim, p->full_shape);
  lua_setfield(L, -2, "full_shape");
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, p->split_dim >= 0 ? p->split_dim + 1 : 0);
  lua_setfield(L, -2, "dim");
  lua_pushinteger(L, p->split_blocks);
  lua_setfield(L, -2, "blocks");
  lua_pushinteger(L, p->split_parts);
  lua_setfield(L, -2, "parts");
  lua_pushinteger(L, p->split_index);
  lua_setfield(L, -2, "index");
  int equal = 1;
  for (int b = 1; b < p->split_blocks; b++) equal = equal && p->split_sizes[b] == p->split_sizes[0];
  if (!equal) { /* unequal blocks (q|k|v with fewer key/value heads): their lengths */
    lua_createtable(L, p->split_blocks, 0);
    for (int b = 0; b < p->split_blocks; b++) {
      lua_pushinteger(L, p->split_sizes[b]);
      lua_rawseti(L, -2, b + 1);
    }
    lua_setfield(L, -2, "sizes");
  }
  lua_setfield(L, -2, "split");
  lua_pushinteger(L, p->valid_rows);
  lua_setfield(L, -2, "valid_rows");
  lua_pushboolean(L, p->replicated);
  lua_setfield(L, -2, "replicated");
  lua_pushboolean(L, p->tied_copy);
  lua_setfield(L, -2, "tied_copy");
  lua_pushboolean(L, p->expert);
  lua_setfield(L, -2, "expert");
  lua_pushboolean(L, p->sequence_parallel);
  lua_setfield(L, -2, "sequence_parallel");
  lua_pushboolean(L, p->weight_decay);
  lua_setfield(L, -2, "weight_decay");
  lua_pushinteger(L, p->offset);
  lua_setfield(L, -2, "offset");
  pg_tensor t;
  if (!pstore) return; /* ZeRO-3: this rank holds a shard of the parameters, not each one (gather_param) */
  if (pg_tensor_init_view(&t, pstore, (size_t)p->offset, PG_FLOAT32, p->ndim, p->shape)) luaL_error(L, "%s", pg_error());
  pg_lua_push_tensor(L, &t);
  lua_setfield(L, -2, "tensor");
  if (!gstore) return;
  if (pg_tensor_init_view(&t, gstore, (size_t)p->offset, PG_FLOAT32, p->ndim, p->shape)) luaL_error(L, "%s", pg_error());
  pg_lua_push_tensor(L, &t);
  lua_setfield(L, -2, "grad");
}

/* engine:params() -> list of parameter tables (push_param), in flat order */
static int l_params(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  lua_createtable(L, e->nparams, 0);
  for (int i = 0; i < e->nparams; i++) {
    push_param(L, e->params[i], e->params_sharded ? NULL : e->param_store, e->sharded ? NULL : e->grad_store);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* engine:flat() -> params, grads: views of the whole flat buffers (grads nil
 * with ZeRO-2, which keeps only this rank's shard: optimizer:shard_state().grad) */
static int l_flat(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  int64_t n = e->flat_padded;
  pg_tensor t;
  if (e->params_sharded)
    return luaL_error(L, "engine:flat(): with zero = 3 this rank keeps only its shard of the parameters and "
                         "gradients (optimizer:shard_state()), not the whole buffers");
  PG_LUA_CHECK(L, pg_tensor_init_view(&t, e->param_store, 0, PG_FLOAT32, 1, &n));
  pg_lua_push_tensor(L, &t);
  if (e->sharded) {
    lua_pushnil(L);
    return 2;
  }
  PG_LUA_CHECK(L, pg_tensor_init_view(&t, e->grad_store, 0, PG_FLOAT32, 1, &n));
  pg_lua_push_tensor(L, &t);
  return 2;
}

static pg_param *check_param(lua_State *L, pg_engine *e, int idx) {
  const char *name = luaL_checkstring(L, idx);
  pg_param *p = pg_engine_find_param(e, name);
  if (!p) luaL_error(L, "this rank holds no parameter '%s'", name);
  return p;
}

/* engine:load_param(name, full) : this rank's shard from a full tensor (rows may
 * be fewer than the padded full shape: the rest is padding, set to 0). */
static int l_load_param(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  pg_param *p = check_param(L, e, 2);
  pg_tensor *t = pg_lua_check_tensor(L, 3);
  int64_t row = 1;
  for (int d = 1; d < p->ndim; d++) row *= p->full_shape[d];
  if (t->dtype != PG_FLOAT32 || t->numel % row || t->numel / row > p->full_shape[0]) {
    char d[128];
    return luaL_error(L, "load_param %s: a tensor of %s does not fit the full shape (rows of %I values, at most %I rows)",
                      p->name, pg_tensor_describe(t, d, sizeof d), (lua_Integer)row, (lua_Integer)p->full_shape[0]);
  }
  PG_LUA_CHECK(L, pg_engine_load_param(e, p, pg_tensor_f32(t), t->numel / row));
  return 0;
}

/* engine:gather_param(name [, grad]) -> the full tensor, or its gradient
 * (collective over the tensor group) */
static int l_gather_param(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  pg_param *p = check_param(L, e, 2);
  int grad = lua_toboolean(L, 3);
  if (grad && e->sharded)
    return luaL_error(L, "gather_param(%s, grad): with zero = 2 this rank keeps only its shard of the gradients "
                         "(optimizer:shard_state().grad), not the whole of %s", p->name, p->name);
  pg_tensor *t = pg_lua_new_tensor(L, PG_FLOAT32, p->ndim, p->full_shape);
  pg_param view = *p;
  if (grad) view.data = p->grad;
  PG_LUA_CHECK(L, pg_engine_gather_param(e, &view, pg_tensor_f32(t)));
  return 1;
}

/* engine:local_param(name [, tensor]) -> a copy of this rank's piece of the parameter (its tensor-parallel
 * shard; with zero = 3 gathered over the data group, collective there), or with a tensor of that shape, sets it
 * (local: with zero = 3 this rank keeps the part inside its shard) */
static int l_local_param(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  pg_param *p = check_param(L, e, 2);
  if (lua_isnoneornil(L, 3)) {
    pg_tensor *t = pg_lua_new_tensor(L, PG_FLOAT32, p->ndim, p->shape);
    PG_LUA_CHECK(L, pg_engine_read_param(e, p, pg_tensor_f32(t)));
    return 1;
  }
  pg_tensor *t = pg_lua_check_tensor(L, 3);
  if (t->dtype != PG_FLOAT32 || t->numel != p->numel) {
    char d[128];
    return luaL_error(L, "local_param %s: a tensor of %s is not its piece of %I float32 values", p->name,
                      pg_tensor_describe(t, d, sizeof d), (lua_Integer)p->numel);
  }
  PG_LUA_CHECK(L, pg_engine_write_param(e, p, pg_tensor_f32(t)));
  return 0;
}

static int l_num_parameters(lua_State *L) {
  lua_pushinteger(L, pg_engine_num_parameters(check_engine(L, 1)));
  return 1;
}

static void set_num(lua_State *L, const char *k, double v) {
  lua_pushnumber(L, v);
  lua_setfield(L, -2, k);
}

static void set_int(lua_State *L, const char *k, lua_Integer v) {
  lua_pushinteger(L, v);
  lua_setfield(L, -2, k);
}

/* engine:info() -> sizes, slots, memory and timing counters of this rank */
static int l_info(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  lua_newtable(L);
  set_int(L, "nparams", e->nparams);
  set_int(L, "flat_numel", e->flat_numel);
  set_int(L, "flat_padded", e->flat_padded);
  /* chunk by chunk, summed: with one chunk, that chunk's */
  lua_Integer slots = 0, peak = 0, fixed = 0;
  for (int v = 0; v < e->nchunks; v++) {
    slots += e->chunks[v].nslots;
    peak += e->chunks[v].peak_in_flight;
    /* the chunks share the rank's one arena of recomputed buffers */
    lua_Integer f = (lua_Integer)pg_module_fixed_bytes(e->chunks[v].stage);
    if (f > fixed) fixed = f;
  }
  set_int(L, "chunks", e->nchunks);
  set_int(L, "slots", slots);
  set_int(L, "capacity_rows", e->capacity_rows);
  set_int(L, "slot_bytes", (lua_Integer)pg_engine_slot_bytes(e));
  set_int(L, "activation_bytes", (lua_Integer)pg_engine_activation_bytes(e, 0));
  set_int(L, "peak_activation_bytes", (lua_Integer)pg_engine_activation_bytes(e, 1));
  set_int(L, "fixed_activation_bytes", fixed);
  set_int(L, "bf16_bytes", (lua_Integer)pg_engine_bf16_bytes(e));
  lua_pushstring(L, e->opts.precision == PG_PRECISION_BF16 ? "bf16" : "fp32");
  lua_setfield(L, -2, "precision");
  set_int(L, "peak_in_flight", peak);
  set_int(L, "zero", e->zero);
  /* measured: the flat buffer, or ZeRO-2's shard and staging (pg_engine_grad_bytes) */
  set_int(L, "grads_bytes", (lua_Integer)pg_engine_grad_bytes(e));
  /* measured: the flat buffer, or ZeRO-3's shard and gather slots (pg_engine_param_bytes) */
  set_int(L, "params_bytes", (lua_Integer)pg_engine_param_bytes(e));
  set_int(L, "gather_slots", e->ngpool);
  set_int(L, "gather_slot_elems", e->gpool_elems);
  set_int(L, "gather_resident_elems", e->gresident_elems);
  set_int(L, "gather_units", e->nunits);
  { /* each call's gather of every unit moves 2 bytes x gather_bf16_elems + 4 x gather_float_elems */
    int64_t n16 = 0, n32 = 0;
    for (int k = 0; k < e->nunits; k++) {
      n16 += e->units[k].n16;
      n32 += e->units[k].n32;
    }
    set_int(L, "gather_bf16_elems", e->gather16 ? n16 : 0);
    set_int(L, "gather_float_elems", e->gather16 ? n32 : n16 + n32);
  }
  set_int(L, "unit_gathers", e->unit_gathers);
  lua_pushboolean(L, e->reshard_after_forward);
  lua_setfield(L, -2, "reshard_after_forward");
  lua_pushboolean(L, e->prefetch);
  lua_setfield(L, -2, "prefetch");
  set_int(L, "grad_staging_slots", e->npool);
  set_int(L, "steps", e->stats.steps);
  set_num(L, "step_seconds", e->stats.step_seconds);
  set_num(L, "recv_wait_seconds", e->stats.recv_wait_seconds);
  set_num(L, "send_wait_seconds", e->stats.send_wait_seconds);
  set_num(L, "grad_sync_seconds", e->stats.grad_sync_seconds);
  set_num(L, "exposed_comm_seconds", e->stats.exposed_comm_seconds);
  set_num(L, "compute_seconds", e->stats.compute_seconds);
  /* whether the data-parallel reduction overlaps backward (pg_engine.h), in how many buckets */
  lua_pushboolean(L, pg_engine_overlaps(e));
  lua_setfield(L, -2, "overlap_grad_reduce");
  set_int(L, "grad_buckets", e->nbuckets);
  set_int(L, "grad_buckets_in_backward", e->started_in_backward);
  lua_pushboolean(L, e->is_first);
  lua_setfield(L, -2, "is_first");
  lua_pushboolean(L, e->is_last);
  lua_setfield(L, -2, "is_last");
  lua_pushfstring(L, e->be->device == PG_CPU ? "%s" : "%s:%d", e->be->name, e->be->ordinal);
  lua_setfield(L, -2, "device");
  /* which data-parallel reduction path runs: shared buffers or the MPI ring */
  lua_pushboolean(L, pg_engine_shares_buffers(e));
  lua_setfield(L, -2, "shared_memory");
  lua_pushboolean(L, e->opts.sequence_parallel && e->ctx->tensor > 1);
  lua_setfield(L, -2, "sequence_parallel");
  return 1;
}

/* engine:losses() -> {ce_loss=, aux_loss= (their sum is the last forward_backward's loss),
 *   expert_tokens = {per expert: its choices over all MoE layers} (mixtures of experts only)} */
static int l_losses(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  lua_createtable(L, 0, 3);
  set_num(L, "ce_loss", e->last_ce);
  set_num(L, "aux_loss", e->last_aux);
  if (e->expert_tokens) {
    lua_createtable(L, e->opts.router_experts, 0);
    for (int k = 0; k < e->opts.router_experts; k++) {
      lua_pushinteger(L, (lua_Integer)e->expert_tokens[k]);
      lua_rawseti(L, -2, k + 1);
    }
    lua_setfield(L, -2, "expert_tokens");
  }
  return 1;
}

static int l_reset_stats(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  memset(&e->stats, 0, sizeof e->stats);
  return 0;
}

/* An action list as Lua sees it: { {action, mb}, ... }, mb 1-based, and a
 * third entry, the chunk (1-based), when ranks hold more than one chunk. */
static void push_actions(lua_State *L, const pg_action *a, int n, int V) {
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_createtable(L, 3, 0);
    lua_pushstring(L, pg_action_name(a[i].kind));
    lua_rawseti(L, -2, 1);
    lua_pushinteger(L, a[i].mb + 1);
    lua_rawseti(L, -2, 2);
    if (V > 1) {
      lua_pushinteger(L, a[i].chunk + 1);
      lua_rawseti(L, -2, 3);
    }
    lua_rawseti(L, -2, i + 1);
  }
}

static int l_schedule(lua_State *L) {
  pg_engine *e = check_engine(L, 1);
  push_actions(L, e->actions, e->nactions, e->nchunks);
  return 1;
}

static int l_free(lua_State *L) {
  engine_ud *u = luaL_checkudata(L, 1, PG_ENGINE_MT);
  pg_engine_free(u->e);
  u->e = NULL;
  if (u->objective_ref != LUA_NOREF) luaL_unref(u->owner, LUA_REGISTRYINDEX, u->objective_ref);
  u->objective_ref = LUA_NOREF;
  return 0;
}

/* core.shard_copy(full, piece, spec, "to_full" | "from_full"): copies between
 * the local elements [spec.lo, spec.lo + piece:numel()) of a shard and a full
 * tensor (pg_param_shard_copy). spec = {full_shape=, split = {dim=, blocks=,
 * parts=, index= [, sizes=]} (dim 1-based, 0: not split; sizes: the blocks'
 * lengths when unequal), lo = 0}: the description
 * engine:parameters() gives and checkpoints record. The full tensor may hold
 * fewer rows than full_shape (padding rows are skipped / read as 0). */
static int l_shard_copy(lua_State *L) {
  pg_tensor *full = pg_lua_check_tensor(L, 1), *piece = pg_lua_check_tensor(L, 2);
  luaL_checktype(L, 3, LUA_TTABLE);
  const char *dir = luaL_checkstring(L, 4);
  int to_full = !strcmp(dir, "to_full");
  if (!to_full && strcmp(dir, "from_full"))
    return luaL_error(L, "shard_copy: direction must be 'to_full' or 'from_full', not '%s'", dir);
  if (full->dtype != PG_FLOAT32 || piece->dtype != PG_FLOAT32)
    return luaL_error(L, "shard_copy: full and piece must be float32 tensors");
  pg_param p;
  memset(&p, 0, sizeof p);
  if (lua_getfield(L, 3, "full_shape") != LUA_TTABLE) return luaL_error(L, "shard_copy: spec.full_shape must be a table");
  int64_t shape[PG_MAX_DIMS];
  p.ndim = pg_lua_check_shape(L, lua_gettop(L), shape);
  lua_pop(L, 1);
  if (p.ndim < 1 || p.ndim > PG_PARAM_MAX_DIMS)
    return luaL_error(L, "shard_copy: full_shape must have 1 to %d dimensions, not %d", PG_PARAM_MAX_DIMS, p.ndim);
  for (int d = 0; d < p.ndim; d++) {
    if (shape[d] < 1) return luaL_error(L, "shard_copy: full_shape[%d] = %I", d + 1, (lua_Integer)shape[d]);
    p.full_shape[d] = p.shape[d] = shape[d];
  }
  int64_t full_numel = pg_shape_numel(p.ndim, shape);
  if (full_numel < 0) return luaL_error(L, "shard_copy: full_shape has too many elements");
  int dim = 0, blocks = 1, parts = 1, index = 0, nsizes = 0;
  int64_t sizes[PG_PARAM_MAX_BLOCKS];
  if (lua_getfield(L, 3, "split") == LUA_TTABLE) {
    int s = lua_gettop(L);
    dim = pg_lua_opt_cint(L, s, "dim", 0);
    blocks = pg_lua_opt_cint(L, s, "blocks", 1);
    parts = pg_lua_opt_cint(L, s, "parts", 1);
    index = pg_lua_opt_cint(L, s, "index", 0);
    if (lua_getfield(L, s, "sizes") == LUA_TTABLE)
      nsizes = pg_lua_int_list(L, -1, "shard_copy: split.sizes", sizes, PG_PARAM_MAX_BLOCKS);
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  if (dim < 0 || dim > p.ndim || blocks < 1 || blocks > PG_PARAM_MAX_BLOCKS || parts < 1 || index < 0 ||
      index >= parts || (nsizes && nsizes != blocks))
    return luaL_error(L, "shard_copy: bad split {dim=%d, blocks=%d, parts=%d, index=%d, %d sizes} for %d dimensions",
                      dim, blocks, parts, index, nsizes, p.ndim);
  p.split_dim = -1;
  p.split_blocks = blocks;
  p.split_parts = parts;
  p.split_index = index;
  if (dim > 0 && parts > 1) {
    int64_t total = 0;
    for (int b = 0; b < blocks; b++) {
      p.split_sizes[b] = nsizes ? sizes[b] : p.full_shape[dim - 1] / blocks;
      if (p.split_sizes[b] < 1 || p.split_sizes[b] % parts)
        return luaL_error(L, "shard_copy: block %d of dimension %d has %I rows, not divisible into %d parts", b + 1, dim,
                          (lua_Integer)p.split_sizes[b], parts);
      if (pg_add_overflows(total, p.split_sizes[b], &total))
        return luaL_error(L, "shard_copy: the blocks of dimension %d add up to more than 2^63", dim);
    }
    if (total != p.full_shape[dim - 1])
      return luaL_error(L, "shard_copy: the blocks of dimension %d add up to %I, not its size %I", dim,
                        (lua_Integer)total, (lua_Integer)p.full_shape[dim - 1]);
    p.split_dim = dim - 1;
    p.shape[dim - 1] = p.full_shape[dim - 1] / parts;
  }
  p.numel = pg_shape_numel(p.ndim, p.shape); /* no larger than full_numel, which fits */
  lua_Integer lo = pg_lua_opt_int(L, 3, "lo", 0);
  int64_t end;
  if (lo < 0 || lo > p.numel || piece->numel > p.numel - lo) {
    if (pg_add_overflows(lo, piece->numel, &end)) /* lo = math.maxinteger passed the old lo + numel check */
      return luaL_error(L, "shard_copy: %I elements from element %I are outside the shard's %I elements",
                        (lua_Integer)piece->numel, lo, (lua_Integer)p.numel);
    return luaL_error(L, "shard_copy: elements [%I, %I) are outside the shard's %I elements", lo, (lua_Integer)end,
                      (lua_Integer)p.numel);
  }
  if (full->numel > full_numel)
    return luaL_error(L, "shard_copy: the full tensor has %I elements, more than full_shape's %I",
                      (lua_Integer)full->numel, (lua_Integer)full_numel);
  pg_param_shard_copy(&p, pg_tensor_f32(full), full->numel, pg_tensor_f32(piece), lo, piece->numel, to_full);
  return 0;
}

/* core.schedule(name, P, M, stage [, V = 1]) -> { {action, mb [, chunk]}, ... } (push_actions) */
static int l_schedule_build(lua_State *L) {
  pg_schedule_kind k;
  PG_LUA_CHECK(L, pg_schedule_from_name(luaL_checkstring(L, 1), &k));
  /* the runtime judges the sizes; here they must only fit an int */
  int P = (int)pg_lua_check_int_in(L, 2, "P", INT_MIN, INT_MAX);
  int M = (int)pg_lua_check_int_in(L, 3, "M", INT_MIN, INT_MAX);
  int s = (int)pg_lua_check_int_in(L, 4, "stage", INT_MIN, INT_MAX);
  int V = lua_isnoneornil(L, 5) ? 1 : (int)pg_lua_check_int_in(L, 5, "V", INT_MIN, INT_MAX);
  pg_action *a;
  int n;
  PG_LUA_CHECK(L, pg_schedule_build(k, P, V, M, s, &a, &n));
  push_actions(L, a, n, V);
  free(a);
  return 1;
}

/* core.schedules() -> {offered = {"1f1b", "gpipe"}, default = "1f1b", chunked = {["1f1b"] = "interleaved", ...},
 * names = {every name core.schedule knows}}: the schedules pg_schedule owns (pg_schedule_offered: training
 * with one chunk per rank, the default first; chunked: what each runs as with V > 1 chunks, absent when it
 * cannot), so parallelize and the planner ask instead of spelling them. A new table each call. */
static int l_schedules(lua_State *L) {
  int n;
  const pg_schedule_kind *offered = pg_schedule_offered(&n);
  lua_createtable(L, 0, 4);
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushstring(L, pg_schedule_name(offered[i]));
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "offered");
  lua_pushstring(L, pg_schedule_name(offered[0]));
  lua_setfield(L, -2, "default");
  lua_newtable(L); /* chunked */
  lua_newtable(L); /* names */
  for (int i = 0; i <= PG_SCHEDULE_FORWARD; i++) { /* every kind (FORWARD is the last) */
    pg_schedule_kind k = (pg_schedule_kind)i;
    lua_pushstring(L, pg_schedule_name(k));
    lua_rawseti(L, -2, i + 1);
    int c = pg_schedule_chunked(k);
    if (c >= 0) {
      lua_pushstring(L, pg_schedule_name((pg_schedule_kind)c));
      lua_setfield(L, -3, pg_schedule_name(k));
    }
  }
  lua_setfield(L, -3, "names");
  lua_setfield(L, -2, "chunked");
  return 1;
}

/* core.schedule_in_flight(name, P, M, stage [, V = 1 [, chunk = 1]]) -> the most micro-batches that chunk of
 * pipeline rank `stage` (0-based) holds between forward and backward (pg_schedule_in_flight): the planner's
 * memory model asks it. */
static int l_schedule_in_flight(lua_State *L) {
  pg_schedule_kind k;
  PG_LUA_CHECK(L, pg_schedule_from_name(luaL_checkstring(L, 1), &k));
  int P = (int)pg_lua_check_int_in(L, 2, "P", INT_MIN, INT_MAX);
  int M = (int)pg_lua_check_int_in(L, 3, "M", INT_MIN, INT_MAX);
  int s = (int)pg_lua_check_int_in(L, 4, "stage", INT_MIN, INT_MAX);
  int V = lua_isnoneornil(L, 5) ? 1 : (int)pg_lua_check_int_in(L, 5, "V", INT_MIN, INT_MAX);
  int v = lua_isnoneornil(L, 6) ? 1 : (int)pg_lua_check_int_in(L, 6, "chunk", INT_MIN + 1, INT_MAX);
  int n;
  PG_LUA_CHECK(L, pg_schedule_in_flight(k, P, V, M, s, v - 1, &n));
  lua_pushinteger(L, n);
  return 1;
}

/* core.schedule_place(piece, P) -> rank (0-based), chunk (1-based): where the model's piece (1-based, of
 * P x V) sits (pg_schedule_place: round-robin). */
static int l_schedule_place(lua_State *L) {
  lua_Integer g = pg_lua_check_int_in(L, 1, "piece", 1, INT_MAX);
  int P = (int)pg_lua_check_int_in(L, 2, "P", 1, INT_MAX);
  int r, v;
  pg_schedule_place(P, (int)g - 1, &r, &v);
  lua_pushinteger(L, r);
  lua_pushinteger(L, (lua_Integer)v + 1);
  return 2;
}

/* Reads one stage's action list { {"forward", 1 [, chunk]}, ... } (1-based) at idx. */
static pg_action *read_actions(lua_State *L, int idx, int stage, int *n) {
  luaL_checktype(L, idx, LUA_TTABLE);
  *n = (int)luaL_len(L, idx);
  pg_action *a = calloc((size_t)(*n > 0 ? *n : 1), sizeof *a);
  if (!a) return NULL;
  for (int i = 0; i < *n; i++) {
    lua_geti(L, idx, i + 1);
    int ok = lua_istable(L, -1);
    const char *name = NULL;
    lua_Integer mb = 0, chunk = 1;
    if (ok) {
      lua_geti(L, -1, 1);
      name = lua_tostring(L, -1);
      lua_geti(L, -2, 2);
      int isint = 0;
      mb = lua_tointegerx(L, -1, &isint);
      ok = isint && mb > INT_MIN && mb <= INT_MAX; /* the checker judges the value; the cast must not cut it */
      if (lua_geti(L, -3, 3) != LUA_TNIL) {
        chunk = lua_tointegerx(L, -1, &isint);
        ok = ok && isint && chunk > INT_MIN && chunk <= INT_MAX;
      }
      lua_pop(L, 3);
    }
    lua_pop(L, 1);
    int k = -1;
    for (int j = 0; name && j < 6; j++)
      if (!strcmp(name, pg_action_name((pg_action_kind)j))) k = j;
    if (k < 0 || !ok) {
      free(a);
      luaL_error(L, "schedule_validate: stage %d action %d is not {action, micro-batch [, chunk]} with a known action",
                 stage, i + 1);
    }
    a[i] = (pg_action){(pg_action_kind)k, (int)mb - 1, (int)chunk - 1};
  }
  return a;
}

/* core.schedule_validate(name, P, M [, V = 1]) -> true, or false and the message.
 * core.schedule_validate(stages, M [, V = 1 [, forward_only]]): the same
 * checks on given lists, one per stage (stages[1] is stage 0), in
 * core.schedule's format: lets specs show that the checker rejects broken
 * schedules. */
static int l_schedule_validate(lua_State *L) {
  pg_schedule_kind k = PG_SCHEDULE_1F1B;
  int given = lua_istable(L, 1);
  int P, M, V, forward_only;
  if (given) {
    P = (int)luaL_len(L, 1);
    M = (int)pg_lua_check_int_in(L, 2, "M", INT_MIN, INT_MAX);
    V = lua_isnoneornil(L, 3) ? 1 : (int)pg_lua_check_int_in(L, 3, "V", INT_MIN, INT_MAX);
    forward_only = lua_toboolean(L, 4);
  } else {
    PG_LUA_CHECK(L, pg_schedule_from_name(luaL_checkstring(L, 1), &k));
    P = (int)pg_lua_check_int_in(L, 2, "P", INT_MIN, INT_MAX);
    M = (int)pg_lua_check_int_in(L, 3, "M", INT_MIN, INT_MAX);
    V = lua_isnoneornil(L, 4) ? 1 : (int)pg_lua_check_int_in(L, 4, "V", INT_MIN, INT_MAX);
    forward_only = k == PG_SCHEDULE_FORWARD;
  }
  if (P < 1 || P > 1024 || M < 1 || V < 1 || V > 1024)
    return luaL_error(L, "schedule_validate: bad sizes P=%d M=%d V=%d", P, M, V);
  pg_action **st = calloc((size_t)P, sizeof *st);
  int *lens = calloc((size_t)P, sizeof *lens), rc = PG_OK;
  if (!st || !lens) {
    free(st);
    free(lens);
    return luaL_error(L, "out of memory");
  }
  for (int s = 0; s < P && rc == PG_OK; s++) {
    if (given) {
      lua_geti(L, 1, s + 1);
      st[s] = read_actions(L, lua_gettop(L), s, &lens[s]); /* raises on a malformed entry (leaks the lists read so far) */
      lua_pop(L, 1);
      if (!st[s]) rc = pg_fail("out of memory");
    } else {
      rc = pg_schedule_build(k, P, V, M, s, &st[s], &lens[s]);
    }
  }
  if (rc == PG_OK) rc = pg_schedule_validate(st, lens, P, V, M, forward_only);
  for (int s = 0; s < P; s++) free(st[s]);
  free(st);
  free(lens);
  lua_pushboolean(L, rc == PG_OK);
  if (rc != PG_OK) lua_pushstring(L, pg_error());
  return rc == PG_OK ? 1 : 2;
}

/* ---------------------------------------------------------------- a single module
 *
 * core.Layer(ctx, desc, {seed=}) -> layer: one module on its own, for tests and
 * for users composing their own loops. It owns flat parameter buffers like an
 * engine (same init rule), runs one micro-batch at a time (slot 1):
 *   layer:forward(x [, targets]) -> y        x: [B, T, W] float32, or [B, T] int32 ids
 *                                            for an embedding; a head returns the mean loss
 *   layer:backward([dy]) -> dx or nil        dy: [B, T, W_out]; none for a head
 *   layer:params(), layer:gather_param(name [, grad]), layer:zero_grad() */
#define PG_LAYER_MT "pg.Layer"

typedef struct layer_ud {
  pg_module *m;
  pg_param **params;
  int nparams;
  pg_storage *pstore, *gstore;
  pg_context *ctx;
  lua_State *current;
  pg_io io;
  int B, T, rows;
} layer_ud;

static layer_ud *check_layer(lua_State *L, int idx) {
  layer_ud *u = luaL_checkudata(L, idx, PG_LAYER_MT);
  if (!u->m) luaL_error(L, "the layer was freed");
  u->current = L;
  return u;
}

static int l_layer_new(lua_State *L) {
  pg_context *ctx = pg_lua_check_context(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  uint64_t seed = (uint64_t)pg_lua_opt_int(L, 3, "seed", (lua_Integer)ctx->seed);
  layer_ud *u = lua_newuserdatauv(L, sizeof *u, 3); /* 1: ctx, 2: last input, 3: last targets */
  memset(u, 0, sizeof *u);
  u->ctx = ctx;
  u->current = L;
  luaL_setmetatable(L, PG_LAYER_MT);
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1);
  build_state b = {.L = L, .current = &u->current, .ctx = ctx};
  u->m = build(&b, 2);
  if (!u->m) return luaL_error(L, "%s", pg_error());
  u->params = pg_module_collect_params(u->m, &u->nparams);
  if (!u->params) return luaL_error(L, "%s", pg_error());
  int64_t off = 0;
  for (int i = 0; i < u->nparams; i++) {
    u->params[i]->offset = off;
    off += (u->params[i]->numel + 15) / 16 * 16;
  }
  if (!(u->pstore = pg_storage_new((size_t)(off ? off : 16) * 4, PG_CPU)) ||
      !(u->gstore = pg_storage_new((size_t)(off ? off : 16) * 4, PG_CPU)))
    return luaL_error(L, "%s", pg_error());
  for (int i = 0; i < u->nparams; i++) {
    pg_param *p = u->params[i];
    p->data = (float *)u->pstore->data + p->offset;
    p->grad = (float *)u->gstore->data + p->offset;
    pg_param_init(p, seed);
  }
  return 1;
}

static int l_layer_forward(lua_State *L) {
  layer_ud *u = check_layer(L, 1);
  pg_tensor *x = pg_lua_check_tensor(L, 2);
  char d[128];
  int tokens = u->m->in_width == 0;
  if (x->ndim != (tokens ? 2 : 3) || x->dtype != (tokens ? PG_INT32 : PG_FLOAT32))
    return luaL_error(L, "%s: expected input %s, got %s", u->m->name,
                      tokens ? "int32 [batch, seq_len]" : "float32 [batch, seq_len, width]",
                      pg_tensor_describe(x, d, sizeof d));
  /* A wrong width gets its own message naming the widths (it used to fall
   * into the generic one above, which named none). */
  if (!tokens && x->shape[2] != u->m->in_width) {
    int Tp = u->ctx->tensor;
    if (Tp > 1 && x->shape[2] == (int64_t)u->m->in_width * Tp)
      return luaL_error(L, "%s: expects this rank's split input of width %d, got the unsplit width %d = %d x tensor=%d (%s)",
                        u->m->name, u->m->in_width, (int)x->shape[2], u->m->in_width, Tp,
                        pg_tensor_describe(x, d, sizeof d));
    return luaL_error(L, "%s: expects input of width %d, got width %d (%s)", u->m->name, u->m->in_width,
                      (int)x->shape[2], pg_tensor_describe(x, d, sizeof d));
  }
  int B = (int)x->shape[0], T = (int)x->shape[1];
  const int32_t *targets = NULL;
  if (u->m->out_width == 0) {
    pg_tensor *y = pg_lua_check_tensor(L, 3);
    if (y->dtype != PG_INT32 || y->numel != (int64_t)B * T)
      return luaL_error(L, "%s: targets must be int32 [%d, %d], got %s", u->m->name, B, T, pg_tensor_describe(y, d, sizeof d));
    targets = pg_tensor_i32(y);
    lua_pushvalue(L, 3);
    lua_setiuservalue(L, 1, 3); /* backward reads them */
  }
  if (B * T > u->rows) {
    PG_LUA_CHECK(L, pg_module_alloc(u->m, 1, B * T));
    u->rows = B * T;
  }
  lua_pushvalue(L, 2);
  lua_setiuservalue(L, 1, 2); /* modules keep pointers into the input until backward */
  u->io = (pg_io){.B = B, .T = T, .tokens = tokens ? pg_tensor_i32(x) : NULL, .targets = targets,
                  .dloss = 1.0f / (float)(B * T), .want_grad = 1};
  const float *y = NULL;
  PG_LUA_CHECK(L, pg_module_forward(u->m, 0, &u->io, tokens ? NULL : pg_tensor_f32(x), &y));
  u->B = B;
  u->T = T;
  if (u->m->out_width == 0) {
    lua_pushnumber(L, u->io.loss_sum / ((double)B * T));
    return 1;
  }
  int64_t shape[3] = {B, T, u->m->out_width};
  pg_tensor *out = pg_lua_new_tensor(L, PG_FLOAT32, 3, shape);
  memcpy(pg_tensor_f32(out), y, (size_t)out->numel * sizeof(float));
  lua_pushnumber(L, u->io.aux_sum / ((double)B * T)); /* a mixture of experts' auxiliary losses (0 for others) */
  return 2;
}

static int l_layer_backward(lua_State *L) {
  layer_ud *u = check_layer(L, 1);
  if (!u->B) return luaL_error(L, "%s: backward before forward", u->m->name);
  const float *dy = NULL;
  if (u->m->out_width > 0) {
    int64_t shape[3] = {u->B, u->T, u->m->out_width};
    dy = pg_tensor_f32(pg_lua_check_tensor_shape(L, 2, "dy", PG_FLOAT32, 3, shape));
  }
  const float *dx = NULL;
  PG_LUA_CHECK(L, pg_module_backward(u->m, 0, &u->io, dy, &dx));
  if (!dx || u->m->in_width == 0) return 0;
  int64_t shape[3] = {u->B, u->T, u->m->in_width};
  pg_tensor *out = pg_lua_new_tensor(L, PG_FLOAT32, 3, shape);
  memcpy(pg_tensor_f32(out), dx, (size_t)out->numel * sizeof(float));
  return 1;
}

static int l_layer_params(lua_State *L) {
  layer_ud *u = check_layer(L, 1);
  lua_createtable(L, u->nparams, 0);
  for (int i = 0; i < u->nparams; i++) {
    push_param(L, u->params[i], u->pstore, u->gstore);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_layer_zero_grad(lua_State *L) {
  layer_ud *u = check_layer(L, 1);
  memset(u->gstore->data, 0, u->gstore->bytes);
  return 0;
}

static int l_layer_gather(lua_State *L) {
  layer_ud *u = check_layer(L, 1);
  const char *name = luaL_checkstring(L, 2);
  pg_param *p = NULL;
  for (int i = 0; i < u->nparams && !p; i++)
    if (!strcmp(u->params[i]->name, name)) p = u->params[i];
  if (!p) return luaL_error(L, "the layer has no parameter '%s'", name);
  /* Read the flag before pushing the result: called as gather_param(name),
   * the new tensor lands at index 3 and used to read as grad = true, so the
   * values came back as the gradient. */
  int grad = lua_toboolean(L, 3);
  pg_tensor *t = pg_lua_new_tensor(L, PG_FLOAT32, p->ndim, p->full_shape);
  pg_param view = *p;
  if (grad) view.data = p->grad;
  pg_engine fake = {.ctx = u->ctx, .be = u->m->be};
  PG_LUA_CHECK(L, pg_engine_gather_param(&fake, &view, pg_tensor_f32(t)));
  return 1;
}

static int l_layer_free(lua_State *L) {
  layer_ud *u = luaL_checkudata(L, 1, PG_LAYER_MT);
  pg_module_free(u->m);
  free(u->params);
  pg_storage_release(u->pstore);
  pg_storage_release(u->gstore);
  u->m = NULL;
  u->params = NULL;
  u->pstore = u->gstore = NULL;
  return 0;
}

/* The names Lua reads the traits by (pg_module.h's enums and flags). */
static const char *const assembly_names[] = {[PG_KIND_BUILT] = "built", [PG_KIND_LIST] = "list",
                                             [PG_KIND_WRAPPER] = "wrapper", [PG_KIND_LUA] = "lua",
                                             [PG_KIND_INTERNAL] = "internal"};
static const char *const sp_role_names[] = {[PG_SP_ALL_ROWS] = "all_rows", [PG_SP_ROW_WISE] = "row_wise",
                                            [PG_SP_GATHERS] = "gathers", [PG_SP_SCATTERS] = "scatters",
                                            [PG_SP_TRANSITION] = "transition"};
static const struct {
  unsigned flag;
  const char *name;
} flag_names[] = {{PG_KIND_PASSES_BF16, "passes_bf16"},       {PG_KIND_BF16_BRANCH, "bf16_branch"},
                  {PG_KIND_RECOMPUTES, "recomputes"},         {PG_KIND_SELECTIVE, "selective"},
                  {PG_KIND_WRITTEN_IN_LUA, "written_in_lua"}, {PG_KIND_ROUTER, "router"},
                  {PG_KIND_HEAD, "head"}};

/* core.module_kinds() -> {name = {assembly = "built" | "list" | "wrapper" | "lua" | "internal",
 *   sequence_parallel = role | {mode = role, ...} (role: "all_rows", "row_wise", "gathers", "scatters",
 *   "transition"), host_only = false | why, and each flag as a boolean}}: the registry's traits, so that
 * pg.nn and parallelize ask the runtime's rules instead of keeping copies. A new table each call. */
static int l_module_kinds(lua_State *L) {
  int n = pg_module_kind_count();
  lua_createtable(L, 0, n);
  for (int i = 0; i < n; i++) {
    const pg_kind_traits *t = pg_module_kind_at(i);
    lua_createtable(L, 0, 4 + (int)(sizeof flag_names / sizeof flag_names[0]));
    lua_pushstring(L, assembly_names[t->assembly]);
    lua_setfield(L, -2, "assembly");
    if (t->nmodes) {
      lua_createtable(L, 0, t->nmodes);
      for (int j = 0; j < t->nmodes; j++) {
        lua_pushstring(L, sp_role_names[t->sp_modes[j]]);
        lua_setfield(L, -2, t->modes[j]);
      }
    } else {
      lua_pushstring(L, sp_role_names[t->sp]);
    }
    lua_setfield(L, -2, "sequence_parallel");
    if (t->host_only) lua_pushstring(L, t->host_only);
    else lua_pushboolean(L, 0);
    lua_setfield(L, -2, "host_only");
    for (size_t f = 0; f < sizeof flag_names / sizeof flag_names[0]; f++) {
      lua_pushboolean(L, (t->flags & flag_names[f].flag) != 0);
      lua_setfield(L, -2, flag_names[f].name);
    }
    lua_setfield(L, -2, t->name);
  }
  return 1;
}

static const luaL_Reg layer_methods[] = {{"forward", l_layer_forward}, {"backward", l_layer_backward},
                                         {"params", l_layer_params}, {"zero_grad", l_layer_zero_grad},
                                         {"gather_param", l_layer_gather}, {"free", l_layer_free}, {NULL, NULL}};

static const luaL_Reg engine_methods[] = {
    {"forward_backward", l_forward_backward}, {"evaluate", l_evaluate}, {"decode", l_decode}, {"release_cache", l_release_cache}, {"decode_check", l_decode_check}, {"zero_grad", l_zero_grad},
    {"sync_grads", l_sync_grads}, {"params", l_params}, {"flat", l_flat}, {"local_param", l_local_param}, {"num_parameters", l_num_parameters},
    {"info", l_info}, {"load_param", l_load_param}, {"gather_param", l_gather_param}, {"reset_stats", l_reset_stats}, {"losses", l_losses}, {"schedule", l_schedule}, {"free", l_free},
    {"set_objective", l_set_objective}, {NULL, NULL}};

void pg_lua_open_nn(lua_State *L) {
  if (luaL_newmetatable(L, PG_ENGINE_MT)) {
    luaL_newlib(L, engine_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_free);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  if (luaL_newmetatable(L, PG_LAYER_MT)) {
    luaL_newlib(L, layer_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_layer_free);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  lua_pushcfunction(L, l_layer_new);
  lua_setfield(L, -2, "Layer");
  lua_pushcfunction(L, l_engine_new);
  lua_setfield(L, -2, "Engine");
  lua_pushcfunction(L, l_schedule_build);
  lua_setfield(L, -2, "schedule");
  lua_pushcfunction(L, l_shard_copy);
  lua_setfield(L, -2, "shard_copy");
  lua_pushcfunction(L, l_schedule_validate);
  lua_setfield(L, -2, "schedule_validate");
  lua_pushcfunction(L, l_schedules);
  lua_setfield(L, -2, "schedules");
  lua_pushcfunction(L, l_schedule_in_flight);
  lua_setfield(L, -2, "schedule_in_flight");
  lua_pushcfunction(L, l_schedule_place);
  lua_setfield(L, -2, "schedule_place");
  lua_pushcfunction(L, l_module_kinds);
  lua_setfield(L, -2, "module_kinds");
}
