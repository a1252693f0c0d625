#define _GNU_SOURCE
#include "pg_context.h"

#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "pg_error.h"
#include "pg_env.h"
#include "pg_rng.h"

static const char *mode_names[PG_NUM_MODES] = {"global",    "tensor", "pipeline",
                                               "data",      "embedding", "expert", "expert_data",
                                               "context",   "data_context", "islands"};
static const char *coll_names[PG_NUM_COLLS] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                               "send",       "recv",       "barrier",        "all_to_all"};

const char *pg_mode_name(pg_mode m) { return (unsigned)m < PG_NUM_MODES ? mode_names[m] : "?"; }
const char *pg_coll_name(pg_coll c) { return (unsigned)c < PG_NUM_COLLS ? coll_names[c] : "?"; }

int pg_mode_from_name(const char *name, pg_mode *out) {
  for (int i = 0; i < PG_NUM_MODES; i++)
    if (!strcmp(name, mode_names[i])) {
      *out = (pg_mode)i;
      return PG_OK;
    }
  return pg_fail("unknown group '%s' (expected global, tensor, pipeline, data, embedding, expert, expert_data, "
                 "context, data_context or islands)", name);
}

static int make_group(pg_group *g, MPI_Comm world, int color, int key) {
  if (MPI_Comm_split(world, color, key, &g->comm) != MPI_SUCCESS) return pg_fail("MPI_Comm_split failed");
  MPI_Comm_set_errhandler(g->comm, MPI_ERRORS_RETURN);
  if (MPI_Comm_dup(g->comm, &g->agree) != MPI_SUCCESS) return pg_fail("MPI_Comm_dup failed");
  MPI_Comm_set_errhandler(g->agree, MPI_ERRORS_RETURN);
  MPI_Comm_size(g->comm, &g->size);
  MPI_Comm_rank(g->comm, &g->rank);
  g->ranks = calloc((size_t)g->size, sizeof(int));
  if (!g->ranks) return pg_fail("out of memory");
  int me;
  MPI_Comm_rank(world, &me);
  MPI_Allgather(&me, 1, MPI_INT, g->ranks, 1, MPI_INT, g->comm);
  return PG_OK;
}

/* The groups of one island (world: the island's communicator); ctx cleared by the caller, which destroys it
 * when this fails. */
