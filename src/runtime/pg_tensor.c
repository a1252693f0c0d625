#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include "pg_tensor.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <cblas.h>

#include "kernels.h"
#include "pg_error.h"
#include "pg_size.h"

size_t pg_dtype_size(pg_dtype d) { return d == PG_BFLOAT16 || d == PG_FLOAT16 ? 2 : d == PG_FLOAT64 || d == PG_INT64 ? 8 : 4; }

const char *pg_dtype_name(pg_dtype d) {
  switch (d) {
  case PG_FLOAT32: return "float32";
  case PG_INT32: return "int32";
  case PG_BFLOAT16: return "bfloat16";
  case PG_FLOAT64: return "float64";
  case PG_INT64: return "int64";
  case PG_FLOAT16: return "float16";
  }
  return "?";
}

int pg_dtype_from_name(const char *name, pg_dtype *out) {
  if (!strcmp(name, "float32") || !strcmp(name, "float")) *out = PG_FLOAT32;
  else if (!strcmp(name, "int32") || !strcmp(name, "int")) *out = PG_INT32;
  else if (!strcmp(name, "bfloat16")) *out = PG_BFLOAT16;
  else if (!strcmp(name, "float16")) *out = PG_FLOAT16;
  else return pg_fail("unknown dtype '%s' (expected float32, int32, bfloat16 or float16)", name);
  return PG_OK;
}

const char *pg_device_name(pg_device d) { return d == PG_CUDA ? "cuda" : "cpu"; }

#define PG_HUGE_MIN ((size_t)4 << 20) /* bytes from which a buffer asks for 2 MiB pages */
#define PG_HUGE_ALIGN ((size_t)2 << 20)

void *pg_alloc_zeroed(size_t bytes) {
  if (bytes < PG_HUGE_MIN) return calloc(1, bytes ? bytes : 1);
  size_t rounded = (bytes + PG_HUGE_ALIGN - 1) & ~(PG_HUGE_ALIGN - 1);
  void *p = aligned_alloc(PG_HUGE_ALIGN, rounded);
  if (!p) return NULL;
  /* Huge pages where the system gives them on request (THP "madvise" mode):
   * fewer TLB misses when sgemm packs the weights and when AdamW and the
   * reductions stream through the flat buffers (GPT-2 124M step, 2 threads:
   * forward + backward ~5% faster, median of 4 interleaved pairs). Advice
   * only: without THP nothing changes. */
  madvise(p, rounded, MADV_HUGEPAGE);
  memset(p, 0, rounded);
  return p;
}

pg_storage *pg_storage_new(size_t bytes, pg_device device) {
  if (device != PG_CPU) return pg_fail_null("device %s storage is not available in this build", pg_device_name(device));
  pg_storage *s = calloc(1, sizeof *s);
  if (!s) return pg_fail_null("out of memory allocating a storage header");
  size_t rounded = (bytes + 63) & ~(size_t)63; /* 64-byte multiples: aligned_alloc wants them */
  if (rounded == 0) rounded = 64;
  s->data = rounded >= PG_HUGE_MIN ? pg_alloc_zeroed(rounded) : aligned_alloc(64, rounded);
  if (!s->data) {
    free(s);
    return pg_fail_null("out of memory allocating %zu bytes", bytes);
  }
  if (rounded < PG_HUGE_MIN) memset(s->data, 0, rounded);
  s->bytes = bytes;
  s->refcount = 1;
  s->owns_data = 1;
  s->device = device;
  return s;
}

void pg_storage_retain(pg_storage *s) { s->refcount++; }

pg_storage *pg_storage_wrap(void *data, size_t bytes, pg_device device, int device_index,
                            void (*free_data)(void *data, void *arg), void *free_arg) {
  pg_storage *s = calloc(1, sizeof *s);
  if (!s) return pg_fail_null("out of memory allocating a storage header");
  s->data = data;
  s->bytes = bytes;
  s->refcount = 1;
  s->owns_data = 1;
  s->device = device;
  s->device_index = device_index;
  s->free_data = free_data;
  s->free_arg = free_arg;
  return s;
}

void pg_storage_release(pg_storage *s) {
  if (!s || --s->refcount > 0) return;
  if (s->owns_data && s->free_data) s->free_data(s->data, s->free_arg);
  else if (s->owns_data && s->mapped_bytes) munmap(s->data, s->mapped_bytes);
  else if (s->owns_data) free(s->data);
  free(s);
}

int64_t pg_shape_numel(int ndim, const int64_t *shape) { return pg_size_product(ndim, shape); }

/* "[2, 3]" */
static const char *describe_shape(int ndim, const int64_t *shape, char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < ndim && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)shape[i]);
  if (k < n) snprintf(buf + k, n - k, "]");
  return buf;
}

static int check_shape(int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > PG_MAX_DIMS) return pg_fail("a tensor has 0 to %d dimensions, not %d", PG_MAX_DIMS, ndim);
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 0) return pg_fail("dimension %d has negative size %lld", i + 1, (long long)shape[i]);
  if (pg_size_product(ndim, shape) < 0) {
    char b[256];
    return pg_fail("a tensor of shape %s is too large: its sizes (other than 0) multiply to more than 2^59 elements",
                   describe_shape(ndim, shape, b, sizeof b));
  }
  return PG_OK;
}

