/* module_bf16.c: precision bf16: the product helper of the kinds whose
 * products are GEMMs with a weight, and the element types of a tree's edges. */
#include "module_impl.h"

#include <stdint.h>

#include "pg_size.h"

/* ---------------------------------------------------------------- bf16 products */

/* Precision "bf16" (pg_module_set_precision) for the modules whose products
 * are GEMMs with a weight (linear, lm_head): each product runs as a bf16
 * GEMM with float32 sums (the backend's matmul_bf16_*: oneDNN or
 * widen-and-sgemm on the CPU, cublasGemmEx on CUDA), as torch.autocast runs a
 * Linear. The weight's bf16 working copy lives in the backend's memory (device
 * memory on CUDA, so a step makes no host round trip) and is made from the
 * float32 master at the first forward of each call (micro-batch 0, not a
 * recomputation): the optimizer, a checkpoint load or a write from Lua
 * change the master between calls, never within one, so every micro-batch
 * of a call uses the current weights and one conversion per weight and step
 * serves all of them. The module's input and output gradient stay float32
 * between modules; they are rounded into the caller's scratch
 * (pg_io.bf16_scratch, the engine's, in the same backend's memory) for each
 * GEMM. Their state is a bf16_mm each (module_impl.h). */

/* The working weight lasts from one call to the next: the home backend's
 * memory, never a recomputed block's shared arena. */
void mm_free(pg_module *m, bf16_mm *mm) {
  pg_be_release(home_backend(BE(m)), mm->w);
  mm->w = NULL;
  mm->bytes = 0;
}

int mm_alloc(pg_module *m, bf16_mm *mm, int64_t wnumel, int rows, int64_t in, int64_t out) {
  mm_free(m, mm);
  if (!mm->on) return PG_OK;
  int64_t a[2] = {rows, in > out ? in : out}, b[2] = {rows, in};
  mm->need[0] = pg_size_product(2, a);
  mm->need[1] = pg_size_product(2, b);
  if (mm->need[0] < 0 || mm->need[1] < 0 || wnumel < 0 || (uint64_t)wnumel > SIZE_MAX / 2)
    return pg_fail("%s: bf16 operands of %d rows x %lld columns are too large", m->name, rows,
                   (long long)(in > out ? in : out));
  if (mm->gathered) return PG_OK; /* the engine's gathered bits */
  size_t wn = (size_t)(wnumel > 0 ? wnumel : 1);
  if (!(mm->w = home_backend(BE(m))->ops->alloc(home_backend(BE(m)), wn * 2)))
    return pg_fail("%s: no room for its bf16 working weight: %s", m->name, pg_error());
  mm->bytes = wn * 2;
  return PG_OK;
}

void mm_gathered(pg_module *m, bf16_mm *mm, pg_param *w) {
  if (!mm->on) return;
  mm_free(m, mm);
  mm->gathered = 1;
  w->gather_bf16 = 1;
}

/* The working weight a product reads: the engine's gathered bits, or the module's copy. NULL (failed): gathered
 * but its unit is not (a product outside the engine's hooks). */
static const uint16_t *mm_weight(pg_module *m, const bf16_mm *mm, const pg_param *w) {
  if (!mm->gathered) return mm->w;
  if (!w->data16) pg_fail("%s: its bf16 weight %s is not gathered (zero = 3)", m->name, w->name);
  return w->data16;
}

static int mm_scratch(pg_module *m, const pg_io *io) {
  if (!io->bf16_scratch[0] || !io->bf16_scratch[1])
    return pg_fail("%s: precision bf16 needs the engine's operand scratch (pg_io.bf16_scratch)", m->name);
  for (int k = 0; k < PG_WIDE_SCRATCH && (m->in_bf16 || m->out_bf16); k++)
    if (!io->wide_scratch[k])
      return pg_fail("%s: bf16 activations need the engine's float32 scratch (pg_io.wide_scratch)", m->name);
  return PG_OK;
}

/* The backend said what failed (a GEMM, a launch); the module adds its name. */
static int mm_fail(pg_module *m) { return pg_fail("%s: %s", m->name, pg_error()); }

/* An operand of a bf16 product: p's elements when they are bf16 already (an activation of a bf16 edge), else p
 * rounded into the engine's operand scratch k. NULL: the kernel failed. */
static const uint16_t *operand16(pg_module *m, const pg_io *io, int k, const float *p, int is_bf16, int64_t n) {
  if (is_bf16) return cbits(p);
  return KERNEL(m, bf16_from_f32, io->bf16_scratch[k], p, n) ? NULL : io->bf16_scratch[k];
}