static int init_island(pg_context *ctx, MPI_Comm world, int tensor, int pipeline, int data, int expert, int context,
                       uint64_t seed) {
  MPI_Comm_size(world, &ctx->world_size);
  MPI_Comm_rank(world, &ctx->rank);
  if (tensor < 1 || pipeline < 1 || data < 1 || context < 1)
    return pg_fail("parallel sizes must be positive integers: tensor=%d pipeline=%d data=%d context=%d", tensor,
                   pipeline, data, context);
  if (context == 1 && (long)tensor * pipeline * data != ctx->world_size)
    return pg_fail("tensor=%d x pipeline=%d x data=%d = %ld ranks, but the world has %d", tensor, pipeline, data,
                   (long)tensor * pipeline * data, ctx->world_size);
  if (context > 1 && (long)tensor * context * pipeline * data != ctx->world_size)
    return pg_fail("tensor=%d x context=%d x pipeline=%d x data=%d = %ld ranks, but the world has %d", tensor, context,
                   pipeline, data, (long)tensor * context * pipeline * data, ctx->world_size);
  if (expert < 1 || data % expert)
    return pg_fail("expert=%d must be a positive integer dividing data=%d (expert groups are cut out of the data "
                   "group)", expert, data);
  ctx->tensor = tensor;
  ctx->expert = expert;
  ctx->pipeline = pipeline;
  ctx->data = data;
  ctx->context = context;
  ctx->seed = seed;
  int r = ctx->rank, C = context;
  ctx->tp_rank = r % tensor;
  ctx->cp_rank = (r / tensor) % C;
  ctx->dp_rank = (r / (tensor * C)) % data;
  ctx->pp_rank = r / (tensor * C * data);
  ctx->ep_rank = ctx->dp_rank % expert;
  int tp = ctx->tp_rank, dp = ctx->dp_rank, pp = ctx->pp_rank, cp = ctx->cp_rank;
  /* colours: the coordinates the members share, numbered uniquely; keys: the order inside */
  int ok = make_group(&ctx->group[PG_MODE_GLOBAL], world, 0, r) == PG_OK &&
           make_group(&ctx->group[PG_MODE_TENSOR], world, (pp * data + dp) * C + cp, tp) == PG_OK &&
           make_group(&ctx->group[PG_MODE_DATA], world, (pp * C + cp) * tensor + tp, dp) == PG_OK &&
           make_group(&ctx->group[PG_MODE_PIPELINE], world, (dp * C + cp) * tensor + tp, pp) == PG_OK &&
           make_group(&ctx->group[PG_MODE_CONTEXT], world, (pp * data + dp) * tensor + tp, cp) == PG_OK &&
           make_group(&ctx->group[PG_MODE_DATA_CONTEXT], world, pp * tensor + tp, dp * C + cp) == PG_OK;
  /* Embedding group: first and last stage of each pipeline group; every
   * middle stage sits alone (colour unique to it). */
  int edge = (pp == 0 || pp == pipeline - 1);
  int ecolor = edge ? (dp * C + cp) * tensor + tp : tensor * C * data + r;
  ok = ok && make_group(&ctx->group[PG_MODE_EMBEDDING], world, ecolor, pp) == PG_OK;
  /* expert group: data ranks dp / E alike; expert_data: dp % E alike (both inside one data group) */
  int groups = data / expert;
  ok = ok &&
       make_group(&ctx->group[PG_MODE_EXPERT], world, ((pp * C + cp) * tensor + tp) * groups + dp / expert, dp) == PG_OK &&
       make_group(&ctx->group[PG_MODE_EXPERT_DATA], world, ((pp * C + cp) * tensor + tp) * expert + dp % expert, dp) ==
           PG_OK;
  ctx->destroyed = 0; /* from here pg_context_destroy frees what was made */
  return ok ? PG_OK : PG_ERR;
}

int pg_context_init(pg_context *ctx, MPI_Comm world, int tensor, int pipeline, int data, int expert, int context,
                    uint64_t seed) {
  return pg_context_init_islands(ctx, world, 1, tensor, pipeline, data, expert, context, seed);
}

int pg_context_init_islands(pg_context *ctx, MPI_Comm world, int islands, int tensor, int pipeline, int data,
                            int expert, int context, uint64_t seed) {
  memset(ctx, 0, sizeof *ctx);
  for (int m = 0; m < PG_NUM_MODES; m++) ctx->group[m].comm = ctx->group[m].agree = MPI_COMM_NULL;
  ctx->destroyed = 1;
  int world_size = 1, me = 0;
  MPI_Comm_size(world, &world_size);
  MPI_Comm_rank(world, &me);
  if (islands < 1 || world_size % islands)
    return pg_fail("islands=%d must be a positive integer dividing the world size %d", islands, world_size);
  int per = world_size / islands;
  if (islands > 1 && tensor > 0 && pipeline > 0 && data > 0 && context > 0 &&
      (long)tensor * context * pipeline * data != per)
    return pg_fail("tensor=%d x context=%d x pipeline=%d x data=%d = %ld ranks, but each of the %d islands has %d "
                   "(world %d)", tensor, context, pipeline, data, (long)tensor * context * pipeline * data, islands,
                   per, world_size);
  MPI_Comm island;
  if (MPI_Comm_split(world, me / per, me, &island) != MPI_SUCCESS) return pg_fail("MPI_Comm_split failed");
  int rc = init_island(ctx, island, tensor, pipeline, data, expert, context, seed);
  MPI_Comm_free(&island); /* the groups are communicators of their own */
  ctx->islands = islands;
  ctx->island = me / per;
  if (rc == PG_OK) rc = make_group(&ctx->group[PG_MODE_ISLANDS], world, me % per, me / per);
  if (rc != PG_OK) pg_context_destroy(ctx); /* nothing when init_island failed before making a group */
  return rc;
}

