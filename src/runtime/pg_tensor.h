/* pg_tensor: contiguous n-dimensional arrays.
 *
 * A tensor is a small value struct (dtype, device, shape, offset) that points
 * at a reference-counted storage. Views (narrow along the first dimension,
 * reshape, the engine's parameter views into its flat buffers) share the
 * storage; it is freed when the last tensor that uses it is released.
 *
 * Ownership: pg_tensor_init_* give the tensor one storage reference;
 * pg_tensor_release() drops it. Copying the struct does not add a reference:
 * use pg_tensor_view() for that. */
#ifndef PG_TENSOR_H
#define PG_TENSOR_H

#include <stddef.h>
#include <stdint.h>

/* Tensors are float32, int32 or bfloat16. float64 and int64 are the runtime's
 * scalars in collectives (loss, gradient norm, parameter counts): no tensor
 * has them, and no dtype name parses to them. */
/* PG_FLOAT16 (IEEE binary16) is a storage type only: safetensors files hold it, ops.from_f16 widens it. */
typedef enum { PG_FLOAT32 = 0, PG_INT32 = 1, PG_BFLOAT16 = 2, PG_FLOAT64 = 3, PG_INT64 = 4, PG_FLOAT16 = 5 } pg_dtype;
typedef enum { PG_CPU = 0, PG_CUDA = 1 } pg_device;

#define PG_MAX_DIMS 8

typedef struct pg_storage {
  void *data;
  size_t bytes;
  int refcount;
  int owns_data; /* 0: data belongs to someone else who outlives us */
  pg_device device;
  int device_index;    /* which device of its kind (cuda:N) */
  size_t mapped_bytes; /* > 0: data is a mapping of this many bytes (munmap instead of free) */
  void (*free_data)(void *data, void *arg); /* set: how owned data is released (device memory) */
  void *free_arg;
} pg_storage;

typedef struct pg_tensor {
  pg_storage *storage; /* NULL once released */
  size_t offset;       /* in elements from storage->data */
  pg_dtype dtype;
  pg_device device;
  int ndim;
  int64_t shape[PG_MAX_DIMS];
  int64_t numel;
} pg_tensor;

size_t pg_dtype_size(pg_dtype d);
const char *pg_dtype_name(pg_dtype d);
int pg_dtype_from_name(const char *name, pg_dtype *out); /* PG_OK or PG_ERR */
/* Whether v can be stored as an element of dtype d: an int32 element needs an
 * integer in [-2^31, 2^31); floats take any number. PG_ERR names the value. */
int pg_dtype_check_value(pg_dtype d, double v);
const char *pg_device_name(pg_device d);

/* `bytes` zeroed bytes for a large runtime buffer (free() releases them):
 * 2 MiB-aligned from 4 MiB up, so that the kernel can back them with huge
 * pages. NULL when out of memory. */
void *pg_alloc_zeroed(size_t bytes);

/* A storage of `bytes` zeroed bytes, refcount 1. NULL + pg_error() on failure. */
pg_storage *pg_storage_new(size_t bytes, pg_device device);
/* A storage around memory allocated elsewhere (a backend's device memory),
 * released with free_data(data, free_arg) when the last reference goes. */
pg_storage *pg_storage_wrap(void *data, size_t bytes, pg_device device, int device_index,
                            void (*free_data)(void *data, void *arg), void *free_arg);
void pg_storage_retain(pg_storage *s);
void pg_storage_release(pg_storage *s);

/* New zeroed tensor with its own storage; a shape too large (pg_shape_numel)
 * or memory that cannot be had is an error naming the shape. */
int pg_tensor_init(pg_tensor *t, pg_dtype dtype, int ndim, const int64_t *shape);
/* A tensor over an existing storage at `offset` elements (adds a reference). */
int pg_tensor_init_view(pg_tensor *t, pg_storage *s, size_t offset, pg_dtype dtype, int ndim,
                        const int64_t *shape);
void pg_tensor_release(pg_tensor *t);

static inline void *pg_tensor_data(const pg_tensor *t) {
  return (char *)t->storage->data + t->offset * pg_dtype_size(t->dtype);
}
static inline float *pg_tensor_f32(const pg_tensor *t) { return (float *)pg_tensor_data(t); }
static inline int32_t *pg_tensor_i32(const pg_tensor *t) { return (int32_t *)pg_tensor_data(t); }

/* Writes "[2, 3] float32" into buf. */
const char *pg_tensor_describe(const pg_tensor *t, char *buf, size_t n);
int pg_shape_equal(const pg_tensor *a, const pg_tensor *b);
/* Elements of a shape, or -1 when it is too large for a tensor (pg_size.h:
 * more than PG_MAX_NUMEL, counting the nonzero sizes). Every tensor has a
 * shape that passed this, so products of its sizes and indices below its
 * numel fit int64 and size_t. */
int64_t pg_shape_numel(int ndim, const int64_t *shape);

/* out = a view of rows [start, start+len) along `dim` when that is contiguous
 * in memory (dim 0, or every earlier dim has size 1), else PG_ERR. */
int pg_tensor_narrow_view(pg_tensor *out, const pg_tensor *t, int dim, int64_t start, int64_t len);
/* out = new contiguous copy of that slice, any dim. */
int pg_tensor_narrow_copy(pg_tensor *out, const pg_tensor *t, int dim, int64_t start, int64_t len);
/* PG_OK when rows [start, start+len) of `dim` are in t, else PG_ERR naming them (narrow's check, for the
 * device copies of pg_backend.h). */
