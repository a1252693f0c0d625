/* pg_comm: collectives on tensors over a context's groups.
 *
 * Every function here is collective over the named group: all its members
 * call it in the same order with matching shapes. A group of size 1 makes no
 * MPI call. Host memory goes through MPI; device memory through NCCL once a
 * device engine attached its stream (below). Calls are counted (pg_comm_stats_of). The runtime (engine,
 * optimizer) communicates only through here: no MPI type or call outside
 * pg_comm and pg_context.
 *
 * Agreement and the watchdog (comm_agree.c explains the design): before any
 * data moves, the members of a call exchange what they are calling (kind,
 * dtype, reduction, count, root or peers, tag, call site, and the shape
 * of a gathered or scattered tensor) and wait for each other at
 * most PG_COLLECTIVE_TIMEOUT seconds (default 600, 0: no limit). Records
 * that differ are an error naming both sides; records that never come, a
 * pipeline receive whose sender never sends and a send nobody takes are an
 * error naming the operation and the ranks that never arrived. Either marks
 * the context broken: every later call on it fails with that message. A send
 * (pg_send, pg_sendrecv) waits for its receiver to arrive; the pipeline's
 * pg_isend_buf does not, and under PG_DEBUG=1 ships its record ahead of the
 * data for pg_recv_buf to check (set PG_DEBUG alike on every rank). */
#ifndef PG_COMM_H
#define PG_COMM_H

#include "pg_context.h"
#include "pg_shm.h"
#include "pg_tensor.h"

typedef enum { PG_REDUCE_SUM = 0, PG_REDUCE_MAX, PG_REDUCE_MIN, PG_REDUCE_AVG } pg_reduce_op;

int pg_reduce_op_from_name(const char *name, pg_reduce_op *out);

/* 1 once a call of this process gave up waiting for a partner (the watchdog:
 * PG_COLLECTIVE_TIMEOUT): its error is then most likely a consequence of
 * another rank's failure, which pglua reports after it. */
int pg_comm_timed_out(void);

/* The next call on ctx comes from `site` ("spec.lua:10"; NULL or "": the
 * runtime), which its record carries: pg.dist's bindings say where their Lua
 * caller is, so that ranks calling from different lines disagree. The call
 * consumes it; set it again, or to NULL, around every call. */
void pg_comm_call_site(pg_context *ctx, const char *site);

/* In place. avg needs float32 (the raw form also reduces the runtime's
 * float64 / int64 scalars with sum, max or min). bfloat16 is summed only,
 * round the ring (every member gets the same bits; each step's sum of the
 * widened values rounded, as NCCL's bf16 sums). */
int pg_all_reduce(pg_context *ctx, pg_mode m, pg_tensor *t, pg_reduce_op op);
/* The same on a raw buffer (the runtime's flat gradient buffer). */
int pg_all_reduce_buf(pg_context *ctx, pg_mode m, void *buf, int64_t count, pg_dtype dtype, pg_reduce_op op);
/* out (initialised here) = the members' tensors concatenated along `dim`, in local-rank order. */
int pg_all_gather(pg_context *ctx, pg_mode m, const pg_tensor *in, pg_tensor *out, int dim);
/* out (initialised here) = my block along `dim` of the reduction of everyone's `in`. */
int pg_reduce_scatter(pg_context *ctx, pg_mode m, const pg_tensor *in, pg_tensor *out, int dim, pg_reduce_op op);
/* Raw-buffer forms used by ZeRO: count = elements per member. reduce_scatter
 * with in == out works in place: the result is the first count elements. */
int pg_reduce_scatter_buf(pg_context *ctx, pg_mode m, const void *in, void *out, int64_t count, pg_dtype dtype,
                          pg_reduce_op op);
int pg_all_gather_buf(pg_context *ctx, pg_mode m, void *buf, int64_t count, pg_dtype dtype); /* in place */
/* Ring forms for large float buffers (chunked MPI_Sendrecv, no scratch the
 * size of the data): buf holds n floats cut into `group size` blocks, block b
 * = [n b / size, n (b+1) / size). reduce_scatter leaves the reduction of this
 * member's block in place (the other blocks hold partial results); all_gather
 * copies every member's block to all the others. All members get the same
 * bits. pg_all_reduce_buf uses them for large float buffers. */
int pg_reduce_scatter_inplace(pg_context *ctx, pg_mode m, float *buf, int64_t n, pg_reduce_op op);
int pg_all_gather_inplace(pg_context *ctx, pg_mode m, float *buf, int64_t n);
/* Sequence parallelism's collectives: buf holds `rows` rows of `width`
 * floats and member b's block is rows [rows b / size, rows (b+1) / size) —
 * uneven when size does not divide rows (pg_sp_rows in pg_module.h says the
 * same split). reduce_scatter_rows leaves the reduction of this member's rows
 * in place (the other rows hold partial results); all_gather_rows copies
 * every member's rows to all the others. The ring above, whose blocks are
 * then whole rows; NCCL for device buffers whose rows split evenly. dtype:
 * float32, or bfloat16 (precision bf16's activations; sums only, each step's
 * sum of the widened values rounded, as NCCL's bf16 sums). */