void pg_context_destroy(pg_context *ctx) {
  if (ctx->destroyed) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  for (int m = 0; m < PG_NUM_MODES; m++) {
    pg_group *g = &ctx->group[m];
    if (g->comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&g->comm);
    if (g->agree != MPI_COMM_NULL && !finalized) MPI_Comm_free(&g->agree);
    g->comm = g->agree = MPI_COMM_NULL;
    free(g->ranks);
    g->ranks = NULL;
  }
  ctx->destroyed = 1;
}

int pg_context_ring_rank(const pg_context *ctx, pg_mode m, int step) {
  const pg_group *g = &ctx->group[m];
  int i = ((g->rank + step) % g->size + g->size) % g->size;
  return g->ranks[i];
}

uint64_t pg_context_stream_seed(const pg_context *ctx, pg_stream s) {
  switch (s) {
  case PG_STREAM_WEIGHTS: return pg_rng_key(ctx->seed, "stream:weights");
  case PG_STREAM_DATA: return pg_rng_key(ctx->seed, "stream:data");
  case PG_STREAM_REPLICATED:
    return pg_rng_subkey(pg_rng_subkey(pg_rng_key(ctx->seed, "stream:replicated"), (uint64_t)ctx->pp_rank),
                         (uint64_t)ctx->dp_rank);
  case PG_STREAM_SHARDED:
    return pg_rng_subkey(pg_rng_subkey(pg_rng_subkey(pg_rng_key(ctx->seed, "stream:sharded"), (uint64_t)ctx->pp_rank),
                                       (uint64_t)ctx->dp_rank),
                         (uint64_t)ctx->tp_rank);
  }
  return pg_rng_key(ctx->seed, "stream:?");
}

/* ---- process set-up ---- */

int pg_mpi_init(int *argc, char ***argv) {
  int inited = 0, provided = 0;
  MPI_Initialized(&inited);
  if (inited) return PG_OK;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) return pg_fail("MPI_Init_thread failed");
  if (provided < MPI_THREAD_FUNNELED) return pg_fail("MPI provides thread level %d, below MPI_THREAD_FUNNELED", provided);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return PG_OK;
}

void pg_mpi_finalize(void) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Finalize();
}

int pg_mpi_world_rank(void) {
  int inited = 0, finalized = 0, r = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int pg_mpi_world_size(void) {
  int inited = 0, finalized = 0, n = 1;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/* openblas_set_num_threads is OpenBLAS's own call; declared here so the
 * runtime does not need cblas.h. */
void openblas_set_num_threads(int);

static int pg_threads = 1;

int pg_num_threads(void) { return pg_threads; }

/* This process's place on its node, found once by pg_setup_threads (a
 * collective over the world at start-up): later callers (t:to("cuda") on
 * one rank) must not run a collective. */
static int node_rank, node_size = 1;

int pg_node_rank(void) { return node_rank; }
int pg_node_size(void) { return node_size; }

int pg_node_split(MPI_Comm comm, MPI_Comm *node) {
  long k = 0;
  if (pg_env_long("PG_RANKS_PER_NODE", &k)) return PG_ERR;
  if (k > 0) {
    int world_rank = 0, rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_rank(comm, &rank);
    if (MPI_Comm_split(comm, (int)(world_rank / k), rank, node) != MPI_SUCCESS) return pg_fail("MPI_Comm_split failed");
    return PG_OK;
  }
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, node) != MPI_SUCCESS)
    return pg_fail("MPI_Comm_split_type failed");
  return PG_OK;
}

/* Every world rank's host name (PG_HOST_MAX bytes each), exchanged once at
 * start-up by find_node_place: a watchdog that names an absent rank names
 * its host too, and the rank may be gone by then. Kept for the process's
 * life (a report can come at any time). */
