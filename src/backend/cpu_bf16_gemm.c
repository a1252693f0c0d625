/* The CPU backend's bf16 GEMMs (pg_cpu_bf16_gemm.h): float32 accumulation,
 * two paths, one result kind. oneDNN's matmul primitive multiplies bf16
 * inputs with the CPU's bf16 dot-product instructions (AVX512_BF16's
 * vdpbf16ps, AMX tiles) and accumulates in float32; where those are missing,
 * or slower than the float32 FMA (select_auto), the inputs are widened to
 * float32 (exact: a bf16 is a float32 with 16 low zero bits) and OpenBLAS
 * sgemm does the products and sums in float32. Either way every
 * product is of two bf16 values and every sum is in float32: only the order
 * of the sums differs.
 *
 * This is the backend's and not a kernel (kernels/ neither allocate nor keep
 * state): it probes the CPU once, holds oneDNN's engine, stream and
 * primitives (created once per (shape, transposes, beta) and kept: a linear
 * layer's three products per shape; a model has a few shapes), and the
 * fallback's two widening panels, all behind mutexes. */
#include "pg_cpu_bf16_gemm.h"

#include <cblas.h>
#include <cpuid.h>
#include <immintrin.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/pg_cpu.h" /* PG_PAR_MIN: the widening loops are the CPU kernels' kind */
#include "kernels.h"    /* pg_bf16_value */
#include "pg_error.h"
#include "pg_env.h"

/* ---- path selection ---- */

enum { PATH_UNSET = -1, PATH_ONEDNN = 0, PATH_FALLBACK = 1 };
static int path = PATH_UNSET;
static char why_buf[512];
static char err_buf[256];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* The CPU's bf16 instructions, from cpuid leaf 7: AVX512_BF16 (subleaf 1, EAX
 * bit 5), AMX-BF16 (subleaf 0, EDX bit 22). The OS must also have enabled the
 * AVX-512 state, which oneDNN's ISA check below covers. */
static void cpu_bf16(int *avx512, int *amx) {
  unsigned a, b, c, d;
  *avx512 = *amx = 0;
  if (__get_cpuid_max(0, NULL) < 7) return;
  __cpuid_count(7, 0, a, b, c, d);
  *amx = (d >> 22) & 1;
  __cpuid_count(7, 1, a, b, c, d);
  *avx512 = (a >> 5) & 1;
}

/* The throughput of the CPU's bf16 dot products against float32 FMA, in
 * flops per second on one core: 12 independent accumulators each, so that
 * the loop runs at the instructions' issue rate, not their latency. A
 * vdpbf16ps does 32 multiply-adds per zmm (64 flops), an FMA 16 (32 flops);
 * cores differ in how many of each they issue per cycle: some run bf16 dots
 * at twice the FMA's flops (what oneDNN's bf16 matmul needs to beat sgemm),
 * others at half of them. Called only where cpuid says AVX512_BF16 and
 * oneDNN's ISA check found the AVX-512 state enabled. ~1 ms each. */
#define PROBE_ITERS 100000
#define PROBE_ACC(op)                                                                                              \
  op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f,avx512bf16"))) static double probe_bf16_dot(void) {
  __m512 acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i); /* distinct: not merged into one chain */
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
  double t = seconds();
  for (int i = 0; i < PROBE_ITERS; i++) {
#define DOT(k) acc[k] = _mm512_dpbf16_ps(acc[k], a, b);
    PROBE_ACC(DOT)
#undef DOT
    __asm__ volatile("" : "+v"(a), "+v"(b)); /* keeps the loop from being folded */
  }
  t = seconds() - t;
  float s = 0;
  for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(acc[i]);
  __asm__ volatile("" : : "x"(s));
  return t > 0 ? PROBE_ITERS * 12.0 * 64 / t : 0;
}

__attribute__((target("avx512f"))) static double probe_fma(void) {
  __m512 acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i); /* distinct: not merged into one chain */
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.5f);
  double t = seconds();
  for (int i = 0; i < PROBE_ITERS; i++) {
#define FMA(k) acc[k] = _mm512_fmadd_ps(a, b, acc[k]);
    PROBE_ACC(FMA)
#undef FMA
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  t = seconds() - t;
  float s = 0;
  for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(acc[i]);
  __asm__ volatile("" : : "x"(s));
  return t > 0 ? PROBE_ITERS * 12.0 * 32 / t : 0;
}

/* Best of three interleaved runs of each (a busy machine slows both). */
static void probe_rates(double *bf16, double *fma) {
  *bf16 = *fma = 0;
  for (int r = 0; r < 3; r++) {
    double x = probe_bf16_dot(), y = probe_fma();
    if (x > *bf16) *bf16 = x;
    if (y > *fma) *fma = y;
  }
}