static void set_shape(pg_tensor *t, pg_dtype dtype, int ndim, const int64_t *shape) {
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  for (int i = ndim; i < PG_MAX_DIMS; i++) t->shape[i] = 1;
  t->numel = pg_shape_numel(ndim, shape);
}

int pg_tensor_init(pg_tensor *t, pg_dtype dtype, int ndim, const int64_t *shape) {
  memset(t, 0, sizeof *t);
  if (check_shape(ndim, shape)) return PG_ERR;
  set_shape(t, dtype, ndim, shape);
  t->storage = pg_storage_new((size_t)t->numel * pg_dtype_size(dtype), PG_CPU);
  if (!t->storage) {
    char b[256], m[512];
    snprintf(m, sizeof m, "%s", pg_error());
    return pg_fail("a tensor of shape %s %s: %s", describe_shape(ndim, shape, b, sizeof b), pg_dtype_name(dtype), m);
  }
  t->device = PG_CPU;
  return PG_OK;
}

int pg_tensor_init_view(pg_tensor *t, pg_storage *s, size_t offset, pg_dtype dtype, int ndim,
                        const int64_t *shape) {
  memset(t, 0, sizeof *t);
  if (check_shape(ndim, shape)) return PG_ERR;
  set_shape(t, dtype, ndim, shape);
  size_t room = s->bytes / pg_dtype_size(dtype); /* elements; compared without adding, which could wrap */
  if (offset > room || (size_t)t->numel > room - offset)
    return pg_fail("view of %lld elements at offset %zu overruns a storage of %zu bytes", (long long)t->numel,
                   offset, s->bytes);
  pg_storage_retain(s);
  t->storage = s;
  t->offset = offset;
  t->device = s->device;
  return PG_OK;
}

void pg_tensor_release(pg_tensor *t) {
  if (t->storage) pg_storage_release(t->storage);
  t->storage = NULL;
}

const char *pg_tensor_describe(const pg_tensor *t, char *buf, size_t n) {
  size_t k = 0;
  k += snprintf(buf + k, n - k, "[");
  for (int i = 0; i < t->ndim && k < n; i++) k += snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  if (k < n) snprintf(buf + k, n - k, "] %s", pg_dtype_name(t->dtype));
  return buf;
}