static char *host_names;
static int host_count, distinct_hosts = 1;

const char *pg_host_of_world_rank(int r) {
  return host_names && r >= 0 && r < host_count ? host_names + (size_t)r * PG_HOST_MAX : "";
}

int pg_host_count(void) { return distinct_hosts; }

/* World rank 0 writes "RANK HOST" a line to PG_HOST_MAP_FILE (scripts/mpirun.sh names it): Open MPI's notice of
 * a lost host names the host, and the script then names its ranks from this map. Written to a temporary name
 * and renamed, so a reader sees the whole map or none. A failure is a warning: the map only adds to a report. */
static void write_host_map(const char *all, int n) {
  const char *path = NULL;
  if (pg_env_path("PG_HOST_MAP_FILE", &path) || !path) return; /* a bad value: pg_env_check_all refused it */
  char tmp[PATH_MAX];
  if (snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid()) >= (int)sizeof tmp) {
    fprintf(stderr, "pipegoose: PG_HOST_MAP_FILE: the name '%.200s' is too long; no rank -> host map\n", path);
    return;
  }
  FILE *f = fopen(tmp, "w");
  int ok = f != NULL;
  for (int r = 0; ok && r < n; r++) ok = fprintf(f, "%d %s\n", r, all + (size_t)r * PG_HOST_MAX) > 0;
  if (f && fclose(f) != 0) ok = 0;
  if (!ok || rename(tmp, path) != 0) {
    fprintf(stderr, "pipegoose: PG_HOST_MAP_FILE: cannot write '%.200s'; no rank -> host map\n", path);
    remove(tmp);
  }
}

static int exchange_host_names(void) {
  if (host_names) return PG_OK;
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  char mine[PG_HOST_MAX] = "";
  if (gethostname(mine, sizeof mine - 1) != 0) snprintf(mine, sizeof mine, "?");
  mine[sizeof mine - 1] = 0;
  char *all = calloc((size_t)n, PG_HOST_MAX);
  int ok = all != NULL;
  /* every rank takes part in the collective even when its own calloc failed (MPI_MIN of ok) */
  if (MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD) != MPI_SUCCESS || !ok) {
    free(all);
    return pg_fail("out of memory for the host names of %d ranks", n);
  }
  if (MPI_Allgather(mine, PG_HOST_MAX, MPI_CHAR, all, PG_HOST_MAX, MPI_CHAR, MPI_COMM_WORLD) != MPI_SUCCESS) {
    free(all);
    return pg_fail("MPI_Allgather of the host names failed");
  }
  int distinct = 0;
  for (int r = 0; r < n; r++) {
    int seen = 0;
    for (int q = 0; q < r && !seen; q++) seen = !strcmp(all + (size_t)q * PG_HOST_MAX, all + (size_t)r * PG_HOST_MAX);
    distinct += !seen;
  }
  host_names = all;
  host_count = n;
  distinct_hosts = distinct;
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (me == 0) write_host_map(all, n);
  return PG_OK;
}

static int find_node_place(void) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (!inited || finalized) return PG_OK;
  MPI_Comm node;
  if (pg_node_split(MPI_COMM_WORLD, &node)) return PG_ERR;
  {
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
  }
  return exchange_host_names();
}

int pg_setup_threads(void) {
  if (find_node_place()) return -1;
  long threads = 0;
  if (pg_env_long("OMP_NUM_THREADS", &threads)) return -1;
  int n = (int)threads;
  if (n < 1) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online < 1) online = 1;
    n = (int)(online / node_size);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
      int allowed = CPU_COUNT(&set);
      if (allowed > 0 && allowed < n) n = allowed;
    }
    if (n < 1) n = 1;
  }
  pg_threads = n;
#ifdef _OPENMP
  omp_set_num_threads(n);
#endif
  openblas_set_num_threads(n);
  return n;
}
