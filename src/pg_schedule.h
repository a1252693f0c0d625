/* pg_schedule: pipeline schedules as data.
 *
 * A schedule is, for each pipeline stage, the ordered list of actions it
 * runs in one step: forward or backward of micro-batch i, and the transfers
 * around them. The engine executes the list; specs check the lists without
 * running a model.
 *
 * Transfers: a send is non-blocking (it completes later), a receive blocks.
 * Since sends never wait, a schedule cannot deadlock as long as each stage's
 * receives come in an order its neighbours' sends can satisfy, which holds
 * for both generators here (checked by pg_schedule_validate). */
#ifndef PG_SCHEDULE_H
#define PG_SCHEDULE_H

typedef enum {
  PG_ACT_RECV_ACT = 0, /* receive micro-batch i's activation from the previous stage */
  PG_ACT_FORWARD,
  PG_ACT_SEND_ACT,     /* send it to the next stage */
  PG_ACT_RECV_GRAD,    /* receive the gradient of our output from the next stage */
  PG_ACT_BACKWARD,
  PG_ACT_SEND_GRAD,    /* send the gradient of our input to the previous stage */
} pg_action_kind;

typedef struct pg_action {
  pg_action_kind kind;
  int mb;
} pg_action;

typedef enum { PG_SCHEDULE_GPIPE = 0, PG_SCHEDULE_1F1B } pg_schedule_kind;

int pg_schedule_from_name(const char *name, pg_schedule_kind *out);
const char *pg_schedule_name(pg_schedule_kind k);
const char *pg_action_name(pg_action_kind k);

/* The actions of `stage` (0..P-1) for M micro-batches: *out is malloc'ed, *n
 * its length. */
int pg_schedule_build(pg_schedule_kind kind, int P, int M, int stage, pg_action **out, int *n);

/* Most micro-batches a stage holds between forward and backward. */
int pg_schedule_max_in_flight(const pg_action *a, int n);

/* Checks a whole schedule (all P stages): every micro-batch forwarded and
 * backwarded once per stage in a valid order, every send matched by a
 * receive, and that executing it with non-blocking sends and blocking
 * receives cannot deadlock (simulated), each send received exactly once.
 * PG_ERR with a message otherwise (micro-batches numbered from 1, as in Lua). */
int pg_schedule_validate(pg_action **stages, const int *lens, int P, int M);

#endif