int pg_shape_equal(const pg_tensor *a, const pg_tensor *b) {
  if (a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

static int check_narrow(const pg_tensor *t, int dim, int64_t start, int64_t len) {
  if (dim < 0 || dim >= t->ndim) return pg_fail("narrow: dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  /* start + len could wrap around (len = math.maxinteger): compare with what is left after start */
  int64_t end;
  if (start < 0 || len < 0 || start > t->shape[dim] || len > t->shape[dim] - start) {
    if (len < 0) return pg_fail("narrow: length %lld is negative (dimension %d)", (long long)len, dim + 1);
    if (pg_add_overflows(start, len, &end)) /* start + 1 fits: start + len overflowed with len > 0 */
      return pg_fail("narrow: %lld elements from element %lld out of range for dimension %d of size %lld",
                     (long long)len, (long long)start + 1, dim + 1, (long long)t->shape[dim]);
    return pg_fail("narrow: elements %lld..%lld out of range for dimension %d of size %lld", (long long)start + 1,
                   (long long)end, dim + 1, (long long)t->shape[dim]);
  }
  return PG_OK;
}

int pg_tensor_check_narrow(const pg_tensor *t, int dim, int64_t start, int64_t len) {
  return check_narrow(t, dim, start, len);
}

int pg_tensor_narrow_view(pg_tensor *out, const pg_tensor *t, int dim, int64_t start, int64_t len) {
  if (check_narrow(t, dim, start, len)) return PG_ERR;
  for (int i = 0; i < dim; i++)
    if (t->shape[i] != 1) return pg_fail("narrow along dimension %d is not contiguous", dim + 1);
  int64_t inner = 1;
  for (int i = dim + 1; i < t->ndim; i++) inner *= t->shape[i];
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = len;
  return pg_tensor_init_view(out, t->storage, t->offset + (size_t)(start * inner), t->dtype, t->ndim, shape);
}

int pg_tensor_narrow_copy(pg_tensor *out, const pg_tensor *t, int dim, int64_t start, int64_t len) {
  if (check_narrow(t, dim, start, len)) return PG_ERR;
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = len;
  if (pg_tensor_init(out, t->dtype, t->ndim, shape)) return PG_ERR;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; i++) outer *= t->shape[i];
  for (int i = dim + 1; i < t->ndim; i++) inner *= t->shape[i];
  size_t es = pg_dtype_size(t->dtype);
  const char *src = pg_tensor_data(t);
  char *dst = pg_tensor_data(out);
  for (int64_t o = 0; o < outer; o++)
    memcpy(dst + (size_t)(o * len * inner) * es, src + (size_t)((o * t->shape[dim] + start) * inner) * es,
           (size_t)(len * inner) * es);
  return PG_OK;
}

int pg_tensor_reshape_view(pg_tensor *out, const pg_tensor *t, int ndim, const int64_t *shape) {
  if (check_shape(ndim, shape)) return PG_ERR;
  int64_t n = pg_shape_numel(ndim, shape); /* -1: too many to count (check_shape said so) */
  if (n != t->numel) {
    char b[128];
    return pg_fail("reshape: %lld elements cannot be viewed as %lld (tensor %s)", (long long)t->numel, (long long)n,
                   pg_tensor_describe(t, b, sizeof b));
  }
  return pg_tensor_init_view(out, t->storage, t->offset, t->dtype, ndim, shape);
}

int pg_tensor_transpose(pg_tensor *out, const pg_tensor *t, int a, int b) {
  if (a < 0 || b < 0 || a >= t->ndim || b >= t->ndim)
    return pg_fail("transpose: dimensions %d and %d out of range for a %d-d tensor", a + 1, b + 1, t->ndim);
  if (a > b) {
    int x = a;
    a = b;
    b = x;
  }
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[a] = t->shape[b];
  shape[b] = t->shape[a];
  if (pg_tensor_init(out, t->dtype, t->ndim, shape)) return PG_ERR;
  /* [outer, na, mid, nb, inner] -> [outer, nb, mid, na, inner] */
  int64_t outer = 1, mid = 1, inner = 1, na = t->shape[a], nb = t->shape[b];
  for (int i = 0; i < a; i++) outer *= t->shape[i];
  for (int i = a + 1; i < b; i++) mid *= t->shape[i];
  for (int i = b + 1; i < t->ndim; i++) inner *= t->shape[i];
  size_t es = pg_dtype_size(t->dtype), run = (size_t)inner * es;
  const char *src = pg_tensor_data(t);
  char *dst = pg_tensor_data(out);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < na; i++)
      for (int64_t m = 0; m < mid; m++)
        for (int64_t j = 0; j < nb; j++)
          memcpy(dst + (size_t)((((o * nb + j) * mid + m) * na + i) * inner) * es,
                 src + (size_t)((((o * na + i) * mid + m) * nb + j) * inner) * es, run);
  return PG_OK;
}

/* outer x len x inner around dim */
static void split_at(const pg_tensor *t, int dim, int64_t *outer, int64_t *len, int64_t *inner) {
  *outer = *inner = 1;
  for (int i = 0; i < dim; i++) *outer *= t->shape[i];
  for (int i = dim + 1; i < t->ndim; i++) *inner *= t->shape[i];
  *len = t->shape[dim];
}

int pg_tensor_softmax(pg_tensor *out, const pg_tensor *t, int dim) {
  if (t->dtype != PG_FLOAT32) return pg_fail("softmax needs a float32 tensor, not %s", pg_dtype_name(t->dtype));
  if (dim < 0 || dim >= t->ndim) return pg_fail("softmax: dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  if (pg_tensor_init(out, PG_FLOAT32, t->ndim, t->shape)) return PG_ERR;
  int64_t outer, len, inner;
  split_at(t, dim, &outer, &len, &inner);
  const float *x = pg_tensor_f32(t);
  float *y = pg_tensor_f32(out);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t k = 0; k < inner; k++) {
      const float *xs = x + o * len * inner + k;
      float *ys = y + o * len * inner + k;
      float m = -INFINITY;
      for (int64_t j = 0; j < len; j++) m = xs[j * inner] > m ? xs[j * inner] : m;
      double sum = 0;
      for (int64_t j = 0; j < len; j++) sum += exp((double)xs[j * inner] - m);
      for (int64_t j = 0; j < len; j++) ys[j * inner] = (float)(exp((double)xs[j * inner] - m) / sum);
    }
  return PG_OK;
}

int pg_tensor_max_dim(pg_tensor *values, pg_tensor *indices, const pg_tensor *t, int dim) {
  if (dim < 0 || dim >= t->ndim) return pg_fail("max: dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  if (t->shape[dim] == 0) return pg_fail("max: dimension %d is empty", dim + 1);
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = 1;
  if (pg_tensor_init(values, t->dtype, t->ndim, shape)) return PG_ERR;
  if (pg_tensor_init(indices, PG_INT32, t->ndim, shape)) {
    pg_tensor_release(values);
    return PG_ERR;
  }
  int64_t outer, len, inner;
  split_at(t, dim, &outer, &len, &inner);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t k = 0; k < inner; k++) {
      int64_t best = 0;
      double bv = pg_tensor_get_flat(t, o * len * inner + k);
      for (int64_t j = 1; j < len; j++) {
        double v = pg_tensor_get_flat(t, (o * len + j) * inner + k);
        if (v > bv || (isnan(v) && !isnan(bv))) best = j, bv = v; /* NaN propagates, as in torch */
      }
      pg_tensor_set_flat(values, o * inner + k, bv);
      pg_tensor_i32(indices)[o * inner + k] = (int32_t)best;
    }
  return PG_OK;
}

int pg_tensor_cat_shape(const pg_tensor *const *ts, int n, int dim, int64_t *shape) {
  if (n < 1) return pg_fail("cat needs at least one tensor");
  const pg_tensor *f = ts[0];
  if (dim < 0 || dim >= f->ndim) return pg_fail("cat: dimension %d out of range for a %d-d tensor", dim + 1, f->ndim);
  memcpy(shape, f->shape, PG_MAX_DIMS * sizeof *shape);
  shape[dim] = 0;
  for (int i = 0; i < n; i++) {
    const pg_tensor *t = ts[i];
    int same = t->ndim == f->ndim && t->dtype == f->dtype;
    for (int d = 0; same && d < f->ndim; d++) same = d == dim || t->shape[d] == f->shape[d];
    if (!same) {
      char a[128], b[128];
      return pg_fail("cat: tensor %d is %s, tensor 1 is %s (all alike but along dimension %d)", i + 1,
                     pg_tensor_describe(t, a, sizeof a), pg_tensor_describe(f, b, sizeof b), dim + 1);
    }
    if (__builtin_add_overflow(shape[dim], t->shape[dim], &shape[dim])) return pg_fail("cat: the result is too large");
  }
  return PG_OK;
}

int pg_tensor_cat(pg_tensor *out, const pg_tensor *const *ts, int n, int dim) {
  int64_t shape[PG_MAX_DIMS];
  if (pg_tensor_cat_shape(ts, n, dim, shape)) return PG_ERR;
  const pg_tensor *f = ts[0];
  if (pg_tensor_init(out, f->dtype, f->ndim, shape)) return PG_ERR;
  int64_t outer, len, inner;
  split_at(out, dim, &outer, &len, &inner);
  size_t es = pg_dtype_size(f->dtype);
  char *dst = pg_tensor_data(out);
  for (int64_t o = 0; o < outer; o++)
    for (int i = 0; i < n; i++) {
      size_t run = (size_t)(ts[i]->shape[dim] * inner) * es;
      memcpy(dst, (const char *)pg_tensor_data(ts[i]) + (size_t)o * run, run);
      dst += run;
    }
  return PG_OK;
}

int pg_tensor_matmul(pg_tensor *out, const pg_tensor *a, const pg_tensor *b) {
  char da[128], db[128];
  if (a->dtype != PG_FLOAT32 || b->dtype != PG_FLOAT32)
    return pg_fail("matmul needs float32 tensors, not %s and %s", pg_dtype_name(a->dtype), pg_dtype_name(b->dtype));
  int batched = a->ndim == 3;
  int ok = (a->ndim == 2 && b->ndim == 2) || (batched && (b->ndim == 2 || (b->ndim == 3 && b->shape[0] == a->shape[0])));
  if (!ok || a->shape[a->ndim - 1] != b->shape[b->ndim - 2])
    return pg_fail("matmul: %s @ %s (want [M, K] @ [K, N], [B, M, K] @ [B, K, N] or [B, M, K] @ [K, N])",
                   pg_tensor_describe(a, da, sizeof da), pg_tensor_describe(b, db, sizeof db));
  int64_t B = batched ? a->shape[0] : 1, M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
  if (M > INT32_MAX || K > INT32_MAX || N > INT32_MAX) return pg_fail("matmul: a dimension exceeds what sgemm takes");
  int64_t shape[3] = {B, M, N};
  if (pg_tensor_init(out, PG_FLOAT32, batched ? 3 : 2, batched ? shape : shape + 1)) return PG_ERR;
  for (int64_t i = 0; i < B; i++) {
    const float *x = pg_tensor_f32(a) + i * M * K, *y = pg_tensor_f32(b) + (b->ndim == 3 ? i * K * N : 0);
    float *z = pg_tensor_f32(out) + i * M * N;
    if (K == 0) {
      memset(z, 0, (size_t)(M * N) * sizeof(float));
      continue;
    }
    if (M && N)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, x, (int)K, y, (int)N, 0.0f, z,
                  (int)N);
  }
  return PG_OK;
}