/* How oneDNN's bf16 matmul would run here: ONEDNN_NATIVE on the CPU's bf16
 * instructions; ONEDNN_EMULATED on AVX-512 without them (oneDNN widens the
 * operands itself: the same exact products and float32 sums, slower than
 * sgemm, so only by name: the specs run both paths on every machine);
 * ONEDNN_NONE below AVX-512, where oneDNN has no bf16 matmul. `why` says what
 * was found either way. */
enum { ONEDNN_NONE = 0, ONEDNN_EMULATED = 1, ONEDNN_NATIVE = 2 };
static int onednn_usable(char *why, size_t len, int *amx_out) {
  int avx512, amx;
  cpu_bf16(&avx512, &amx);
  *amx_out = amx;
  dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  /* The ISA values are bit sets: a level includes the bits of those below it. */
  int isa_bf16 = ((unsigned)isa & (unsigned)dnnl_cpu_isa_avx512_core_bf16) == (unsigned)dnnl_cpu_isa_avx512_core_bf16;
  int isa_avx512 = ((unsigned)isa & (unsigned)dnnl_cpu_isa_avx512_core) == (unsigned)dnnl_cpu_isa_avx512_core;
  const char *cpu = amx && avx512 ? "AVX512_BF16 and AMX-BF16" : amx ? "AMX-BF16" : avx512 ? "AVX512_BF16" : NULL;
  if (cpu && isa_bf16) {
    snprintf(why, len, "the CPU has %s and oneDNN's ISA (0x%x) reaches avx512_core_bf16", cpu, (unsigned)isa);
    return ONEDNN_NATIVE;
  }
  char what[120];
  if (cpu) snprintf(what, sizeof what, "the CPU has %s but oneDNN's ISA stops below avx512_core_bf16 (ONEDNN_MAX_CPU_ISA?)", cpu);
  else snprintf(what, sizeof what, "the CPU has neither AVX512_BF16 nor AMX-BF16");
  if (isa_avx512) {
    snprintf(why, len, "%s: oneDNN emulates bf16 on avx512_core (ISA 0x%x), slower than sgemm", what, (unsigned)isa);
    return ONEDNN_EMULATED;
  }
  snprintf(why, len, "%s, and oneDNN's ISA (0x%x) stops below avx512_core, where it has no bf16 matmul", what,
           (unsigned)isa);
  return ONEDNN_NONE;
}

#define ONEDNN_MIN_GAIN 1.25 /* bf16 dot flops per FMA flop from which oneDNN's bf16 matmul beats sgemm */

/* The automatic choice: oneDNN where the CPU has AMX tiles, or where its
 * AVX512_BF16 dot products outrun float32 FMA by ONEDNN_MIN_GAIN (measured
 * here: cpuid alone cannot tell a core that issues vdpbf16ps at twice the
 * FMA's flops from one that issues it at half of them, as the 2-core Intel
 * Xeon of README's table does: 86 against 173 GFLOP/s per core, where
 * oneDNN's matmul runs at 83 and sgemm at 140); else the fallback. */
static void select_auto(void) {
  char w[200];
  int amx;
  if (onednn_usable(w, sizeof w, &amx) != ONEDNN_NATIVE) {
    path = PATH_FALLBACK;
    snprintf(why_buf, sizeof why_buf, "%s", w);
    return;
  }
  if (amx) {
    path = PATH_ONEDNN;
    snprintf(why_buf, sizeof why_buf, "%s", w);
    return;
  }
  double dot, fma;
  probe_rates(&dot, &fma);
  double gain = fma > 0 ? dot / fma : 0;
  path = gain >= ONEDNN_MIN_GAIN ? PATH_ONEDNN : PATH_FALLBACK;
  snprintf(why_buf, sizeof why_buf,
           "%s; its bf16 dot products run at %.0f GFLOP/s per core against %.0f for float32 FMA (%.2fx, %s %.2fx)",
           w, dot * 1e-9, fma * 1e-9, gain, gain >= ONEDNN_MIN_GAIN ? "at least" : "below", ONEDNN_MIN_GAIN);
}

static int select_locked(const char *name);