int pg_reduce_scatter_rows(pg_context *ctx, pg_mode m, void *buf, int64_t rows, int64_t width, pg_dtype dtype,
                           pg_reduce_op op);
int pg_all_gather_rows(pg_context *ctx, pg_mode m, void *buf, int64_t rows, int64_t width, pg_dtype dtype);
/* The same over buffers every member maps (pg_shm.h; same blocks): one pass
 * over memory, no copies through MPI. all_reduce writes the result into every
 * member's buffer; reduce_scatter only into this member's block (sum or avg);
 * all_gather copies the other members' blocks of their buffers into ours. */
int pg_shm_all_reduce(pg_context *ctx, const pg_shm *s, int64_t n, pg_reduce_op op);
int pg_shm_reduce_scatter(pg_context *ctx, const pg_shm *s, int64_t n, pg_reduce_op op);
int pg_shm_all_gather(pg_context *ctx, const pg_shm *s, int64_t n);
/* src is a local rank in the group. */
int pg_broadcast(pg_context *ctx, pg_mode m, pg_tensor *t, int src);
int pg_broadcast_buf(pg_context *ctx, pg_mode m, void *buf, int64_t count, pg_dtype dtype, int src);
/* Blocking point-to-point; peers are local ranks in the group and must not be self. A send returns once its
 * receiver has arrived (the agreement step), as an MPI synchronous send: two ranks that both send first fail. */
int pg_send(pg_context *ctx, pg_mode m, const pg_tensor *t, int dst, int tag);
int pg_recv(pg_context *ctx, pg_mode m, pg_tensor *t, int src, int tag);
/* Send one tensor and receive another in one deadlock-free call (rings, self included). */
int pg_sendrecv(pg_context *ctx, pg_mode m, const pg_tensor *send, int dst, pg_tensor *recv, int src, int tag);
int pg_barrier(pg_context *ctx, pg_mode m);
/* All-to-all with variable counts (MPI_Alltoallv): this member sends
 * send_counts[j] elements to member j, from `send` packed in member order,
 * and receives recv_counts[i] elements from member i into `recv`, packed in
 * member order. recv_counts[i] must be what member i sends here: checked
 * after the agreement step by one exchange of the counts (a mismatch is the
 * same error on every member, naming both ranks and the counts). Totals are
 * at most INT_MAX elements per member; send and recv must not overlap. Device
 * memory goes through NCCL grouped sends and receives (or staged). */
int pg_all_to_all_v(pg_context *ctx, pg_mode m, const void *send, const int64_t *send_counts, void *recv,
                    const int64_t *recv_counts, pg_dtype dtype);

/* A transfer in flight, opaque; NULL when there is none. */
typedef struct pg_request pg_request;

/* Non-blocking raw transfers for the pipeline engine (float32; peers local
 * ranks). *req must be NULL (the slot's last send waited for); pg_wait
 * completes it and sets it back to NULL (nothing to do on NULL). */
int pg_isend_buf(pg_context *ctx, pg_mode m, const float *buf, int64_t count, int dst, int tag, pg_request **req);
int pg_wait(pg_request **req);
int pg_recv_buf(pg_context *ctx, pg_mode m, float *buf, int64_t count, int src, int tag);
/* Its non-blocking form: context parallelism's ring receives the next block while it computes (device memory
 * through a host buffer, copied over by pg_wait). */
int pg_irecv_buf(pg_context *ctx, pg_mode m, float *buf, int64_t count, int src, int tag, pg_request **req);
/* One step of a ring: `count` floats of `send` to dst while `recv` takes as many from src (context parallelism's
 * key/value blocks and their gradients). Both requests are waited for with pg_wait; counted as a send and a
 * receive. Device memory over the context group with its NCCL communicator: one grouped ncclSend/ncclRecv on the
 * group's own stream after what the engine's stream has queued (*send_req stays NULL, *recv_req carries its
 * event: the wait makes the engine's stream wait, the host does not); otherwise pg_isend_buf and pg_irecv_buf. */
int pg_iexchange_buf(pg_context *ctx, pg_mode m, const float *send, float *recv, int64_t count, int dst, int src,
                     int tag, pg_request **send_req, pg_request **recv_req);

