/* Lua bindings for the GPU entry points: pg.cuda.*. Every function answers
 * on any build and any machine (no CUDA call happens before one is used):
 *   pg.cuda.built              true when the CUDA kernels are compiled in
 *   pg.cuda.available()     -> true | false, reason
 *   pg.cuda.device_count()  -> n (0 without a driver or device; 0, reason when not built)
 *   pg.cuda.versions()      -> {runtime=, driver=, cublas=, nccl=} | nil, reason
 *   pg.cuda.selftest()      -> ok, report (every CUDA kernel against the CPU kernels) */
#include <limits.h>
#include <stdlib.h>

#include "lua_util.h"
#include "pg_backend.h"
#include "pg_cuda.h"

static int l_available(lua_State *L) {
  char reason[512];
  if (pg_cuda_available(reason, sizeof reason)) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushboolean(L, 0);
  lua_pushstring(L, reason);
  return 2;
}

static int l_device_count(lua_State *L) {
  int n = 0;
  if (pg_cuda_device_count(&n) != PG_OK) {
    lua_pushinteger(L, 0);
    lua_pushstring(L, pg_error());
    return 2;
  }
  lua_pushinteger(L, n);
  return 1;
}

static int l_versions(lua_State *L) {
  pg_cuda_versions v;
  if (pg_cuda_get_versions(&v) != PG_OK) {
    lua_pushnil(L);
    lua_pushstring(L, pg_error());
    return 2;
  }
  lua_createtable(L, 0, 4);
  lua_pushinteger(L, v.runtime);
  lua_setfield(L, -2, "runtime");
  lua_pushinteger(L, v.driver);
  lua_setfield(L, -2, "driver");
  lua_pushinteger(L, v.cublas);
  lua_setfield(L, -2, "cublas");
  lua_pushinteger(L, v.nccl);
  lua_setfield(L, -2, "nccl");
  return 1;
}

static int l_selftest(lua_State *L) {
  size_t cap = 65536; /* the report: a line per check (about 160 lines of 90 characters now) */
  char *report = malloc(cap);
  if (!report) return luaL_error(L, "pg.cuda.selftest: out of memory");
  int rc = pg_cuda_selftest(report, cap);
  lua_pushboolean(L, rc == PG_OK);
  lua_pushstring(L, report);
  free(report);
  return 2;
}

/* sgemm_gflops(n [, reps]) -> GFLOP/s of cuBLAS FP32 n x n x n products on this rank's device */
static int l_sgemm_gflops(lua_State *L) {
  int n = (int)pg_lua_check_int_in(L, 1, "n", 1, 1 << 16);
  int reps = lua_isnoneornil(L, 2) ? 10 : (int)pg_lua_check_int_in(L, 2, "reps", 1, INT_MAX);
  double g = 0;
  const pg_backend *b = pg_backend_named("cuda");
  if (!b || pg_backend_sgemm_gflops(b, n, reps, &g)) return luaL_error(L, "pg.cuda.sgemm_gflops: %s", pg_error());
  lua_pushnumber(L, g);
  return 1;
}

/* bf16_gemm_gflops(n [, reps]) -> GFLOP/s of cublasGemmEx bf16 n x n x n products (float32 sums) on this rank's
 * device: precision "bf16"'s peak */
static int l_bf16_gemm_gflops(lua_State *L) {
  int n = (int)pg_lua_check_int_in(L, 1, "n", 1, 1 << 16);
  int reps = lua_isnoneornil(L, 2) ? 10 : (int)pg_lua_check_int_in(L, 2, "reps", 1, INT_MAX);
  double g = 0;
  const pg_backend *b = pg_backend_named("cuda");
  if (!b || pg_backend_bf16_gemm_gflops(b, n, reps, &g))
    return luaL_error(L, "pg.cuda.bf16_gemm_gflops: %s", pg_error());
  lua_pushnumber(L, g);
  return 1;
}

/* synchronize(): waits for the device's queued work (timing) */
static int l_synchronize(lua_State *L) {
  if (pg_cuda_synchronize()) return luaL_error(L, "pg.cuda.synchronize: %s", pg_error());
  return 0;
}

static const luaL_Reg cuda_functions[] = {{"available", l_available},
                                          {"sgemm_gflops", l_sgemm_gflops},
                                          {"bf16_gemm_gflops", l_bf16_gemm_gflops},
                                          {"synchronize", l_synchronize},
                                          {"device_count", l_device_count},
                                          {"versions", l_versions},
                                          {"selftest", l_selftest},
                                          {NULL, NULL}};

void pg_lua_open_cuda(lua_State *L) {
  luaL_newlib(L, cuda_functions);
  lua_pushboolean(L, pg_cuda_built());
  lua_setfield(L, -2, "built");
  lua_setfield(L, -2, "cuda");
}
