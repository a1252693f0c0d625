/* module_regions.c: the communication of the tensor-parallel regions
 * (Megatron's, named once), the row collectives of the sequence-parallel
 * ones, and turning sequence parallelism on for a module by its kind's role. */
#include "module_impl.h"

#include <string.h>

/* ---------------------------------------------------------------- tensor-parallel pieces */

int pg_tp_reduce_forward(pg_module *m, void *y, int64_t n, pg_dtype dtype) {
  return pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, y, n, dtype, PG_REDUCE_SUM);
}

int pg_tp_copy_backward(pg_module *m, float *dx, int64_t n) {
  return pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, dx, n, PG_FLOAT32, PG_REDUCE_SUM);
}

/* Bug fix (kept from the Linear this came from): the gather used to ignore
 * the blocks, so a column-parallel Linear with blocks = 3 and gather_output
 * returned q0|k0|v0|q1|k1|v1 instead of q|k|v (and took the wrong columns of
 * dy in backward). */
int pg_tp_gather_forward(pg_module *m, float *full, const float *mine, float *scratch, int N, int w, int blocks,
                         const int *bw) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t piece = (size_t)N * w, f = sizeof(float);
  if (scratch + (size_t)r * piece != mine &&
      BE(m)->ops->copy(BE(m), scratch + (size_t)r * piece, mine, piece * f, PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  if (pg_all_gather_buf(m->ctx, PG_MODE_TENSOR, scratch, (int64_t)piece, PG_FLOAT32)) return PG_ERR;
  for (int k = 0; k < T; k++)
    for (int b = 0, local = 0; b < blocks; local += bw[b], b++)
      if (BE(m)->ops->copy2d(BE(m), full + (size_t)T * local + (size_t)k * bw[b], (size_t)T * w * f,
                             scratch + (size_t)k * piece + local, (size_t)w * f, (size_t)bw[b] * f, (size_t)N,
                             PG_COPY_DEVICE_TO_DEVICE))
        return PG_ERR;
  return PG_OK;
}

int pg_tp_scatter_forward(pg_module *m, float *mine, const float *full, int N, int w, int blocks, const int *bw) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t f = sizeof(float);
  for (int b = 0, local = 0; b < blocks; local += bw[b], b++)
    if (BE(m)->ops->copy2d(BE(m), mine + local, (size_t)w * f, full + (size_t)T * local + (size_t)r * bw[b],
                           (size_t)T * w * f, (size_t)bw[b] * f, (size_t)N, PG_COPY_DEVICE_TO_DEVICE))
      return PG_ERR;
  return PG_OK;
}

/* ---------------------------------------------------------------- sequence-parallel rows */

int pg_sp_gather_rows(pg_module *m, void *full, const void *mine, int64_t N, int w, pg_dtype dtype) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t es = pg_dtype_size(dtype);
  char *at = (char *)full + (size_t)pg_sp_row0(N, T, r) * w * es;
  size_t bytes = (size_t)pg_sp_rows(N, T, r) * w * es;
  if ((const void *)at != mine && bytes && BE(m)->ops->copy(BE(m), at, mine, bytes, PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  return T > 1 ? pg_all_gather_rows(m->ctx, PG_MODE_TENSOR, full, N, w, dtype) : PG_OK;
}

int pg_sp_reduce_scatter_rows(pg_module *m, void *full, void *mine, int64_t N, int w, pg_dtype dtype) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t es = pg_dtype_size(dtype);
  if (T > 1 && pg_reduce_scatter_rows(m->ctx, PG_MODE_TENSOR, full, N, w, dtype, PG_REDUCE_SUM)) return PG_ERR;
  size_t bytes = (size_t)pg_sp_rows(N, T, r) * w * es;
  if (!mine || !bytes) return PG_OK;
  return BE(m)->ops->copy(BE(m), mine, (char *)full + (size_t)pg_sp_row0(N, T, r) * w * es, bytes,
                          PG_COPY_DEVICE_TO_DEVICE);
}

/* ---------------------------------------------------------------- regions by name, sequence parallelism on */

int pg_tp_region_from_name(const char *name, int is_input, pg_tp_region *out) {
  /* the middle name differs: an input may be "copy" (copy-to), an output "reduce" (reduce-from) */
  const char *middle = is_input ? "copy" : "reduce";
  if (name && !strcmp(name, "replicated")) *out = PG_TP_REPLICATED;
  else if (name && !strcmp(name, middle)) *out = is_input ? PG_TP_COPY : PG_TP_REDUCE;
  else if (name && !strcmp(name, "split")) *out = PG_TP_SPLIT;
  else
    return pg_fail("tensor_parallel.%s must be 'replicated', '%s' or 'split', got '%s'", is_input ? "input" : "output",
                   middle, name ? name : "(none)");
  return PG_OK;
}

int pg_module_sequence_parallel(pg_module *m) {
  if (tp_size(m->ctx) == 1) return PG_OK; /* every rank's rows are all the rows */
  if (m->out || m->dinp || m->nslots)
    return pg_fail("%s: sequence parallelism must be turned on before the buffers are allocated", m->name);
  pg_sp_role role = kind_sp_role(m);
  if (role == PG_SP_ALL_ROWS)
    return pg_fail("%s: the %s kind needs every row of the micro-batch; under sequence parallelism it goes between "
                   "sp_gather and sp_scatter", m->name, m->ops->kind);
  /* replicated parameters of a row-wise module see only this rank's rows (the containers among them own none) */
  int row_wise = role == PG_SP_ROW_WISE;
  for (int i = 0; row_wise && i < m->nparams; i++)
    if (m->params[i]->replicated) m->params[i]->sequence_parallel = 1;
  m->sp = 1;
  return PG_OK;
}