int pg_tensor_permute(pg_tensor *out, const pg_tensor *t, const int *perm) {
  int64_t shape[PG_MAX_DIMS], stride[PG_MAX_DIMS], from[PG_MAX_DIMS];
  int seen[PG_MAX_DIMS] = {0};
  for (int i = 0; i < t->ndim; i++) {
    if (perm[i] < 0 || perm[i] >= t->ndim || seen[perm[i]]++)
      return pg_fail("permute: the order must name each of the %d dimensions once", t->ndim);
    shape[i] = t->shape[perm[i]];
  }
  for (int64_t d = t->ndim - 1, st = 1; d >= 0; st *= t->shape[d--]) stride[d] = st;
  for (int i = 0; i < t->ndim; i++) from[i] = stride[perm[i]];
  if (pg_tensor_init(out, t->dtype, t->ndim, shape)) return PG_ERR;
  size_t es = pg_dtype_size(t->dtype);
  const char *src = pg_tensor_data(t);
  char *dst = pg_tensor_data(out);
  for (int64_t i = 0; i < out->numel; i++) {
    int64_t rem = i, at = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
      at += (rem % shape[d]) * from[d];
      rem /= shape[d];
    }
    memcpy(dst + (size_t)i * es, src + (size_t)at * es, es);
  }
  return PG_OK;
}