int pg_tensor_check_narrow(const pg_tensor *t, int dim, int64_t start, int64_t len);
/* out = view with another shape of the same numel. */
int pg_tensor_reshape_view(pg_tensor *out, const pg_tensor *t, int ndim, const int64_t *shape);
/* out = new contiguous tensor with dims a and b swapped (0-based; torch's
 * t.transpose(a, b).contiguous()). */
int pg_tensor_transpose(pg_tensor *out, const pg_tensor *t, int a, int b);
/* out = softmax of t along dim (0-based; float32; max-subtracted, sums in double). */
int pg_tensor_softmax(pg_tensor *out, const pg_tensor *t, int dim);
/* values = max of t along dim, kept as a size-1 dim (as pg_tensor_reduce_dim);
 * indices = int32, 0-based, the first maximum's position. */
int pg_tensor_max_dim(pg_tensor *values, pg_tensor *indices, const pg_tensor *t, int dim);
/* out = the n tensors joined along dim (same dtype, same sizes elsewhere). */
int pg_tensor_cat(pg_tensor *out, const pg_tensor *const *ts, int n, int dim);
/* shape = the shape of that join, or PG_ERR naming the tensor that does not fit (cat's check). */
int pg_tensor_cat_shape(const pg_tensor *const *ts, int n, int dim, int64_t *shape);
/* out = a @ b (float32): [M, K] @ [K, N], or batched [B, M, K] @ [B, K, N] or
 * @ [K, N] (b broadcast over the batch); sgemm per batch. */
int pg_tensor_matmul(pg_tensor *out, const pg_tensor *a, const pg_tensor *b);
/* out = new contiguous tensor with dims in the order perm (0-based; out dim i is t's dim perm[i]). */
int pg_tensor_permute(pg_tensor *out, const pg_tensor *t, const int *perm);
/* out = the entries idx (int32, 0-based) of t along dim. */
int pg_tensor_index_select(pg_tensor *out, const pg_tensor *t, int dim, const pg_tensor *idx);
/* out[.., j, ..] = t[.., idx[.., j, ..], ..] along dim (torch.gather; idx int32, 0-based, same ndim,
 * no larger than t in the other dims). */
int pg_tensor_gather(pg_tensor *out, const pg_tensor *t, int dim, const pg_tensor *idx);
/* The k largest along dim, largest first (ties: the lower index first); indices int32, 0-based. */
int pg_tensor_topk(pg_tensor *values, pg_tensor *indices, const pg_tensor *t, int k, int dim);
/* out = new tensor, same contents. */
int pg_tensor_clone(pg_tensor *out, const pg_tensor *t);
/* dst <- src (same numel and dtype). */
int pg_tensor_copy(pg_tensor *dst, const pg_tensor *src);

/* Elementwise on float32 or int32; b has a's shape or broadcasts to it (numpy
 * rules: aligned right, size-1 dimensions repeat); out has a's shape and may
 * alias a or b. */
typedef enum { PG_OP_ADD, PG_OP_SUB, PG_OP_MUL, PG_OP_DIV, PG_OP_MAX, PG_OP_MIN } pg_binop;
int pg_tensor_binop(pg_tensor *out, const pg_tensor *a, const pg_tensor *b, pg_binop op);
/* The shape a and b broadcast to together (numpy rules), or PG_ERR naming both. */
int pg_tensor_broadcast_shape(const pg_tensor *a, const pg_tensor *b, int *ndim, int64_t *shape);
/* out = new tensor of that shape, t repeated along its size-1 and missing dims. */
int pg_tensor_expand(pg_tensor *out, const pg_tensor *t, int ndim, const int64_t *shape);
int pg_tensor_scale(pg_tensor *t, double s);
/* out (initialised here) = sum (or mean) along dim, which is kept with size 1. */
int pg_tensor_reduce_dim(pg_tensor *out, const pg_tensor *t, int dim, int mean);
typedef enum {
  PG_UN_SQRT,
  PG_UN_RSQRT,
  PG_UN_EXP,
  PG_UN_LOG,
  PG_UN_TANH,
  PG_UN_NEG,
  PG_UN_ABS,
  PG_UN_POW,
  PG_UN_SIGMOID,
  PG_UN_SILU
} pg_unop;
/* out (initialised here) = op(t) elementwise, float32; arg is the exponent of pow. */
int pg_tensor_unary(pg_tensor *out, const pg_tensor *t, pg_unop op, double arg);
int pg_tensor_fill(pg_tensor *t, double v);
double pg_tensor_sum(const pg_tensor *t);
/* Largest |a-b|; both same shape and dtype. */
int pg_tensor_max_abs_diff(const pg_tensor *a, const pg_tensor *b, double *out);
/* Element `i` (flat index) as a double; set likewise. */
double pg_tensor_get_flat(const pg_tensor *t, int64_t i);
void pg_tensor_set_flat(pg_tensor *t, int64_t i, double v);

/* Concatenate `n` blocks laid out one after another in `src` (each block is a
 * tensor of shape `block`) along dimension `dim` into `dst`. Used by
 * all_gather/reduce_scatter along dims other than 0. */
void pg_tensor_blocks_to_dim(void *dst, const void *src, size_t esize, int ndim, const int64_t *block,
                             int dim, int n);
/* The inverse: split `src` (shape block with block[dim]*n) into n blocks. */
void pg_tensor_dim_to_blocks(void *dst, const void *src, size_t esize, int ndim, const int64_t *block,
                             int dim, int n);

#endif
