/* cuda_emu/nccl.h — a stand-in for NCCL (see cuda_runtime.h here). */
#ifndef PG_CUDA_EMU_NCCL_H
#define PG_CUDA_EMU_NCCL_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ncclSuccess = 0 } ncclResult_t;
ncclResult_t ncclGetVersion(int *version);

#ifdef __cplusplus
}
#endif

#endif
