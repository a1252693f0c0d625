/* lua_util: what every binding file shares. Argument checking that names the
 * argument and what was expected; pushing runtime errors as Lua errors. */
#ifndef PG_LUA_UTIL_H
#define PG_LUA_UTIL_H

#include <lauxlib.h>
#include <lua.h>

#include "pg_context.h"
#include "pg_error.h"
#include "pg_tensor.h"

#define PG_TENSOR_MT "pg.Tensor"
#define PG_CONTEXT_MT "pg.ParallelContext"

/* Raise the runtime's last message as a Lua error when rc != PG_OK. */
#define PG_LUA_CHECK(L, rc)                                                                                \
  do {                                                                                                     \
    if ((rc) != PG_OK) return luaL_error((L), "%s", pg_error());                                           \
  } while (0)

/* Tensors: the userdata is a pg_tensor. pg_lua_check_tensor wants its data
 * on the host (almost every operation reads it): a device tensor is refused
 * with a message that says to copy it with :to("cpu"). pg_lua_check_any_tensor
 * takes a tensor on any device (shape queries, views, copies between devices). */
pg_tensor *pg_lua_check_tensor(lua_State *L, int idx);
pg_tensor *pg_lua_check_any_tensor(lua_State *L, int idx);
pg_tensor *pg_lua_test_tensor(lua_State *L, int idx); /* NULL if not a tensor */
/* New userdata taking over `t` (its storage reference moves into Lua). */
pg_tensor *pg_lua_push_tensor(lua_State *L, const pg_tensor *t);
/* New zeroed tensor pushed on the stack. Raises on failure. */
pg_tensor *pg_lua_new_tensor(lua_State *L, pg_dtype dtype, int ndim, const int64_t *shape);
/* A float32 (or int32) tensor argument with an exact shape; name says which argument. */
pg_tensor *pg_lua_check_tensor_shape(lua_State *L, int idx, const char *name, pg_dtype dtype, int ndim,
                                     const int64_t *shape);
/* The same on any device (pg.ops' bindings: a device tensor runs on the backend seam's kernels). */
pg_tensor *pg_lua_check_any_tensor_shape(lua_State *L, int idx, const char *name, pg_dtype dtype, int ndim,
                                         const int64_t *shape);
/* Reads a shape from a table of positive integers at idx. Returns ndim. */
int pg_lua_check_shape(lua_State *L, int idx, int64_t *shape);

pg_context *pg_lua_check_context(lua_State *L, int idx);
/* Around a call on c's groups from Lua: from_caller gives the call the Lua
 * caller's "file:line" for its agreement step (pg_comm_call_site);
 * comm_done forgets it (a call that failed before agreeing did not consume
 * it) and raises rc's error. Read the options before from_caller: an option
 * error in between would leave the site to the runtime's next call. */
void pg_lua_from_caller(lua_State *L, pg_context *c);
void pg_lua_comm_done(lua_State *L, pg_context *c, int rc);

/* Options table at idx (absent or nil is an empty table). */
lua_Integer pg_lua_opt_int(lua_State *L, int idx, const char *key, lua_Integer def);
/* An integer option that must lie in [lo, hi] (absent: def). A non-integer,
 * or a value outside the range, is an error naming the key and the value,
 * never a cast that cuts it (2^32 + 64 became 64 in an int field). */
lua_Integer pg_lua_opt_int_in(lua_State *L, int idx, const char *key, lua_Integer def, lua_Integer lo, lua_Integer hi);
/* The same for a C int field: [INT_MIN, INT_MAX]. */
int pg_lua_opt_cint(lua_State *L, int idx, const char *key, int def);
/* A list of integers (the table at idx): its length, the first `max` entries
 * read into out; an entry that is not an integer is an error naming `what`. */
int pg_lua_int_list(lua_State *L, int idx, const char *what, int64_t *out, int max);
/* A positional integer argument in [lo, hi]; `what` names it in the error. */
lua_Integer pg_lua_check_int_in(lua_State *L, int arg, const char *what, lua_Integer lo, lua_Integer hi);
lua_Number pg_lua_opt_number(lua_State *L, int idx, const char *key, lua_Number def);
const char *pg_lua_opt_string(lua_State *L, int idx, const char *key, const char *def);
int pg_lua_opt_bool(lua_State *L, int idx, const char *key, int def);
/* Rejects keys not in `allowed` (NULL-terminated), naming the function. */
void pg_lua_check_keys(lua_State *L, int idx, const char *fname, const char *const *allowed);

/* Registration of each binding area into the table on top of the stack. */
void pg_lua_open_tensor(lua_State *L);
void pg_lua_open_context(lua_State *L);
void pg_lua_open_dist(lua_State *L);
void pg_lua_open_nn(lua_State *L);
void pg_lua_open_optim(lua_State *L);
void pg_lua_open_file(lua_State *L);
void pg_lua_open_fs(lua_State *L);
void pg_lua_open_ops(lua_State *L); /* sets field `ops` */
void pg_lua_open_data(lua_State *L);
void pg_lua_open_cuda(lua_State *L); /* sets field `cuda` */
void pg_lua_open_loss(lua_State *L); /* sets field `loss` */
void pg_lua_open_tokenizer(lua_State *L); /* sets field `tokenizer` */

#endif
