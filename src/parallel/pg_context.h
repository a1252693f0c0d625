/* pg_context: the parallel context (process groups for tensor, context,
 * pipeline and data parallelism) and the process-level set-up (MPI, compute
 * threads).
 *
 * Layout, tensor-fastest as in Megatron-LM (tp-cp-dp-pp):
 *   global = pp_rank * (tp * cp * dp) + dp_rank * (tp * cp) + cp_rank * tp + tp_rank
 * With context = 1 this is pp_rank * (tp * dp) + dp_rank * tp + tp_rank.
 * Each group is an MPI communicator made with MPI_Comm_split; a group's local
 * ranks follow the global order. The "embedding" group joins the first and
 * last pipeline stage that share (tp_rank, dp_rank); it holds the two copies
 * of a tied embedding (size 1 when pipeline = 1).
 *
 * Expert parallelism (expert = E, dividing data): each data group is cut into
 * D / E "expert" groups of E consecutive members (data ranks g E .. g E + E - 1,
 * as Megatron's and DeepSpeed's expert-parallel groups); member j of an expert
 * group holds experts [j n / E, (j + 1) n / E) of every MoE layer, and tokens
 * travel to their experts' members and back by all-to-all. The "expert_data"
 * group joins the D / E ranks holding the same experts (same ep_rank): expert
 * parameters' gradients are averaged there, dense parameters' over the data
 * group. With E = 1 the expert groups are single ranks and expert_data is the
 * data group.
 *
 * Context parallelism (context = C): the "context" group joins the C ranks
 * that share (tp, dp, pp); each holds two of the 2C chunks of every sequence
 * (pg_cp_position). Parameters are replicated over it as over the data group,
 * so the dense gradients are averaged over "data_context", the D x C ranks
 * sharing (tp, pp), ordered dp_rank * C + cp_rank (Megatron's dp-cp group).
 * With C = 1 both are single-rank and the data group's own.
 *
 * Islands (DiLoCo, pg_context_init_islands): the world cut into k contiguous
 * blocks of world / k ranks, island-major (world rank = island * (world / k)
 * + rank in the island), so that an island is a host when ranks are placed
 * by host. Every group above, global included, is the island's own: an
 * engine built on the context is exactly the engine the island would have
 * alone (rank, world_size and the layout are the island's). The "islands"
 * group joins the k ranks with the same rank in their islands, in island
 * order (its local rank is the island); size 1 without islands. A group's
 * `ranks` are numbered in the island (its world), the islands group's in
 * the whole world.
 *
 * pg_context_init and pg_context_destroy are collective over `world`. */
#ifndef PG_CONTEXT_H
#define PG_CONTEXT_H

#include <mpi.h>
#include <stdint.h>

typedef enum {
  PG_MODE_GLOBAL = 0,
  PG_MODE_TENSOR,
  PG_MODE_PIPELINE,
  PG_MODE_DATA,
  PG_MODE_EMBEDDING,
  PG_MODE_EXPERT,      /* E consecutive members of a data group: the all-to-all of MoE tokens */
  PG_MODE_EXPERT_DATA, /* the data ranks holding the same experts: their gradients' reduction */
  PG_MODE_CONTEXT,     /* the C ranks splitting one sequence (context parallelism) */
  PG_MODE_DATA_CONTEXT, /* data x context: where the dense gradients are reduced and ZeRO shards live */
  PG_MODE_ISLANDS,     /* the islands' ranks at the same place in their island: DiLoCo's outer step */
  PG_NUM_MODES
} pg_mode;

typedef enum {
  PG_COLL_ALL_REDUCE = 0,
  PG_COLL_ALL_GATHER,
  PG_COLL_REDUCE_SCATTER,
  PG_COLL_BROADCAST,
  PG_COLL_SEND,
  PG_COLL_RECV,
  PG_COLL_BARRIER,
  PG_COLL_ALL_TO_ALL,
  PG_NUM_COLLS
} pg_coll;

#define PG_SITE_MAX 96 /* bytes of a call site ("spec.lua:10"), the terminating 0 included */

struct pg_comm_state;

typedef struct pg_group {
  MPI_Comm comm; /* MPI_COMM_NULL once destroyed */
  int size, rank;
  int *ranks; /* global ranks of the members, ascending */
  /* The agreement step before each call (comm_agree.c): a copy of comm that
   * carries only the members' call records, so they never match data. */
  MPI_Comm agree;
} pg_group;

/* Which random stream; see pg_context_stream_seed. */
typedef enum { PG_STREAM_WEIGHTS = 0, PG_STREAM_REPLICATED, PG_STREAM_SHARDED, PG_STREAM_DATA } pg_stream;

