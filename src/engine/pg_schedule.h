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
 * for every generator here (checked by pg_schedule_validate).
 *
 * Chunks (the interleaved schedule, Narayanan et al. 2021): the model is cut
 * into P*V consecutive pieces and rank r holds pieces r, r+P, ..., r+(V-1)P as
 * its chunks 0..V-1. Piece g = v*P + r is the model's stage g: its activations
 * go to piece g+1 (rank r+1, or rank 0's next chunk after rank P-1), its
 * input gradients to piece g-1. With V = 1 a rank's chunk is its stage. */
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
  int chunk; /* which of the rank's V chunks (0 when V = 1) */
} pg_action;

/* GPIPE and 1F1B run one chunk per rank. INTERLEAVED is Megatron-LM's
 * interleaved 1F1B over V chunks (V > 1 needs M a multiple of P). FORWARD is
 * evaluation: forwards only, in the interleaved order (groups of up to P
 * micro-batches through each chunk in turn), any V and M. */
typedef enum { PG_SCHEDULE_GPIPE = 0, PG_SCHEDULE_1F1B, PG_SCHEDULE_INTERLEAVED, PG_SCHEDULE_FORWARD } pg_schedule_kind;

/* The most micro-batches x chunks a schedule has: message tags count them
 * (pg_action_message), and stay below 2^21 + 2 as with one chunk. */
#define PG_MAX_SCHEDULE_ITEMS (1 << 20)

int pg_schedule_from_name(const char *name, pg_schedule_kind *out);
const char *pg_schedule_name(pg_schedule_kind k);
const char *pg_action_name(pg_action_kind k);

/* The schedules a frontend offers for training with one chunk per rank
 * (parallelize's schedule=, the planner's search and pins), the default
 * first: *n of them. With V > 1 chunks, PG_SCHEDULE_1F1B runs as
 * PG_SCHEDULE_INTERLEAVED (pg_schedule_chunked). The frontend reads these
 * (core.schedules()) instead of spelling the names. */
const pg_schedule_kind *pg_schedule_offered(int *n);
/* What one-chunk schedule `k` runs as with more chunks per rank: itself if it
 * takes any V, INTERLEAVED for 1F1B; -1 if it has none (GPipe). */
int pg_schedule_chunked(pg_schedule_kind k);

/* Placement of the model's pieces: piece g (0-based, of P*V) is chunk g / P
 * of pipeline rank g % P (round-robin), and back. The engine, the checker
 * and parallelize (core.schedule_place) all ask here. */
static inline int pg_schedule_piece(int P, int rank, int chunk) { return chunk * P + rank; }
static inline void pg_schedule_place(int P, int piece, int *rank, int *chunk) {
  *rank = piece % P;
  *chunk = piece / P;
}

/* The actions of pipeline rank `stage` (0..P-1) holding V chunks, for M
 * micro-batches: *out is malloc'ed, *n its length. */
int pg_schedule_build(pg_schedule_kind kind, int P, int V, int M, int stage, pg_action **out, int *n);

/* Most micro-batches chunk `chunk` holds between forward and backward. */
int pg_schedule_max_in_flight(const pg_action *a, int n, int chunk);

/* The same count without the caller building the list: the most micro-batches
 * chunk `chunk` (0-based) of rank `stage` holds under the schedule, in *out
 * (GPipe: M; 1F1B: min(P - stage, M), from the warm-up its generator uses;
 * the others counted on their list). The planner's memory model asks it
 * (core.schedule_in_flight); specs check it against the lists. */
int pg_schedule_in_flight(pg_schedule_kind kind, int P, int V, int M, int stage, int chunk, int *out);

/* The transfer a send or receive of rank `rank` makes: the other rank and the
 * tag, which names the receiving chunk, the micro-batch and the direction
 * (with V = 1: 2*mb for activations, 2*mb + 1 for gradients). The engine and
 * the checker both use it, so what is checked is what runs. */
void pg_action_message(pg_action a, int P, int M, int rank, int *peer, int *tag);

/* Checks a whole schedule (all P ranks, V chunks each): every micro-batch
 * forwarded (and, unless forward_only, backwarded) once per chunk in a valid
 * order, every send matched by a receive, and that executing it with
 * non-blocking sends and blocking receives cannot deadlock (simulated), each
 * send received exactly once and, between two ranks, in the order sent (a
 * device link matches transfers in order, not by tag). PG_ERR with a message
 * otherwise (micro-batches and chunks numbered from 1, as in Lua). */
int pg_schedule_validate(pg_action **stages, const int *lens, int P, int V, int M, int forward_only);

#endif