/* The bf16 products on a working weight w16 (any module's: linear's, lm_head's, an expert's), the float32
 * operands rounded into the engine's scratch. out[N,OC] = x[N,C] @ w^T (+ bias), summed in float32 and, where the
 * module's output is bf16 (out_bf16), rounded once into out (matmul_bf16_forward_rounded: by the product itself
 * where the backend can, else through the float32 wide_scratch[0]). */
int bf16_product_forward(pg_module *m, const pg_io *io, float *out, const float *x, const uint16_t *w16,
                         const float *bias, int N, int C, int OC) {
  if (mm_scratch(m, io)) return PG_ERR;
  const uint16_t *x16 = operand16(m, io, 0, x, m->in_bf16, (int64_t)N * C);
  if (!x16 || (m->out_bf16 ? KERNEL(m, matmul_bf16_forward_rounded, bits(out), io->wide_scratch[0], x16, w16, bias,
                                    N, C, OC)
                           : KERNEL(m, matmul_bf16_forward, out, x16, w16, bias, N, C, OC)))
    return mm_fail(m);
  return PG_OK;
}

/* dinp = dy @ w in float32 (NULL: skip; a module whose input is bf16 rounds it after its collectives),
 * dw += dy^T @ x, dbias += column sums of dy's float32 values (NULL: skip). */
int bf16_product_backward(pg_module *m, const pg_io *io, float *dinp, float *dw, float *dbias, const float *dy,
                          const float *x, const uint16_t *w16, int N, int C, int OC) {
  if (mm_scratch(m, io)) return PG_ERR;
  const uint16_t *dy16 = operand16(m, io, 0, dy, m->out_bf16, (int64_t)N * OC);
  const uint16_t *x16 = dy16 ? operand16(m, io, 1, x, m->in_bf16, (int64_t)N * C) : NULL;
  const float *dy32 = m->out_bf16 ? NULL : dy; /* NULL: the bias sums the bf16 gradient's values, widened */
  if (!x16 || KERNEL(m, matmul_bf16_backward, dinp, dw, dbias, dy32, dy16, x16, w16, N, C, OC)) return mm_fail(m);
  return PG_OK;
}

/* out[N,OC] = x[N,C] @ w^T (+ bias), x rounded to bf16; refresh: remake the working weight first. */
int mm_forward(pg_module *m, bf16_mm *mm, const pg_io *io, int refresh, const pg_param *w, float *out,
               const float *x, const float *bias, int N, int C, int OC) {
  if (refresh && !mm->gathered) {
    if (KERNEL(m, bf16_from_f32, mm->w, w->data, w->numel)) return mm_fail(m);
    mm->refreshes++;
  }
  const uint16_t *w16 = mm_weight(m, mm, w);
  return w16 ? bf16_product_forward(m, io, out, x, w16, bias, N, C, OC) : PG_ERR;
}

/* A linear-kind product: the backend's float32 kernel, or the bf16 one. */
int mm_fwd(pg_module *m, bf16_mm *mm, const pg_io *io, const pg_param *w, float *out, const float *x,
           const float *bias, int N, int C, int OC) {
  int refresh = io->mb == 0 && !io->recomputing;
  if (N == 0) { /* a sequence-parallel rank without rows: the working weight is still remade for the others */
    if (mm->on && refresh && !mm->gathered) {
      if (KERNEL(m, bf16_from_f32, mm->w, w->data, w->numel)) return mm_fail(m);
      mm->refreshes++;
    }
    return PG_OK;
  }
  if (mm->on) return mm_forward(m, mm, io, refresh, w, out, x, bias, N, C, OC);
  return KERNEL(m, matmul_forward, out, x, w->data, bias, N, C, OC);
}

/* dinp = dy @ w (NULL: skip), w->grad += dy^T @ x, dbias += column sums of the float32 dy (NULL: skip). */
int mm_bwd(pg_module *m, bf16_mm *mm, const pg_io *io, float *dinp, const pg_param *w, float *dbias,
           const float *dy, const float *x, int N, int C, int OC) {
  if (!mm->on) return KERNEL(m, matmul_backward, dinp, w->grad, dbias, dy, x, w->data, N, C, OC);
  const uint16_t *w16 = mm_weight(m, mm, w);
  return w16 ? bf16_product_backward(m, io, dinp, w->grad, dbias, dy, x, w16, N, C, OC) : PG_ERR;
}

void mm_need(const bf16_mm *mm, pg_bf16_need *need) {
  for (int k = 0; mm->on && k < 2; k++)
    if (mm->need[k] > need->operand[k]) need->operand[k] = mm->need[k];
}

