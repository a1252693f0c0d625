/* cuda_emu/mma.h — the emulator's nvcuda::wmma: the 16x16x16 shape with bf16 operands and float32
 * accumulators, the subset kernels/cuda uses (fill_fragment, load_matrix_sync, mma_sync, store_matrix_sync).
 * Not the real header (see cuda_runtime.h).
 *
 * Warp-collective as on the GPU. load_matrix_sync, store_matrix_sync and mma_sync wait, like a warp
 * collective, until every live lane of the warp has reached them (CUDA: "waits until all warp lanes have
 * arrived"), then run. A fragment here holds the whole 16x16 tile in every lane (num_elements = 256,
 * element (r, c) of the tile at x[r * 16 + c]); the GPU spreads a tile over the lanes in a layout it does
 * not specify (num_elements 8 there), so a kernel may only touch x[i] elementwise, the same operation for
 * every i. store_matrix_sync writes, in each lane, only the elements i with i % 32 == lane: a kernel that
 * reads what other lanes stored without a __syncwarp() in between reads stale memory here (lanes run one
 * after another between collectives), as it may on the GPU.
 *
 * Arithmetic: mma_sync computes d[i][j] = c[i][j] + a[i][0] b[0][j] + ... + a[i][15] b[15][j] in float32,
 * adding the products one at a time in k order, each product exact (a bf16 x bf16 product has at most 16
 * significant bits: float32 holds it exactly, as the tensor cores' products). The GPU's tensor cores add
 * the products in another order and grouping (and their internal additions need not round as IEEE float32
 * does), so results differ in the last bits: a self-test's tolerance comes from float32 accumulation of exact
 * products, never from bit equality with the emulator.
 *
 * Misuse aborts with a message: an ldm that is not a multiple of 16 bytes, a pointer not 32-byte aligned
 * (the GPU's requirements). */
#ifndef PG_CUDA_EMU_MMA_H
#define PG_CUDA_EMU_MMA_H

#include <stdio.h>
#include <stdlib.h>

#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

constexpr int PG_EMU_TILE = 16; /* the one shape: m = n = k = 16 */

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
  static_assert(M == PG_EMU_TILE && N == PG_EMU_TILE && K == PG_EMU_TILE, "the emulator's wmma has 16x16x16 only");
  static constexpr int num_elements = PG_EMU_TILE * PG_EMU_TILE;
  T x[num_elements];
};

/* the lane of the calling thread, and the barrier of its warp (emu.cpp) */
int pg_emu_wmma_lane();
void pg_emu_wmma_enter();

inline void pg_emu_wmma_check(const void *p, unsigned ldm, size_t elem, const char *what) {
  if (((uintptr_t)p & 31u) != 0 || (ldm * elem) % 16 != 0) {
    fprintf(stderr, "cuda_emu: %s: pointer %p must be 32-byte aligned and ldm %u a multiple of %zu elements\n", what,
            p, ldm, 16 / elem);
    abort();
  }
}

template <typename Use, typename T, typename Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout> &f, T v) {
  for (int i = 0; i < f.num_elements; i++) f.x[i] = v;
}

/* element (r, c) of a row_major tile at p[r ldm + c], of a col_major one at p[c ldm + r] */
template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout> &f, const T *p, unsigned ldm) {
  static_assert(sizeof(T) == 2, "operand fragments are bf16 here");
  pg_emu_wmma_enter();
  pg_emu_wmma_check(p, ldm, sizeof(T), "load_matrix_sync");
  const bool row = std::is_same<Layout, row_major>::value;
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) memcpy(&f.x[r * 16 + c], p + (row ? r * ldm + c : c * ldm + r), sizeof(T));
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float, void> &f, const float *p, unsigned ldm,
                             layout_t layout) {
  pg_emu_wmma_enter();
  pg_emu_wmma_check(p, ldm, sizeof(float), "load_matrix_sync");
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) f.x[r * 16 + c] = p[layout == mem_row_major ? r * ldm + c : c * ldm + r];
}

inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float, void> &f, unsigned ldm,
                              layout_t layout) {
  pg_emu_wmma_enter();
  pg_emu_wmma_check(p, ldm, sizeof(float), "store_matrix_sync");
  for (int i = pg_emu_wmma_lane(); i < f.num_elements; i += 32) {
    const int r = i / 16, c = i % 16;
    p[layout == mem_row_major ? r * ldm + c : c * ldm + r] = f.x[i];
  }
}

template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float, void> &d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                     const fragment<accumulator, 16, 16, 16, float, void> &c) {
  pg_emu_wmma_enter();
  float av[256], bv[256], r[256];
  for (int i = 0; i < 256; i++) av[i] = __bfloat162float(a.x[i]), bv[i] = __bfloat162float(b.x[i]);
  for (int i = 0; i < 16; i++)
    for (int j = 0; j < 16; j++) {
      float s = c.x[i * 16 + j];
      for (int k = 0; k < 16; k++) s += av[i * 16 + k] * bv[k * 16 + j]; /* exact product, one rounding per add */
      r[i * 16 + j] = s;
    }
  memcpy(d.x, r, sizeof r); /* d may be c */
}

} // namespace wmma
} // namespace nvcuda

#endif