const char *pg_bf16_gemm_path(const char **why) {
  pthread_mutex_lock(&lock);
  if (path == PATH_UNSET) {
    /* PG_BF16_GEMM=auto|onednn|fallback: the first choice by name (benchmarks compare the paths). A name
     * outside those is refused at start-up (pg_env.h); onednn where it cannot run leaves the automatic
     * choice and says so in why. */
    const char *env = "auto";
    int refused = pg_env_choice("PG_BF16_GEMM", &env);
    if (refused) snprintf(err_buf, sizeof err_buf, "%.150s", pg_error());
    if (refused || select_locked(env)) {
      select_auto();
      if (refused || strcmp(env, "auto")) {
        char w[sizeof why_buf];
        snprintf(w, sizeof w, "%.300s; PG_BF16_GEMM ignored: %.150s", why_buf, err_buf);
        memcpy(why_buf, w, sizeof why_buf);
      }
    }
  }
  int p = path;
  pthread_mutex_unlock(&lock);
  if (why) *why = why_buf;
  return p == PATH_ONEDNN ? "onednn" : "fallback";
}

int pg_bf16_gemm_select(const char *name, const char **why) {
  pthread_mutex_lock(&lock);
  int rc = select_locked(name);
  pthread_mutex_unlock(&lock);
  if (why) *why = rc ? err_buf : why_buf;
  return rc;
}

static int select_locked(const char *name) {
  int rc = 0;
  if (!strcmp(name, "auto")) {
    select_auto();
  } else if (!strcmp(name, "fallback")) {
    path = PATH_FALLBACK;
    snprintf(why_buf, sizeof why_buf, "selected by name (fallback)");
  } else if (!strcmp(name, "onednn")) {
    char w[200];
    int amx;
    if (onednn_usable(w, sizeof w, &amx) != ONEDNN_NONE) {
      path = PATH_ONEDNN;
      snprintf(why_buf, sizeof why_buf, "selected by name (onednn): %s", w);
    } else {
      snprintf(err_buf, sizeof err_buf, "the onednn path cannot run here: %s", w);
      rc = -1;
    }
  } else {
    snprintf(err_buf, sizeof err_buf, "unknown bf16 GEMM path '%.64s' (expected auto, onednn or fallback)", name);
    rc = -1;
  }
  return rc;
}

const char *pg_bf16_gemm_error(void) { return err_buf; }

/* ---- oneDNN ---- */

/* C[M,N] (+)= A[M,K] B[K,N], A and B bf16 with element strides (row, column). */
typedef struct prim {
  int M, N, K;
  int64_t sa0, sa1, sb0, sb1;
  int beta;
  dnnl_primitive_t p;
} prim;

#define PRIM_MAX 64
static prim prims[PRIM_MAX];
static int nprims;
static dnnl_engine_t engine;
static dnnl_stream_t stream;

static int dnnl_fail(const char *what, dnnl_status_t st) {
  snprintf(err_buf, sizeof err_buf, "oneDNN: %s failed (status %d)", what, (int)st);
  return -1;
}

/* The cached primitive for this shape, created on first use. Called with lock held. */
static int get_prim(prim *key, dnnl_primitive_t *out) {
  for (int i = 0; i < nprims; i++) {
    prim *q = &prims[i];
    if (q->M == key->M && q->N == key->N && q->K == key->K && q->sa0 == key->sa0 && q->sa1 == key->sa1 &&
        q->sb0 == key->sb0 && q->sb1 == key->sb1 && q->beta == key->beta) {
      *out = q->p;
      return 0;
    }
  }
  dnnl_status_t st;
  if (!engine) {
    if ((st = dnnl_engine_create(&engine, dnnl_cpu, 0)) != dnnl_success) return dnnl_fail("engine_create", st);
    if ((st = dnnl_stream_create(&stream, engine, dnnl_stream_default_flags)) != dnnl_success)
      return dnnl_fail("stream_create", st);
  }
  dnnl_memory_desc_t a, b, c;
  dnnl_dims_t da = {key->M, key->K}, db = {key->K, key->N}, dc = {key->M, key->N};
  dnnl_dims_t sa = {key->sa0, key->sa1}, sb = {key->sb0, key->sb1}, sc = {key->N, 1};
  if ((st = dnnl_memory_desc_init_by_strides(&a, 2, da, dnnl_bf16, sa)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_strides(&b, 2, db, dnnl_bf16, sb)) != dnnl_success ||
      (st = dnnl_memory_desc_init_by_strides(&c, 2, dc, dnnl_f32, sc)) != dnnl_success)
    return dnnl_fail("memory_desc_init_by_strides", st);
  dnnl_matmul_desc_t md;
  if ((st = dnnl_matmul_desc_init(&md, &a, &b, NULL, &c)) != dnnl_success) return dnnl_fail("matmul_desc_init", st);
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t ops = NULL;
  if ((st = dnnl_primitive_attr_create(&attr)) != dnnl_success) return dnnl_fail("primitive_attr_create", st);
  if (key->beta) {
    /* C += A B: the sum post-op adds the product to what C holds. */
    if ((st = dnnl_post_ops_create(&ops)) != dnnl_success || (st = dnnl_post_ops_append_sum(ops, 1.0f)) != dnnl_success ||
        (st = dnnl_primitive_attr_set_post_ops(attr, ops)) != dnnl_success) {
      if (ops) dnnl_post_ops_destroy(ops);
      dnnl_primitive_attr_destroy(attr);
      return dnnl_fail("sum post-op", st);
    }
    dnnl_post_ops_destroy(ops);
  }
  dnnl_primitive_desc_t pd;
  st = dnnl_primitive_desc_create(&pd, &md, attr, engine, NULL);
  dnnl_primitive_attr_destroy(attr);
  if (st != dnnl_success) return dnnl_fail("matmul primitive_desc_create", st);
  dnnl_primitive_t p;
  st = dnnl_primitive_create(&p, pd);
  dnnl_primitive_desc_destroy(pd);
  if (st != dnnl_success) return dnnl_fail("matmul primitive_create", st);
  if (nprims == PRIM_MAX) {
    /* Full: drop the oldest (a model has a handful of shapes; a sweep of shapes does not grow without bound). */
    dnnl_primitive_destroy(prims[0].p);
    memmove(prims, prims + 1, (PRIM_MAX - 1) * sizeof(prim));
    nprims--;
  }
  key->p = p;
  prims[nprims++] = *key;
  *out = p;
  return 0;
}

