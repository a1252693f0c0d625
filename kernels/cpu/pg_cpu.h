/* pg_cpu.h — helpers shared by the CPU kernels (private to kernels/cpu). */
#ifndef PG_CPU_H
#define PG_CPU_H

#include <omp.h>
#include <stdint.h>

/* Below this many elements of work a parallel region costs more than it saves. */
#define PG_PAR_MIN 32768

/* Columns [*c0, *c1) of C that thread tid of nth owns, in whole 16-float
 * (64-byte) blocks so that no two threads write the same cache line. Used by
 * the row reductions: each thread sums all rows, in order, for its columns,
 * so the result does not depend on the thread count at all. */
static inline void pg_cpu_cols(int C, int tid, int nth, int *c0, int *c1) {
  int64_t blocks = (C + 15) / 16;
  int64_t b0 = blocks * tid / nth, b1 = blocks * (tid + 1) / nth;
  *c0 = (int)(b0 * 16 < C ? b0 * 16 : C);
  *c1 = (int)(b1 * 16 < C ? b1 * 16 : C);
}

static inline int pg_cpu_min(int a, int b) { return a < b ? a : b; }

#endif