void raise_wide(pg_bf16_need *need, const int64_t wide[PG_WIDE_SCRATCH]) {
  for (int k = 0; k < PG_WIDE_SCRATCH; k++)
    if (wide[k] > need->wide[k]) need->wide[k] = wide[k];
}

/* ---------------------------------------------------------------- the tree's element types */

static int bf16_products(pg_module *m) {
  if (m->out || m->dinp || m->nslots)
    return pg_fail("%s: the precision must be chosen before the buffers are allocated", m->name);
  if (m->kind->bf16_on) m->kind->bf16_on(m); /* linear, lm_head and moe: their products */
  for (int i = 0; i < m->nchildren; i++)
    if (bf16_products(m->children[i])) return PG_ERR;
  return PG_OK;
}

/* The element types of precision bf16's activations, torch.autocast's: a Linear's output is bf16, and GELU,
 * SwiGLU and the attention core keep their input's type; norms, the residual stream, the embedding, the heads
 * and moe take and give float32, and so does a module written in Lua, which computes in float32 (as a region
 * of torch code run with autocast off: its neighbours' products still run bf16). Where a module would make bf16
 * that its consumer cannot take, it makes float32 instead, so every edge has one type that both ends agree on.
 * A row-parallel Linear's output is bf16 like any Linear's: each rank rounds its partial sums and the tensor
 * group sums them in bf16 (all-reduce, or reduce-scatter of rows under sequence parallelism), so those
 * collectives move half the bytes, as Megatron's do. A column-parallel one whose output is gathered
 * (gather_output) makes float32. */
static int passes_bf16(const pg_module *m) { return kind_has(m, PG_KIND_PASSES_BF16); }

/* Whether m can take a bf16 input, given whether its consumer can take a bf16 output. */
static int takes_bf16(const pg_module *m, int consumer_takes) {
  if (m->kind->takes_bf16) return m->kind->takes_bf16(m);
  if (passes_bf16(m)) return consumer_takes;
  if (m->kind->traits.assembly == PG_KIND_LIST) {
    for (int i = m->nchildren - 1; i >= 0; i--) consumer_takes = takes_bf16(m->children[i], consumer_takes);
    return consumer_takes;
  }
  return 0;
}

/* in_bf16: m's producer gives bf16 (only where takes_bf16 said yes); consumer_takes: m's consumer can take it. */
static void assign_types(pg_module *m, int in_bf16, int consumer_takes) {
  m->in_bf16 = in_bf16;
  const pg_module_kind *k = m->kind;
  m->out_bf16 = k->makes_bf16 ? k->makes_bf16(m) && consumer_takes : passes_bf16(m) ? in_bf16 : 0;
  if (k->traits.assembly == PG_KIND_LIST) {
    for (int i = 0; i < m->nchildren; i++) {
      int next_takes = consumer_takes; /* what child i's consumer (the rest of the chain) takes */
      for (int j = m->nchildren - 1; j > i; j--) next_takes = takes_bf16(m->children[j], next_takes);
      assign_types(m->children[i], in_bf16, next_takes);
      in_bf16 = m->children[i]->out_bf16;
    }
    m->out_bf16 = in_bf16;
    return;
  }
  /* the residual adds a bf16 branch to its float32 stream; anything else holding modules takes float32 from them */
  for (int i = 0; i < m->nchildren; i++) assign_types(m->children[i], 0, kind_has(m, PG_KIND_BF16_BRANCH));
}

int pg_module_set_precision(pg_module *m, pg_precision p) {
  if (p == PG_PRECISION_FP32) return PG_OK;
  if (bf16_products(m)) return PG_ERR;
  assign_types(m, 0, 0);
  return PG_OK;
}

/* Each kind's need (bf16_need: its products' operands, its widened activations), the largest of the tree. */
void pg_module_bf16_scratch(const pg_module *m, pg_bf16_need *need) {
  if (m->kind->bf16_need) m->kind->bf16_need(m, need);
  for (int i = 0; i < m->nchildren; i++) pg_module_bf16_scratch(m->children[i], need);
}

void pg_module_bf16_gathered(pg_module *m) {
  if (m->kind->bf16_gathered) m->kind->bf16_gathered(m);
  for (int i = 0; i < m->nchildren; i++) pg_module_bf16_gathered(m->children[i]);
}

size_t pg_module_bf16_bytes(const pg_module *m) {
  size_t b = 0;
  if (m->kind->bf16_bytes) b += m->kind->bf16_bytes(m);
  for (int i = 0; i < m->nchildren; i++) b += pg_module_bf16_bytes(m->children[i]);
  return b;
}