static int onednn_gemm(int M, int N, int K, const uint16_t *A, int64_t sa0, int64_t sa1, const uint16_t *B,
                       int64_t sb0, int64_t sb1, int beta, float *C) {
  prim key = {M, N, K, sa0, sa1, sb0, sb1, beta, NULL};
  dnnl_primitive_t p = NULL; /* set by get_prim when it succeeds */
  pthread_mutex_lock(&lock);
  int rc = get_prim(&key, &p);
  pthread_mutex_unlock(&lock);
  if (rc) return rc;
  dnnl_memory_desc_t a, b, c;
  dnnl_dims_t da = {M, K}, db = {K, N}, dc = {M, N};
  dnnl_dims_t sa = {sa0, sa1}, sb = {sb0, sb1}, sc = {N, 1};
  dnnl_memory_desc_init_by_strides(&a, 2, da, dnnl_bf16, sa);
  dnnl_memory_desc_init_by_strides(&b, 2, db, dnnl_bf16, sb);
  dnnl_memory_desc_init_by_strides(&c, 2, dc, dnnl_f32, sc);
  dnnl_memory_t ma = NULL, mb = NULL, mc = NULL;
  dnnl_status_t st;
  if ((st = dnnl_memory_create(&ma, &a, engine, (void *)A)) != dnnl_success ||
      (st = dnnl_memory_create(&mb, &b, engine, (void *)B)) != dnnl_success ||
      (st = dnnl_memory_create(&mc, &c, engine, C)) != dnnl_success) {
    rc = dnnl_fail("memory_create", st);
  } else {
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
    if ((st = dnnl_primitive_execute(p, stream, 3, args)) != dnnl_success ||
        (st = dnnl_stream_wait(stream)) != dnnl_success)
      rc = dnnl_fail("matmul execute", st);
  }
  if (ma) dnnl_memory_destroy(ma);
  if (mb) dnnl_memory_destroy(mb);
  if (mc) dnnl_memory_destroy(mc);
  return rc;
}

/* ---- fallback: widen to float32, sgemm ---- */

/* The product runs in blocks of C (MB x NB) and of K (KB): each block's
 * operands are widened into two scratch panels that are kept between calls
 * (PANEL floats each, 8 MiB), so that no call allocates, and no weight is
 * ever held whole in float32 (the LM head's would be 4 bytes a parameter,
 * more than the bf16 working copy saves). The blocks are large enough for
 * sgemm to run at its rate: K in blocks of up to 1024 (C accumulates across
 * them), then as many rows and columns as fill a panel. The loop keeps a B
 * panel while A's blocks pass under it; an A panel is widened again for each
 * block of N columns (one block in all but the LM head's forward, where A is
 * a micro-batch's activations). */
#define PANEL ((int64_t)2 << 20)
#define KB_MAX 1024

static float *panel[2];
static pthread_mutex_t panel_lock = PTHREAD_MUTEX_INITIALIZER;

