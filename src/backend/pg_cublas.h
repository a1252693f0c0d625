/* pg_cublas: cuBLAS, loaded on first use.
 *
 * libcublas costs about 0.2 s of start-up (its static initialisers) in every
 * process that links it, GPU or not. pipegoose therefore links only the CUDA
 * runtime and NCCL, and opens cuBLAS with dlopen the first time a GPU path
 * needs it; processes that never touch a GPU never pay for it. The calls
 * pipegoose makes go through this table. C linkage, usable from CUDA files. */
#ifndef PG_CUBLAS_H
#define PG_CUBLAS_H

#include <cublas_v2.h>

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

#ifdef __cplusplus
}
#endif

#endif
