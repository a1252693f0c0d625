// Precision bf16 on the GPU: float32 -> bf16 rounding and the bf16 GEMMs
// (cublasGemmEx: bf16 inputs, float32 sums and output). bf16 values are their
// bits (uint16_t), as on the CPU (kernels.h), so no cuda_bf16.h type crosses
// the C interface.
#include "common.cuh"

#include <string.h>

using namespace pgcu;

__global__ void bf16_from_f32_kernel(uint16_t *dst, const float *src, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = bf16_round_bits(src[i]);
}

extern "C" int pg_cuda_bf16_from_f32(const pg_cuda_ctx *ctx, uint16_t *dst, const float *src, int64_t n) {
  if (n <= 0) return 0;
  bf16_from_f32_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dst, src, n);
  return launch_status();
}

__global__ void bf16_to_f32_kernel(float *dst, const uint16_t *src, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = bf16_value(src[i]);
}

extern "C" int pg_cuda_bf16_to_f32(const pg_cuda_ctx *ctx, float *dst, const uint16_t *src, int64_t n) {
  if (n <= 0) return 0;
  bf16_to_f32_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dst, src, n);
  return launch_status();
}

// ---- the forward product through cuBLASLt (ctx->lt: src/backend/pg_cublas.h) ----
// One call: the bias is the epilogue's (no pass writing it into out first, as the GemmEx path's beta = 1 needs),
// float32 products and sums (CUBLAS_COMPUTE_32F), the algorithm the heuristic picks for the shape, asked once per
// shape and pointer alignment (cuBLASLt's heuristics assume 256-byte operands unless told otherwise, and an
// algorithm chosen for aligned operands may refuse others).

namespace {

// The descriptors of one product, destroyed when it returns.
struct lt_descs {
  const pg_cublaslt_api *api;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  explicit lt_descs(const pg_cublaslt_api *x) : api(x) {}
  lt_descs(const lt_descs &) = delete;
  lt_descs &operator=(const lt_descs &) = delete;
  ~lt_descs() {
    if (pref) api->MatmulPreferenceDestroy(pref);
    if (d) api->MatrixLayoutDestroy(d);
    if (b) api->MatrixLayoutDestroy(b);
    if (a) api->MatrixLayoutDestroy(a);
    if (op) api->MatmulDescDestroy(op);
  }
};

// The largest power of two up to 256 that divides the address.
uint32_t alignment_of(const void *p) {
  const uintptr_t u = (uintptr_t)p;
  uint32_t a = 256;
  while (a > 1 && u % a) a /= 2;
  return a;
}

// The workspace, allocated at the first product; none (0 bytes: algorithms that need none) when there is no room.
void lt_workspace(pg_cuda_lt *lt) {
  if (lt->workspace_tried) return;
  lt->workspace_tried = 1;
  if (cudaMalloc(&lt->workspace, PG_CUDA_LT_WORKSPACE_BYTES) == cudaSuccess) {
    lt->workspace_bytes = PG_CUDA_LT_WORKSPACE_BYTES;
  } else {
    (void)cudaGetLastError();
    lt->workspace = nullptr;
  }
}

} // namespace