static int check_index(const pg_tensor *idx, int64_t limit, const char *what) {
  if (idx->dtype != PG_INT32) return pg_fail("%s: indices must be int32, not %s", what, pg_dtype_name(idx->dtype));
  for (int64_t i = 0; i < idx->numel; i++)
    if (pg_tensor_i32(idx)[i] < 0 || pg_tensor_i32(idx)[i] >= limit)
      return pg_fail("%s: index %d at position %lld is outside 1..%lld", what, pg_tensor_i32(idx)[i] + 1,
                     (long long)i + 1, (long long)limit);
  return PG_OK;
}

int pg_tensor_index_select(pg_tensor *out, const pg_tensor *t, int dim, const pg_tensor *idx) {
  if (dim < 0 || dim >= t->ndim) return pg_fail("index_select: dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  if (idx->ndim != 1) return pg_fail("index_select: the indices must be 1-d, not %d-d", idx->ndim);
  if (check_index(idx, t->shape[dim], "index_select")) return PG_ERR;
  int64_t shape[PG_MAX_DIMS], outer, len, inner;
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = idx->numel;
  if (pg_tensor_init(out, t->dtype, t->ndim, shape)) return PG_ERR;
  split_at(t, dim, &outer, &len, &inner);
  size_t run = (size_t)inner * pg_dtype_size(t->dtype);
  const char *src = pg_tensor_data(t);
  char *dst = pg_tensor_data(out);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < idx->numel; j++, dst += run)
      memcpy(dst, src + (size_t)(o * len + pg_tensor_i32(idx)[j]) * run, run);
  return PG_OK;
}

int pg_tensor_gather(pg_tensor *out, const pg_tensor *t, int dim, const pg_tensor *idx) {
  char a[128], b[128];
  if (dim < 0 || dim >= t->ndim) return pg_fail("gather: dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  int fits = idx->ndim == t->ndim;
  for (int d = 0; fits && d < t->ndim; d++) fits = d == dim || idx->shape[d] <= t->shape[d];
  if (!fits)
    return pg_fail("gather: indices %s do not fit %s (same dimensions, no larger except along %d)",
                   pg_tensor_describe(idx, a, sizeof a), pg_tensor_describe(t, b, sizeof b), dim + 1);
  if (check_index(idx, t->shape[dim], "gather")) return PG_ERR;
  if (pg_tensor_init(out, t->dtype, idx->ndim, idx->shape)) return PG_ERR;
  int64_t stride[PG_MAX_DIMS];
  for (int64_t d = t->ndim - 1, st = 1; d >= 0; st *= t->shape[d--]) stride[d] = st;
  for (int64_t i = 0; i < out->numel; i++) {
    int64_t rem = i, at = 0;
    for (int d = idx->ndim - 1; d >= 0; d--) {
      int64_t c = rem % idx->shape[d];
      rem /= idx->shape[d];
      at += (d == dim ? pg_tensor_i32(idx)[i] : c) * stride[d];
    }
    pg_tensor_set_flat(out, i, pg_tensor_get_flat(t, at));
  }
  return PG_OK;
}

int pg_tensor_topk(pg_tensor *values, pg_tensor *indices, const pg_tensor *t, int k, int dim) {
  if (dim < 0 || dim >= t->ndim) return pg_fail("topk: dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  if (k < 0 || k > t->shape[dim])
    return pg_fail("topk: k = %d, but dimension %d has %lld entries", k, dim + 1, (long long)t->shape[dim]);
  int64_t shape[PG_MAX_DIMS], outer, len, inner;
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = k;
  if (pg_tensor_init(values, t->dtype, t->ndim, shape)) return PG_ERR;
  if (pg_tensor_init(indices, PG_INT32, t->ndim, shape)) {
    pg_tensor_release(values);
    return PG_ERR;
  }
  split_at(t, dim, &outer, &len, &inner);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t c = 0; c < inner; c++)
      for (int j = 0; j < k; j++) { /* selection: k passes, each the largest not yet taken */
        int64_t best = -1;
        double bv = 0;
        for (int64_t m = 0; m < len; m++) {
          int taken = 0;
          for (int q = 0; q < j && !taken; q++) taken = pg_tensor_i32(indices)[(o * k + q) * inner + c] == m;
          double v = pg_tensor_get_flat(t, (o * len + m) * inner + c);
          if (!taken && (best < 0 || v > bv || (isnan(v) && !isnan(bv)))) best = m, bv = v;
        }
        pg_tensor_set_flat(values, (o * k + j) * inner + c, bv);
        pg_tensor_i32(indices)[(o * k + j) * inner + c] = (int32_t)best;
      }
  return PG_OK;
}

int pg_tensor_clone(pg_tensor *out, const pg_tensor *t) {
  if (pg_tensor_init(out, t->dtype, t->ndim, t->shape)) return PG_ERR;
  memcpy(pg_tensor_data(out), pg_tensor_data(t), (size_t)t->numel * pg_dtype_size(t->dtype));
  return PG_OK;
}

int pg_tensor_copy(pg_tensor *dst, const pg_tensor *src) {
  if (dst->numel != src->numel || dst->dtype != src->dtype) {
    char a[128], b[128];
    return pg_fail("copy: destination %s and source %s differ", pg_tensor_describe(dst, a, sizeof a),
                   pg_tensor_describe(src, b, sizeof b));
  }
  memmove(pg_tensor_data(dst), pg_tensor_data(src), (size_t)src->numel * pg_dtype_size(src->dtype));
  return PG_OK;
}

#define BINOP_LOOP(T, o, a, b, n, op)                                                                      \
  do {                                                                                                     \
    switch (op) {                                                                                          \
    case PG_OP_ADD: for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i]; break;                             \
    case PG_OP_SUB: for (int64_t i = 0; i < n; i++) o[i] = a[i] - b[i]; break;                             \
    case PG_OP_MUL: for (int64_t i = 0; i < n; i++) o[i] = a[i] * b[i]; break;                             \
    case PG_OP_DIV: for (int64_t i = 0; i < n; i++) o[i] = a[i] / b[i]; break;                             \
    case PG_OP_MAX: for (int64_t i = 0; i < n; i++) o[i] = a[i] > b[i] ? a[i] : b[i]; break;               \
    case PG_OP_MIN: for (int64_t i = 0; i < n; i++) o[i] = a[i] < b[i] ? a[i] : b[i]; break;               \
    }                                                                                                      \
  } while (0)

