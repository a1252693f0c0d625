// Error codes of the CUDA kernels (see kernels.h).
#include "common.cuh"

extern "C" const char *pg_cuda_strerror(int code) {
  if (code == 0) return "no error";
  if (code == PG_CUDA_EINVAL) return "invalid argument (missing CUDA context or cuBLAS handle, or bad sizes)";
  if (code > PG_CUDA_CUBLAS_ERR && code < PG_CUDA_EINVAL) {
    const pg_cublas_api *b = pg_cublas();
    return b ? b->GetStatusString((cublasStatus_t)(code - PG_CUDA_CUBLAS_ERR)) : "cuBLAS could not be loaded";
  }
  if (code > 0 && code < PG_CUDA_CUBLAS_ERR) return cudaGetErrorString((cudaError_t)code);
  return "unknown CUDA kernel error";
}
