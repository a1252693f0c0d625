#include "pg_error.h"

#ifdef PG_WITH_CUDA
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <pthread.h>
#include <string.h>

#include "pg_cublas.h"

static pg_cublas_api api;
static int loaded; /* 1 ok, -1 failed */
static char failure[512];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void) {
  /* the versioned name first: the unversioned link is only in -dev installs */
  const char *names[] = {"libcublas.so." PG_CUBLAS_SONAME_MAJOR, "libcublas.so"};
  void *h = NULL;
  for (size_t i = 0; i < sizeof names / sizeof *names && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(failure, sizeof failure, "cannot load cuBLAS (libcublas.so." PG_CUBLAS_SONAME_MAJOR "): %s", dlerror());
    loaded = -1;
    return;
  }
  struct {
    const char *name;
    void **slot;
  } syms[] = {{"cublasCreate_v2", (void **)&api.Create},
              {"cublasDestroy_v2", (void **)&api.Destroy},
              {"cublasSetStream_v2", (void **)&api.SetStream},
              {"cublasSetMathMode", (void **)&api.SetMathMode},
              {"cublasGetProperty", (void **)&api.GetProperty},
              {"cublasGetStatusString", (void **)&api.GetStatusString},
              {"cublasSgemm_v2", (void **)&api.Sgemm},
              {"cublasSgemmStridedBatched", (void **)&api.SgemmStridedBatched},
              {"cublasGemmEx", (void **)&api.GemmEx}};
  for (size_t i = 0; i < sizeof syms / sizeof *syms; i++) {
    *syms[i].slot = dlsym(h, syms[i].name);
    if (!*syms[i].slot) {
      snprintf(failure, sizeof failure, "cuBLAS lacks %s", syms[i].name);
      loaded = -1;
      return;
    }
  }
  loaded = 1;
}

const pg_cublas_api *pg_cublas(void) {
  pthread_once(&once, load);
  if (loaded != 1) return pg_fail_null("%s", failure);
  return &api;
}

static pg_cublaslt_api lt_api;
static int lt_loaded; /* 1 ok, -1 failed */
static char lt_failure[512];
static pthread_once_t lt_once = PTHREAD_ONCE_INIT;

static void load_lt(void) {
  const char *names[] = {"libcublasLt.so." PG_CUBLAS_SONAME_MAJOR, "libcublasLt.so"};
  void *h = NULL;
  for (size_t i = 0; i < sizeof names / sizeof *names && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(lt_failure, sizeof lt_failure, "cannot load cuBLASLt (libcublasLt.so." PG_CUBLAS_SONAME_MAJOR "): %s",
             dlerror());
    lt_loaded = -1;
    return;
  }
  struct {
    const char *name;
    void **slot;
  } syms[] = {{"cublasLtCreate", (void **)&lt_api.Create},
              {"cublasLtDestroy", (void **)&lt_api.Destroy},
              {"cublasLtMatmulDescCreate", (void **)&lt_api.MatmulDescCreate},
              {"cublasLtMatmulDescDestroy", (void **)&lt_api.MatmulDescDestroy},
              {"cublasLtMatmulDescSetAttribute", (void **)&lt_api.MatmulDescSetAttribute},
              {"cublasLtMatrixLayoutCreate", (void **)&lt_api.MatrixLayoutCreate},
              {"cublasLtMatrixLayoutDestroy", (void **)&lt_api.MatrixLayoutDestroy},
              {"cublasLtMatmulPreferenceCreate", (void **)&lt_api.MatmulPreferenceCreate},
              {"cublasLtMatmulPreferenceDestroy", (void **)&lt_api.MatmulPreferenceDestroy},
              {"cublasLtMatmulPreferenceSetAttribute", (void **)&lt_api.MatmulPreferenceSetAttribute},
              {"cublasLtMatmulAlgoGetHeuristic", (void **)&lt_api.MatmulAlgoGetHeuristic},
              {"cublasLtMatmul", (void **)&lt_api.Matmul}};
  for (size_t i = 0; i < sizeof syms / sizeof *syms; i++) {
    *syms[i].slot = dlsym(h, syms[i].name);
    if (!*syms[i].slot) {
      snprintf(lt_failure, sizeof lt_failure, "cuBLASLt lacks %s", syms[i].name);
      lt_loaded = -1;
      return;
    }
  }
  lt_loaded = 1;
}

const pg_cublaslt_api *pg_cublaslt(void) {
  pthread_once(&lt_once, load_lt);
  if (lt_loaded != 1) return pg_fail_null("%s", lt_failure);
  return &lt_api;
}
#else
/* Built without CUDA: nothing to load (this unit only keeps the file list simple). */
typedef int pg_cublas_unused;
#endif
