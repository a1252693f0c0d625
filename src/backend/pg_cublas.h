/* pg_cublas: cuBLAS, loaded on first use.
 *
 * libcublas costs about 0.2 s of start-up (its static initialisers) in every
 * process that links it, GPU or not. pipegoose therefore links only the CUDA
 * runtime and NCCL, and opens cuBLAS with dlopen the first time a GPU path
 * needs it; processes that never touch a GPU never pay for it. The calls
 * pipegoose makes go through this table. C linkage, usable from CUDA files. */
#ifndef PG_CUBLAS_H
#define PG_CUBLAS_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pg_cublas_api {
  cublasStatus_t (*Create)(cublasHandle_t *);
  cublasStatus_t (*Destroy)(cublasHandle_t);
  cublasStatus_t (*SetStream)(cublasHandle_t, cudaStream_t);
  cublasStatus_t (*SetMathMode)(cublasHandle_t, cublasMath_t);
  cublasStatus_t (*GetProperty)(libraryPropertyType, int *);
  const char *(*GetStatusString)(cublasStatus_t);
  cublasStatus_t (*Sgemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const float *,
                          const float *, int, const float *, int, const float *, float *, int);
  cublasStatus_t (*SgemmStridedBatched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                        const float *, const float *, int, long long, const float *, int, long long,
                                        const float *, float *, int, long long, int);
  /* precision bf16's GEMMs (kernels/cuda/bf16.cu): bf16 inputs, float32 output and compute type */
  cublasStatus_t (*GemmEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                           const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                           cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
} pg_cublas_api;

/* The table, loading libcublas on the first call; NULL (and pg_error() set)
 * when the library cannot be opened or lacks a symbol. Thread-safe. */
const pg_cublas_api *pg_cublas(void);

/* cuBLASLt (libcublasLt, opened the same way): precision bf16's device GEMMs with the bias in the epilogue
 * (kernels/cuda/bf16.cu). */
typedef struct pg_cublaslt_api {
  cublasStatus_t (*Create)(cublasLtHandle_t *);
  cublasStatus_t (*Destroy)(cublasLtHandle_t);
  cublasStatus_t (*MatmulDescCreate)(cublasLtMatmulDesc_t *, cublasComputeType_t, cudaDataType);
  cublasStatus_t (*MatmulDescDestroy)(cublasLtMatmulDesc_t);
  cublasStatus_t (*MatmulDescSetAttribute)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void *, size_t);
  cublasStatus_t (*MatrixLayoutCreate)(cublasLtMatrixLayout_t *, cudaDataType, uint64_t, uint64_t, int64_t);
  cublasStatus_t (*MatrixLayoutDestroy)(cublasLtMatrixLayout_t);
  cublasStatus_t (*MatmulPreferenceCreate)(cublasLtMatmulPreference_t *);
  cublasStatus_t (*MatmulPreferenceDestroy)(cublasLtMatmulPreference_t);
  cublasStatus_t (*MatmulPreferenceSetAttribute)(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t,
                                                 const void *, size_t);
  cublasStatus_t (*MatmulAlgoGetHeuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                           cublasLtMatmulPreference_t, int, cublasLtMatmulHeuristicResult_t *, int *);
  cublasStatus_t (*Matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void *, const void *, cublasLtMatrixLayout_t,
                           const void *, cublasLtMatrixLayout_t, const void *, const void *, cublasLtMatrixLayout_t,
                           void *, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t);
} pg_cublaslt_api;

/* The table, loading libcublasLt on the first call; NULL (and pg_error() set) when it cannot be opened or lacks a
 * symbol. Thread-safe. */
const pg_cublaslt_api *pg_cublaslt(void);

/* A context's cuBLASLt state (pg_cuda_ctx.lt; pg_cuda_ctx_init makes it when cuBLASLt loads and PG_CUBLASLT is not
 * 0): the handle, a workspace (allocated at the first product; none when there is no room) and the heuristic's
 * choice per product shape, asked once per shape. */
#define PG_CUDA_LT_WORKSPACE_BYTES ((size_t)32 << 20)
#define PG_CUDA_LT_SHAPES 64
typedef struct pg_cuda_lt_shape {
  int m, n, k, epilogue;              /* column-major D[m,n] = op(A)[m,k] op(B)[k,n] */
  int d_type;                         /* D's cudaDataType: float32 sums, or bf16 (the rounded product) */
  uint32_t align_a, align_b, align_d; /* the operands' alignments (bytes, up to 256) the algorithm was chosen for */
  int usable;                         /* 0: the heuristic found no algorithm (the product uses GemmEx) */
  cublasLtMatmulAlgo_t algo;
} pg_cuda_lt_shape;
typedef struct pg_cuda_lt {
  cublasLtHandle_t handle;
  void *workspace;
  size_t workspace_bytes;
  int workspace_tried;
  int nshapes, next; /* next: the entry a new shape replaces once the cache is full */
  pg_cuda_lt_shape shapes[PG_CUDA_LT_SHAPES];
  long long heuristics, products; /* heuristic queries and products made (the self-test checks the cache) */
} pg_cuda_lt;

#ifdef __cplusplus
}
#endif

#endif