// 1 when the product was made (or failed: *rc), 0 when cuBLASLt has no algorithm for it (the caller uses GemmEx).
// out: float32 (d_type CUDA_R_32F) or bf16 (CUDA_R_16BF: the epilogue rounds the float32 sums plus bias).
static int lt_linear_forward(const pg_cuda_ctx *ctx, void *out, cudaDataType d_type, const uint16_t *inp,
                             const uint16_t *weight, const float *bias, int N, int C, int OC, int *rc) {
  pg_cuda_lt *lt = (pg_cuda_lt *)ctx->lt;
  const pg_cublaslt_api *api = pg_cublaslt();
  if (!api) return 0;
  // row-major out[N,OC] = inp[N,C] @ weight[OC,C]^T is column-major D[OC,N] = op(A)[OC,C] B[C,N] with A the
  // weight seen as [C,OC] (transposed) and B the input seen as [C,N]; the bias runs along D's rows
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  const cudaDataType bias_type = CUDA_R_32F;
  lt_descs s(api);
  cublasStatus_t st;
  if ((st = api->MatmulDescCreate(&s.op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
      (st = api->MatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) ||
      (st = api->MatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) ||
      (st = api->MatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue)) ||
      (bias && ((st = api->MatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias)) ||
                (st = api->MatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                  sizeof bias_type)))) ||
      (st = api->MatrixLayoutCreate(&s.a, CUDA_R_16BF, (uint64_t)C, (uint64_t)OC, C)) ||
      (st = api->MatrixLayoutCreate(&s.b, CUDA_R_16BF, (uint64_t)C, (uint64_t)N, C)) ||
      (st = api->MatrixLayoutCreate(&s.d, d_type, (uint64_t)OC, (uint64_t)N, OC))) {
    *rc = cublas_status(st);
    return 1;
  }
  const uint32_t align_a = alignment_of(weight), align_b = alignment_of(inp), align_d = alignment_of(out);
  pg_cuda_lt_shape *shape = nullptr;
  for (int i = 0; i < lt->nshapes && !shape; i++) {
    pg_cuda_lt_shape *c = &lt->shapes[i];
    if (c->m == OC && c->n == N && c->k == C && c->epilogue == (int)epilogue && c->d_type == (int)d_type &&
        c->align_a == align_a &&
        c->align_b == align_b && c->align_d == align_d)
      shape = c;
  }
  if (!shape) {
    lt_workspace(lt);
    const uint64_t max_ws = lt->workspace_bytes;
    // bf16 D: split-K only with its partial sums reduced in float32 (COMPUTE_TYPE), never in bf16 (INPLACE,
    // OUTPUT_TYPE), so the result is rounded once, as bf16_from_f32 would round the float32 product
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublasLtMatmulHeuristicResult_t r;
    int found = 0;
    memset(&r, 0, sizeof r);
    if ((st = api->MatmulPreferenceCreate(&s.pref)) ||
        (st = api->MatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws,
                                                sizeof max_ws)) ||
        (st = api->MatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                sizeof align_a)) ||
        (st = api->MatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                sizeof align_b)) ||
        (st = api->MatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                                sizeof align_d)) ||
        (st = api->MatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                sizeof align_d)) ||
        (d_type == CUDA_R_16BF && (st = api->MatmulPreferenceSetAttribute(
                                       s.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                       sizeof reductions)))) {
      *rc = cublas_status(st);
      return 1;
    }
    lt->heuristics++;
    st = api->MatmulAlgoGetHeuristic(lt->handle, s.op, s.a, s.b, s.d, s.d, s.pref, 1, &r, &found);
    // the shape's entry: a new one, or (the cache full) the oldest
    shape = &lt->shapes[lt->nshapes < PG_CUDA_LT_SHAPES ? lt->nshapes++ : lt->next++ % PG_CUDA_LT_SHAPES];
    *shape = pg_cuda_lt_shape{};
    shape->m = OC, shape->n = N, shape->k = C, shape->epilogue = (int)epilogue, shape->d_type = (int)d_type;
    shape->align_a = align_a, shape->align_b = align_b, shape->align_d = align_d;
    shape->usable = st == CUBLAS_STATUS_SUCCESS && found > 0 && r.state == CUBLAS_STATUS_SUCCESS &&
                    r.workspaceSize <= lt->workspace_bytes;
    shape->algo = r.algo;
  }
  if (!shape->usable) return 0; // no algorithm for this shape: GemmEx, remembered
  const float one = 1.0f, zero = 0.0f;
  lt->products++;
  *rc = cublas_status(api->Matmul(lt->handle, s.op, &one, weight, s.a, inp, s.b, &zero, out, s.d, out, s.d,
                                  &shape->algo, lt->workspace, lt->workspace_bytes, stream_of(ctx)));
  return 1;
}

// Whether the context's cuBLASLt may take the product: a bias vector only 16-byte aligned gets none (cuBLASLt states
// no alignment preference for it, so no promise is made).
static bool lt_usable(const pg_cuda_ctx *ctx, const float *bias, int N, int C, int OC) {
  return ctx && ctx->lt && N > 0 && OC > 0 && C > 0 && (!bias || alignment_of(bias) >= 16);
}

// The products: common.cuh's linear_forward / linear_backward with bf16
// operands (gemm_rm's GemmEx overload: float32 products and sums); the
// forward through cuBLASLt where the context has it (and the bias, if any,
// is 16-byte aligned).
extern "C" int pg_cuda_matmul_bf16_forward(const pg_cuda_ctx *ctx, float *out, const uint16_t *inp,
                                           const uint16_t *weight, const float *bias, int N, int C, int OC) {
  int rc = 0;
  // a bias vector only 16-byte aligned: cuBLASLt states no alignment preference for it, so no promise is made
  if (lt_usable(ctx, bias, N, C, OC) && lt_linear_forward(ctx, out, CUDA_R_32F, inp, weight, bias, N, C, OC, &rc))
    return rc;
  return linear_forward(ctx, out, inp, weight, bias, N, C, OC);
}

// cuBLASLt writes the bf16 result itself (the epilogue converts the float32 sums plus bias, to nearest even as
// bf16_from_f32 does): the float32 result never reaches memory. Without an algorithm for bf16 D: the float32
// product into sums, then the rounding.
extern "C" int pg_cuda_matmul_bf16_forward_rounded(const pg_cuda_ctx *ctx, uint16_t *out16, float *sums,
                                                   const uint16_t *inp, const uint16_t *weight, const float *bias,
                                                   int N, int C, int OC) {
  int rc = 0;
  if (lt_usable(ctx, bias, N, C, OC) &&
      lt_linear_forward(ctx, out16, CUDA_R_16BF, inp, weight, bias, N, C, OC, &rc))
    return rc;
  if ((rc = pg_cuda_matmul_bf16_forward(ctx, sums, inp, weight, bias, N, C, OC))) return rc;
  return pg_cuda_bf16_from_f32(ctx, out16, sums, (int64_t)N * OC);
}

extern "C" int pg_cuda_matmul_bf16_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias,
                                            const float *dout_f32, const uint16_t *dout, const uint16_t *inp,
                                            const uint16_t *weight, int N, int C, int OC) {
  return linear_backward(ctx, dinp, dweight, dbias, dout_f32, dout, inp, weight, N, C, OC);
}