/* int32 arithmetic wraps around modulo 2^32, as torch's and numpy's do: the
 * sums are taken in uint32_t (signed overflow is undefined in C). */
static int32_t i32_op(pg_binop op, int32_t x, int32_t y) {
  switch (op) {
  case PG_OP_ADD: return (int32_t)((uint32_t)x + (uint32_t)y);
  case PG_OP_SUB: return (int32_t)((uint32_t)x - (uint32_t)y);
  case PG_OP_MUL: return (int32_t)((uint32_t)x * (uint32_t)y);
  case PG_OP_DIV: return x / y; /* the caller refused y == 0 and INT32_MIN / -1 */
  case PG_OP_MAX: return x > y ? x : y;
  case PG_OP_MIN: return x < y ? x : y;
  }
  return 0;
}

/* Integer division that C leaves undefined (x86 traps on both: SIGFPE). */
static int check_i32_div(int32_t x, int32_t y, int64_t i) {
  if (y == 0) return pg_fail("integer division by zero at element %lld", (long long)i + 1);
  if (y == -1 && x == INT32_MIN)
    return pg_fail("integer division overflow at element %lld: %d / -1 does not fit an int32", (long long)i + 1, x);
  return PG_OK;
}

/* b broadcasts to a's shape (numpy rules, aligned right, size-1 dims repeat):
 * fills per-dimension strides of b over a's index space. */
static int broadcast_strides(const pg_tensor *a, const pg_tensor *b, int64_t *bstride) {
  if (b->ndim > a->ndim) return PG_ERR;
  int64_t st = 1;
  for (int d = a->ndim - 1; d >= 0; d--) {
    int bd = d - (a->ndim - b->ndim);
    int64_t size = bd >= 0 ? b->shape[bd] : 1;
    if (size == a->shape[d]) bstride[d] = st;
    else if (size == 1) bstride[d] = 0;
    else return PG_ERR;
    st *= size;
  }
  return PG_OK;
}

/* Flat index into b (strides from broadcast_strides) of element i of a tensor of a's shape. */
static int64_t broadcast_index(const pg_tensor *a, const int64_t *bstride, int64_t i) {
  int64_t bi = 0;
  for (int d = a->ndim - 1; d >= 0; d--) {
    bi += (i % a->shape[d]) * bstride[d];
    i /= a->shape[d];
  }
  return bi;
}

int pg_tensor_broadcast_shape(const pg_tensor *a, const pg_tensor *b, int *ndim, int64_t *shape) {
  int n = a->ndim > b->ndim ? a->ndim : b->ndim;
  for (int d = 0; d < n; d++) {
    int ad = d - (n - a->ndim), bd = d - (n - b->ndim);
    int64_t x = ad >= 0 ? a->shape[ad] : 1, y = bd >= 0 ? b->shape[bd] : 1;
    if (x != y && x != 1 && y != 1) {
      char da[128], db[128];
      return pg_fail("shapes do not broadcast: %s vs %s (dimension %d from the right: %lld vs %lld)",
                     pg_tensor_describe(a, da, sizeof da), pg_tensor_describe(b, db, sizeof db), n - d,
                     (long long)x, (long long)y);
    }
    shape[d] = x == 1 ? y : x;
  }
  *ndim = n;
  return PG_OK;
}

int pg_tensor_expand(pg_tensor *out, const pg_tensor *t, int ndim, const int64_t *shape) {
  if (pg_tensor_init(out, t->dtype, ndim, shape)) return PG_ERR;
  int64_t st[PG_MAX_DIMS];
  if (broadcast_strides(out, t, st)) {
    char d[128];
    pg_tensor_release(out);
    return pg_fail("expand: %s does not broadcast to that shape", pg_tensor_describe(t, d, sizeof d));
  }
  for (int64_t i = 0; i < out->numel; i++) pg_tensor_set_flat(out, i, pg_tensor_get_flat(t, broadcast_index(out, st, i)));
  return PG_OK;
}