/* dst[rows x cols] (dense) = src's block at (r0, c0), src row-major with ld elements a row. */
static void widen_block(float *dst, const uint16_t *src, int64_t ld, int64_t r0, int64_t c0, int64_t rows,
                        int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols > PG_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *s = src + (r0 + r) * ld + c0;
    float *d = dst + r * cols;
    for (int64_t c = 0; c < cols; c++) d[c] = pg_bf16_value(s[c]);
  }
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int fallback_gemm(int transa, int transb, int M, int N, int K, const uint16_t *A, int64_t lda,
                         const uint16_t *B, int64_t ldb, float beta, float *C) {
  pthread_mutex_lock(&panel_lock);
  if (!panel[0]) panel[0] = malloc((size_t)PANEL * sizeof(float));
  if (!panel[1]) panel[1] = malloc((size_t)PANEL * sizeof(float));
  if (!panel[0] || !panel[1]) {
    pthread_mutex_unlock(&panel_lock);
    snprintf(err_buf, sizeof err_buf, "out of memory for the bf16 fallback's two %lld-float panels",
             (long long)PANEL);
    return -1;
  }
  int64_t kb = min64(K, KB_MAX), nb = min64(N, PANEL / kb), mb = min64(M, PANEL / kb);
  float *pa = panel[0], *pb = panel[1];
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    int64_t nn = min64(nb, N - n0);
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
      int64_t kk = min64(kb, K - k0);
      /* op(B)'s block [k0, k0+kk) x [n0, n0+nn): B is [K, N] (ldb) or, transposed, [N, K] */
      if (transb) widen_block(pb, B, ldb, n0, k0, nn, kk);
      else widen_block(pb, B, ldb, k0, n0, kk, nn);
      float b = k0 ? 1.0f : beta;
      for (int64_t m0 = 0; m0 < M; m0 += mb) {
        int64_t mm = min64(mb, M - m0);
        if (transa) widen_block(pa, A, lda, k0, m0, kk, mm);
        else widen_block(pa, A, lda, m0, k0, mm, kk);
        cblas_sgemm(CblasRowMajor, transa ? CblasTrans : CblasNoTrans, transb ? CblasTrans : CblasNoTrans, (int)mm,
                    (int)nn, (int)kk, 1.0f, pa, (int)(transa ? mm : kk), pb, (int)(transb ? kk : nn), b,
                    C + m0 * N + n0, N);
      }
    }
  }
  pthread_mutex_unlock(&panel_lock);
  return 0;
}

/* C[M,N] = (beta ? C : 0) + op(A) op(B); op(A) = A[M,K] (lda = K) or A^T of A[K,M] (lda = M); likewise B. */
static int gemm(int transa, int transb, int M, int N, int K, const uint16_t *A, const uint16_t *B, int beta,
                float *C) {
  if (M <= 0 || N <= 0) return 0;
  if (K <= 0) {
    if (!beta) memset(C, 0, (size_t)M * N * sizeof(float));
    return 0;
  }
  int64_t lda = transa ? M : K, ldb = transb ? K : N;
  if (strcmp(pg_bf16_gemm_path(NULL), "onednn"))
    return fallback_gemm(transa, transb, M, N, K, A, lda, B, ldb, beta ? 1.0f : 0.0f, C);
  return onednn_gemm(M, N, K, A, transa ? 1 : lda, transa ? lda : 1, B, transb ? 1 : ldb, transb ? ldb : 1, beta, C);
}

int pg_matmul_bf16_forward(float *out, const uint16_t *inp, const uint16_t *weight, const float *bias, int N, int C,
                           int OC) {
  if (N <= 0 || OC <= 0) return 0;
  if (bias) {
    /* Start from the bias and add the product (as the float32 kernel does). */
#pragma omp parallel for schedule(static) if ((int64_t)N * OC > PG_PAR_MIN)
    for (int n = 0; n < N; n++) memcpy(out + (int64_t)n * OC, bias, (size_t)OC * sizeof(float));
  }
  return gemm(0, 1, N, OC, C, inp, weight, bias != NULL, out);
}

int pg_matmul_bf16_backward(float *dinp, float *dweight, const uint16_t *dout, const uint16_t *inp,
                            const uint16_t *weight, int N, int C, int OC) {
  if (N <= 0) return 0;
  if (OC <= 0) {
    if (dinp && C > 0) memset(dinp, 0, (size_t)N * C * sizeof(float));
    return 0;
  }
  if (dinp && gemm(0, 0, N, C, OC, dout, weight, 0, dinp)) return -1;
  if (dweight && gemm(1, 0, OC, C, N, dout, inp, 1, dweight)) return -1;
  return 0;
}
