/* pg_machine: what this CPU can do, and which BLAS path runs on it.
 *
 * The machines this runs on change (AMD with AVX512_BF16 one day, Intel
 * without it the next, often virtual machines that hide the CPU model).
 * OpenBLAS picks its kernels from the CPU's family and model; when a VM
 * hides them it falls back to its generic "Prescott" (SSE3) kernels and
 * sgemm runs at a fraction of the machine's speed (measured on an AVX-512
 * Xeon VM: 2048^3 sgemm ~2x faster with the Cooperlake kernels). pglua
 * therefore asks OpenBLAS which core it chose and, when that is generic
 * while the CPU's features say better, restarts itself once with
 * OPENBLAS_CORETYPE set from the features (OpenBLAS reads it when it
 * loads). A core the user set is kept. */
#ifndef PG_MACHINE_H
#define PG_MACHINE_H

#include <stddef.h>

/* The OpenBLAS core name to force on this CPU, or NULL to keep OpenBLAS's own
 * choice (it is not a generic fallback, or the CPU has nothing better). */
const char *pg_machine_blas_core(void);
/* OpenBLAS's core in use (openblas_get_corename), e.g. "Cooperlake". */
const char *pg_machine_blas_running(void);
/* The vector features that matter here, e.g. "avx2 fma avx512f avx512bw avx512vl avx512_bf16". */
void pg_machine_features(char *buf, size_t n);

#endif
