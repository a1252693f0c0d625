/* pg_shm: buffers that every member of a group on one node maps.
 *
 * The data-parallel replicas of a rank's stage keep their flat parameter and
 * gradient buffers in POSIX shared memory when they all run on one node, so
 * that the gradient reduction and the ZeRO-1 parameter gather read and write
 * the other members' buffers directly: one pass over memory instead of MPI's
 * copies (comm_shm.c has those collectives). Each member creates its own
 * segment and maps the others'; the names are unlinked as soon as everyone
 * has mapped them, so nothing is left behind in /dev/shm.
 *
 * Set PG_SHM=0 in the environment to keep every buffer private (the
 * collectives then go through MPI). */
#ifndef PG_SHM_H
#define PG_SHM_H

#include <stddef.h>

#include "pg_context.h"
#include "pg_tensor.h"

typedef struct pg_shm {
  int size, rank;  /* group size and this member's position; size 0: not shared */
  pg_mode mode;
  size_t bytes;
  float **base;    /* [size]: each member's buffer as mapped here (base[rank] is ours) */
} pg_shm;

/* Collective over group m. On success *own is a zeroed storage of `bytes`
 * (unmapped when its last reference goes) and out->base maps every member's.
 * When the group is not on one node, or shared memory cannot be had (not
 * enough room in /dev/shm, PG_SHM=0), every member gets *own = NULL,
 * out->size = 0 and PG_OK: the caller allocates privately. PG_ERR only when
 * MPI itself fails. */
int pg_shm_create(pg_context *ctx, pg_mode m, size_t bytes, pg_shm *out, pg_storage **own);
/* Unmaps the other members' buffers (local; ours goes with its storage). */
void pg_shm_close(pg_shm *s);

#endif