/* Nonblocking reductions of float32 buffers: the engine's gradient
 * buckets, reduced while backward goes on (pg_engine.c). They make no
 * agreement step each: the members agree once for a set of them with
 * pg_agree_batch (kind, op, total count, `what` naming the set, compared
 * like a call site), then start them in the same order. all_reduce reduces
 * buf[0, n) in place; reduce_scatter takes buf as the members' pieces one
 * after another, counts[i] elements for member i, and leaves this member's
 * piece reduced in its place (the others' hold partial results). avg is the
 * sum times 1 / size (the ring's bits for two members). At most 2^30
 * elements each. pg_test completes the request when it is done (*done = 1,
 * *req = NULL) and lets MPI progress otherwise; pg_wait waits for it with the
 * collective deadline. Host memory goes over MPI; device memory of the data
 * group with NCCL (pg_comm_device_overlap) on the group's reduction stream,
 * reduce_scatter as one reduce per member's piece, and pg_wait makes the
 * device engine's stream wait for it (pg_test never completes it). */
int pg_agree_batch(pg_context *ctx, pg_mode m, pg_coll kind, pg_reduce_op op, int64_t count, const char *what);
int pg_iall_reduce_buf(pg_context *ctx, pg_mode m, float *buf, int64_t n, pg_reduce_op op, pg_request **req);
int pg_ireduce_scatter_buf(pg_context *ctx, pg_mode m, float *buf, const int64_t *counts, pg_reduce_op op,
                           pg_request **req);
int pg_test(pg_request **req, int *done);
/* ZeRO-3's nonblocking parameter gather (host memory over MPI, or device
 * memory as the reductions above: a broadcast per member's piece; agreed for a
 * set with pg_agree_batch like the reductions above): buf holds the members'
 * pieces one after another, counts[i] elements for member i, this member's
 * in its place; completion (pg_wait, pg_test) leaves all of them in every
 * member's buf. At most 2^30 elements of dtype (float32, or bf16: ZeRO-3's
 * gathers under precision bf16). */
int pg_iall_gather_v_buf(pg_context *ctx, pg_mode m, void *buf, const int64_t *counts, pg_dtype dtype,
                         pg_request **req);

/* Device memory. A device engine attaches its stream to the context
 * (collective over the world, once per context). With one GPU per rank, the
 * tensor, data and embedding groups and each pipeline link get NCCL
 * communicators: collectives on device memory and receives from a pipeline
 * neighbour are NCCL calls on that stream, sends to a neighbour on a send
 * stream that waits for it (their pg_wait makes the engine's stream wait, the
 * host does not). When ranks share a GPU (NCCL refuses that), and for what NCCL
 * cannot do (uneven blocks, other peers), transfers are staged through pinned
 * host memory over MPI. Said once, on rank 0. */
int pg_comm_attach_device(pg_context *ctx, void *stream);
/* 1 when the group's bucket reductions and gathers of device memory run on
 * their own stream (pg_iall_reduce_buf, pg_ireduce_scatter_buf,
 * pg_iall_gather_v_buf: the data group's, with NCCL): the engine overlaps
 * them with backward, and ZeRO-2 and 3 on the device need it. */
int pg_comm_device_overlap(const pg_context *ctx, pg_mode m);
/* Frees the NCCL communicators (pg_comm_release calls it). */
void pg_comm_detach_device(pg_context *ctx);

/* Counters of communication, per mode and kind: calls that reached MPI (a
 * group of one makes no call and is not counted), bytes and wall seconds;
 * of the sends and receives, those NCCL carried from device memory to device
 * memory on a stream (`direct`: the pipeline's neighbour transfers, the
 * context ring's exchanges), no host staging. */
typedef struct pg_comm_stats {
  long calls[PG_NUM_MODES][PG_NUM_COLLS];
  long direct[PG_NUM_MODES][PG_NUM_COLLS]; /* PG_COLL_SEND and PG_COLL_RECV only */
  double bytes[PG_NUM_MODES][PG_NUM_COLLS];
  double seconds[PG_NUM_MODES][PG_NUM_COLLS];
} pg_comm_stats;

/* Communication on a context needs its state: pg_comm_init after
 * pg_context_init (a calloc, no MPI call), pg_comm_release before
 * pg_context_destroy (frees the NCCL communicators and the scratch; may be
 * called twice). Whoever makes a context composes the two: the context
 * itself knows nothing of pg_comm. */
int pg_comm_init(pg_context *ctx);
void pg_comm_release(pg_context *ctx);
/* The counters of every call so far (see pg_comm_stats), and their reset. */
const pg_comm_stats *pg_comm_stats_of(const pg_context *ctx);
/* 1 once a call on the context timed out or disagreed: every later call fails
 * (records or data may still be in flight), and requests must not be waited for. */
int pg_comm_broken(const pg_context *ctx);
void pg_comm_stats_reset(pg_context *ctx);

#endif