static double apply_op(pg_binop op, double x, double y) {
  switch (op) {
  case PG_OP_ADD: return x + y;
  case PG_OP_SUB: return x - y;
  case PG_OP_MUL: return x * y;
  case PG_OP_DIV: return x / y;
  case PG_OP_MAX: return x > y ? x : y;
  case PG_OP_MIN: return x < y ? x : y;
  }
  return 0;
}

int pg_tensor_binop(pg_tensor *out, const pg_tensor *a, const pg_tensor *b, pg_binop op) {
  char da[128], db[128];
  if (a->dtype != b->dtype)
    return pg_fail("shapes differ: %s vs %s", pg_tensor_describe(a, da, sizeof da), pg_tensor_describe(b, db, sizeof db));
  if (!pg_shape_equal(out, a) || out->dtype != a->dtype)
    return pg_fail("output %s does not match inputs %s", pg_tensor_describe(out, da, sizeof da),
                   pg_tensor_describe(a, db, sizeof db));
  int64_t n = a->numel;
  if (!pg_shape_equal(a, b)) {
    int64_t bstride[PG_MAX_DIMS];
    if (broadcast_strides(a, b, bstride))
      return pg_fail("shapes differ: %s vs %s", pg_tensor_describe(a, da, sizeof da), pg_tensor_describe(b, db, sizeof db));
    if (a->dtype == PG_INT32) {
      const int32_t *x = pg_tensor_i32(a), *y = pg_tensor_i32(b);
      if (op == PG_OP_DIV)
        for (int64_t i = 0; i < n; i++)
          if (check_i32_div(x[i], y[broadcast_index(a, bstride, i)], i)) return PG_ERR;
      int32_t *o = pg_tensor_i32(out);
      for (int64_t i = 0; i < n; i++) o[i] = i32_op(op, x[i], y[broadcast_index(a, bstride, i)]);
      return PG_OK;
    }
    for (int64_t i = 0; i < n; i++)
      pg_tensor_set_flat(out, i, apply_op(op, pg_tensor_get_flat(a, i), pg_tensor_get_flat(b, broadcast_index(a, bstride, i))));
    return PG_OK;
  }
  if (a->dtype == PG_FLOAT32) {
    float *o = pg_tensor_f32(out);
    const float *x = pg_tensor_f32(a), *y = pg_tensor_f32(b);
    BINOP_LOOP(float, o, x, y, n, op);
  } else if (a->dtype == PG_INT32) {
    int32_t *o = pg_tensor_i32(out);
    const int32_t *x = pg_tensor_i32(a), *y = pg_tensor_i32(b);
    if (op == PG_OP_DIV)
      for (int64_t i = 0; i < n; i++)
        if (check_i32_div(x[i], y[i], i)) return PG_ERR;
    if (op == PG_OP_MAX || op == PG_OP_MIN) BINOP_LOOP(int32_t, o, x, y, n, op);
    else
      for (int64_t i = 0; i < n; i++) o[i] = i32_op(op, x[i], y[i]);
  } else {
    return pg_fail("elementwise ops support float32 and int32, not %s", pg_dtype_name(a->dtype));
  }
  return PG_OK;
}

int pg_tensor_reduce_dim(pg_tensor *out, const pg_tensor *t, int dim, int mean) {
  if (dim < 0 || dim >= t->ndim) return pg_fail("dimension %d out of range for a %d-d tensor", dim + 1, t->ndim);
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = 1;
  if (pg_tensor_init(out, t->dtype == PG_INT32 && !mean ? PG_INT32 : PG_FLOAT32, t->ndim, shape)) return PG_ERR;
  int64_t outer = 1, inner = 1, len = t->shape[dim];
  for (int i = 0; i < dim; i++) outer *= t->shape[i];
  for (int i = dim + 1; i < t->ndim; i++) inner *= t->shape[i];
  for (int64_t o = 0; o < outer; o++)
    for (int64_t k = 0; k < inner; k++) {
      double acc = 0;
      for (int64_t j = 0; j < len; j++) acc += pg_tensor_get_flat(t, (o * len + j) * inner + k);
      pg_tensor_set_flat(out, o * inner + k, mean && len ? acc / (double)len : acc);
    }
  return PG_OK;
}

int pg_tensor_unary(pg_tensor *out, const pg_tensor *t, pg_unop op, double arg) {
  if (t->dtype != PG_FLOAT32) return pg_fail("%s needs a float32 tensor, not %s", "this op", pg_dtype_name(t->dtype));
  if (pg_tensor_init(out, PG_FLOAT32, t->ndim, t->shape)) return PG_ERR;
  const float *x = pg_tensor_f32(t);
  float *y = pg_tensor_f32(out);
  for (int64_t i = 0; i < t->numel; i++) {
    double v = x[i];
    switch (op) {
    case PG_UN_SQRT: v = sqrt(v); break;
    case PG_UN_RSQRT: v = 1.0 / sqrt(v); break;
    case PG_UN_EXP: v = exp(v); break;
    case PG_UN_LOG: v = log(v); break;
    case PG_UN_TANH: v = tanh(v); break;
    case PG_UN_NEG: v = -v; break;
    case PG_UN_ABS: v = fabs(v); break;
    case PG_UN_POW: v = pow(v, arg); break;
    case PG_UN_SIGMOID: v = 1.0 / (1.0 + exp(-v)); break;
    case PG_UN_SILU: v = v / (1.0 + exp(-v)); break;
    }
    y[i] = (float)v;
  }
  return PG_OK;
}

