#define _GNU_SOURCE
#include "pg_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pg_error.h"
#include "pg_env.h"

#define NAME_LEN 64

static void *map_fd(int fd, size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? NULL : p;
}

/* Our segment: a fresh name, the whole size reserved up front (a full
 * /dev/shm would otherwise kill us with SIGBUS on first touch). */
static void *create_segment(char *name, size_t bytes) {
  static unsigned counter;
  int world = pg_mpi_world_rank();
  snprintf(name, NAME_LEN, "/pipegoose.%ld.%d.%u", (long)getpid(), world, counter++);
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return NULL;
  void *p = NULL;
  if (ftruncate(fd, (off_t)bytes) == 0 && posix_fallocate(fd, 0, (off_t)bytes) == 0) p = map_fd(fd, bytes);
  close(fd);
  if (!p) shm_unlink(name);
  return p;
}

static void *open_segment(const char *name, size_t bytes) {
  int fd = shm_open(name, O_RDWR, 0600);
  if (fd < 0) return NULL;
  void *p = map_fd(fd, bytes);
  close(fd);
  return p;
}

/* Every member's answer, and-ed. */
static int all_ok(MPI_Comm comm, int ok, int *rc) {
  *rc = MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
  return ok;
}

int pg_shm_create(pg_context *ctx, pg_mode m, size_t bytes, pg_shm *out, pg_storage **own) {
  memset(out, 0, sizeof *out);
  *own = NULL;
  pg_group *g = &ctx->group[m];
  if (g->size < 2 || bytes == 0) return PG_OK;
  int rc, ok = 1;
  if (pg_env_bool("PG_SHM", &ok)) return PG_ERR; /* refused at start-up already: ranks agree */
  /* one node: the group's node sub-communicator is the whole group */
  MPI_Comm node;
  if (pg_node_split(g->comm, &node)) return PG_ERR;
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);
  ok = ok && node_size == g->size;
  if (!all_ok(g->comm, ok, &rc)) return rc == MPI_SUCCESS ? PG_OK : pg_fail("MPI_Allreduce failed");

  size_t mapped = (bytes + 4095) & ~(size_t)4095;
  char *names = calloc((size_t)g->size, NAME_LEN);
  float **base = calloc((size_t)g->size, sizeof *base);
  pg_storage *st = calloc(1, sizeof *st);
  ok = names && base && st;
  void *mine = ok ? create_segment(names + (size_t)g->rank * NAME_LEN, mapped) : NULL;
  ok = ok && mine;
  if (base) base[g->rank] = mine;
  if (all_ok(g->comm, ok, &rc) &&
      MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, names, NAME_LEN, MPI_CHAR, g->comm) == MPI_SUCCESS) {
    for (int i = 0; i < g->size && ok; i++)
      if (i != g->rank && !(base[i] = open_segment(names + (size_t)i * NAME_LEN, mapped))) ok = 0;
    ok = all_ok(g->comm, ok, &rc);
  } else {
    ok = 0;
  }
  /* everyone has mapped (or given up): the names can go */
  if (mine) shm_unlink(names + (size_t)g->rank * NAME_LEN);
  free(names);
  if (!ok) {
    for (int i = 0; base && i < g->size; i++)
      if (base[i]) munmap(base[i], mapped);
    free(base);
    free(st);
    return rc == MPI_SUCCESS ? PG_OK : pg_fail("MPI failed while sharing buffers");
  }
  st->data = mine; /* fresh tmpfs pages: already zero */
  st->bytes = bytes;
  st->refcount = 1;
  st->owns_data = 1;
  st->device = PG_CPU;
  st->mapped_bytes = mapped;
  *own = st;
  out->size = g->size;
  out->rank = g->rank;
  out->mode = m;
  out->bytes = mapped;
  out->base = base;
  return PG_OK;
}

void pg_shm_close(pg_shm *s) {
  if (!s->base) return;
  for (int i = 0; i < s->size; i++)
    if (i != s->rank && s->base[i]) munmap(s->base[i], s->bytes);
  free(s->base);
  s->base = NULL;
  s->size = 0;
}