typedef struct pg_context {
  int world_size, rank;
  int tensor, pipeline, data; /* sizes */
  int expert;                 /* expert-parallel size: divides data (1: every rank holds every expert) */
  int context;                /* context-parallel size (1: every rank holds whole sequences) */
  int tp_rank, pp_rank, dp_rank, cp_rank;
  int ep_rank;                /* place in the expert group: dp_rank % expert */
  int islands, island;        /* DiLoCo's islands and this rank's (1 and 0 without them) */
  uint64_t seed;
  pg_group group[PG_NUM_MODES];
  /* pg_comm's own state (its counters, scratch, NCCL communicators, the call site, a broken
   * context's message): made by pg_comm_init, released by pg_comm_release; opaque here. */
  struct pg_comm_state *comm;
  int destroyed;
} pg_context;

const char *pg_mode_name(pg_mode m);
int pg_mode_from_name(const char *name, pg_mode *out);
const char *pg_coll_name(pg_coll c);

/* Collective over `world`. Fails (on every rank alike) when a size is not
 * positive, tp*cp*pp*dp differs from the size of `world` or expert does not
 * divide data. */
int pg_context_init(pg_context *ctx, MPI_Comm world, int tensor, int pipeline, int data, int expert, int context,
                    uint64_t seed);

/* Context parallelism's load-balanced causal split (Megatron-LM): a sequence
 * of T = 2 C L tokens is cut into 2C chunks of L; context rank r holds chunks
 * r and 2C-1-r, in that order, as its 2L local rows. The position in the
 * whole sequence of local row t (0 <= t < 2L). */
static inline int64_t pg_cp_position(int C, int r, int64_t L, int64_t t) {
  return t < L ? (int64_t)r * L + t : (int64_t)(2 * C - 1 - r) * L + (t - L);
}
/* The same inside each of `islands` islands (see above): tensor * context * pipeline * data must be
 * world / islands; islands must divide the world. */
int pg_context_init_islands(pg_context *ctx, MPI_Comm world, int islands, int tensor, int pipeline, int data,
                            int expert, int context, uint64_t seed);
void pg_context_destroy(pg_context *ctx);

/* Global rank of the member at position `local` (ring order, wraps). */
int pg_context_ring_rank(const pg_context *ctx, pg_mode m, int step);

/* Seeds of the per-rank random streams (the rule, also in the README):
 *   weights    = f(seed)                       same on every rank: init is a
 *                                              function of (seed, name, index)
 *   replicated = f(seed, pp_rank, dp_rank)      shared inside a tensor group
 *                                              (dropout on replicated activations)
 *   sharded    = f(seed, pp_rank, dp_rank, tp)  different on every rank
 *                                              (dropout inside tensor-parallel regions)
 *   data       = f(seed)                       same on every rank: all agree on
 *                                              the global batch order */
uint64_t pg_context_stream_seed(const pg_context *ctx, pg_stream s);

/* Process set-up. pg_mpi_init initialises MPI with MPI_THREAD_FUNNELED once
 * (no-op if done); pg_mpi_finalize finalises if initialised and not yet
 * finalised. pg_mpi_world_rank/size work before any context exists. */
int pg_mpi_init(int *argc, char ***argv);
void pg_mpi_finalize(void);
int pg_mpi_world_rank(void);
int pg_mpi_world_size(void);

/* Compute threads per rank: OMP_NUM_THREADS when the user set it, else the
 * node's cores divided by the ranks on this node (at least 1, at most the
 * cores this process may run on). Applies it to OpenMP and OpenBLAS and
 * returns it; -1 and pg_error() when the node cannot be found (a bad
 * PG_RANKS_PER_NODE). Call after pg_mpi_init. */
int pg_setup_threads(void);
int pg_num_threads(void);

/* This process's rank among the ranks on its node, and how many there are
 * (0 and 1 without MPI), as pg_setup_threads found them: the device a rank
 * uses is its node rank modulo the node's devices. */
int pg_node_rank(void);
int pg_node_size(void);

/* The ranks of `comm` on this process's node, as a new communicator (free it
 * with MPI_Comm_free). A node is what MPI_COMM_TYPE_SHARED says, unless
 * PG_RANKS_PER_NODE=k: then every k consecutive world ranks are one node,
 * so that one machine runs the paths between nodes (no shared memory across
 * them). The one place that decides what a node is. */
int pg_node_split(MPI_Comm comm, MPI_Comm *node);

/* World rank r's host name (gethostname, truncated to PG_HOST_MAX - 1
 * bytes), as every rank told the others at start-up (pg_setup_threads), ""
 * for a rank out of range or before then; and how many distinct names the
 * world has (1 before then). The watchdog names the host of a rank that
 * never arrived when the world spans more than one. */
#define PG_HOST_MAX 64
const char *pg_host_of_world_rank(int r);
int pg_host_count(void);

#endif