double pg_tensor_get_flat(const pg_tensor *t, int64_t i) {
  if (t->dtype == PG_INT32) return pg_tensor_i32(t)[i];
  if (t->dtype == PG_FLOAT32) return pg_tensor_f32(t)[i];
  if (t->dtype == PG_FLOAT16) return pg_f16_value(((const uint16_t *)pg_tensor_data(t))[i]);
  return pg_bf16_value(((const uint16_t *)pg_tensor_data(t))[i]);
}

/* A double as int32 without undefined behaviour: truncated toward zero, then
 * wrapped modulo 2^32 as int32 arithmetic wraps (an int32 sum that outgrew
 * the type); NaN and magnitudes past 2^63 become 0. Values from users are
 * checked before they get here (pg_dtype_check_value). */
static int32_t i32_from_double(double v) {
  if (!(v > -9.2e18 && v < 9.2e18)) return 0;
  return (int32_t)(uint32_t)(uint64_t)(int64_t)v;
}

int pg_dtype_check_value(pg_dtype d, double v) {
  if (d != PG_INT32) return PG_OK; /* floats take any number: out-of-range values round to inf, as in torch */
  if (v != v || v != floor(v)) return pg_fail("%.15g is not an integer: an int32 element needs one", v);
  if (v < INT32_MIN || v > INT32_MAX) return pg_fail("%.15g does not fit an int32 element (-2^31 to 2^31 - 1)", v);
  return PG_OK;
}

void pg_tensor_set_flat(pg_tensor *t, int64_t i, double v) {
  if (t->dtype == PG_INT32) pg_tensor_i32(t)[i] = i32_from_double(v);
  else if (t->dtype == PG_FLOAT32) pg_tensor_f32(t)[i] = (float)v;
  else if (t->dtype == PG_FLOAT16) ((uint16_t *)pg_tensor_data(t))[i] = pg_f16_round((float)v);
  else {
    ((uint16_t *)pg_tensor_data(t))[i] = pg_bf16_round((float)v);
  }
}

int pg_tensor_scale(pg_tensor *t, double s) {
  if (t->dtype != PG_FLOAT32) return pg_fail("scale needs a float32 tensor, not %s", pg_dtype_name(t->dtype));
  float *x = pg_tensor_f32(t), f = (float)s;
  for (int64_t i = 0; i < t->numel; i++) x[i] *= f;
  return PG_OK;
}

int pg_tensor_fill(pg_tensor *t, double v) {
  for (int64_t i = 0; i < t->numel; i++) pg_tensor_set_flat(t, i, v);
  return PG_OK;
}

double pg_tensor_sum(const pg_tensor *t) {
  double s = 0;
  for (int64_t i = 0; i < t->numel; i++) s += pg_tensor_get_flat(t, i);
  return s;
}

int pg_tensor_max_abs_diff(const pg_tensor *a, const pg_tensor *b, double *out) {
  char da[128], db[128];
  if (!pg_shape_equal(a, b) || a->dtype != b->dtype)
    return pg_fail("shapes differ: %s vs %s", pg_tensor_describe(a, da, sizeof da), pg_tensor_describe(b, db, sizeof db));
  double m = 0;
  for (int64_t i = 0; i < a->numel; i++) {
    double d = fabs(pg_tensor_get_flat(a, i) - pg_tensor_get_flat(b, i));
    if (d > m || d != d) m = d; /* NaN propagates */
    if (m != m) break;
  }
  *out = m;
  return PG_OK;
}

void pg_tensor_blocks_to_dim(void *dst, const void *src, size_t esize, int ndim, const int64_t *block, int dim,
                             int n) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; i++) outer *= block[i];
  for (int i = dim; i < ndim; i++) inner *= block[i]; /* one block's row of length block[dim]*rest */
  size_t row = (size_t)inner * esize, bsize = (size_t)(outer * inner) * esize;
  for (int r = 0; r < n; r++)
    for (int64_t o = 0; o < outer; o++)
      memcpy((char *)dst + ((size_t)o * n + r) * row, (const char *)src + r * bsize + o * row, row);
}

void pg_tensor_dim_to_blocks(void *dst, const void *src, size_t esize, int ndim, const int64_t *block, int dim,
                             int n) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; i++) outer *= block[i];
  for (int i = dim; i < ndim; i++) inner *= block[i];
  size_t row = (size_t)inner * esize, bsize = (size_t)(outer * inner) * esize;
  for (int r = 0; r < n; r++)
    for (int64_t o = 0; o < outer; o++)
      memcpy((char *)dst + r * bsize + o * row, (const char *)src + ((size_t)o * n + r) * row, row);
}
