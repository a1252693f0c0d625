#include "pg_schedule.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg_error.h"

static const char *action_names[] = {"recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad"};

const char *pg_action_name(pg_action_kind k) { return (unsigned)k < 6 ? action_names[k] : "?"; }

int pg_schedule_from_name(const char *name, pg_schedule_kind *out) {
  if (!strcmp(name, "gpipe")) *out = PG_SCHEDULE_GPIPE;
  else if (!strcmp(name, "1f1b")) *out = PG_SCHEDULE_1F1B;
  else return pg_fail("unknown schedule '%s' (expected gpipe or 1f1b)", name);
  return PG_OK;
}

const char *pg_schedule_name(pg_schedule_kind k) { return k == PG_SCHEDULE_1F1B ? "1f1b" : "gpipe"; }

typedef struct builder {
  pg_action *a;
  int n, cap;
} builder;

static int push(builder *b, pg_action_kind k, int mb) {
  if (b->n == b->cap) {
    b->cap = b->cap ? 2 * b->cap : 32;
    pg_action *na = realloc(b->a, (size_t)b->cap * sizeof *na);
    if (!na) return pg_fail("out of memory");
    b->a = na;
  }
  b->a[b->n++] = (pg_action){k, mb};
  return PG_OK;
}

static int forward_step(builder *b, int P, int s, int i) {
  return (s > 0 && push(b, PG_ACT_RECV_ACT, i)) || push(b, PG_ACT_FORWARD, i) ||
                 (s < P - 1 && push(b, PG_ACT_SEND_ACT, i))
             ? PG_ERR
             : PG_OK;
}

static int backward_step(builder *b, int P, int s, int i) {
  return (s < P - 1 && push(b, PG_ACT_RECV_GRAD, i)) || push(b, PG_ACT_BACKWARD, i) ||
                 (s > 0 && push(b, PG_ACT_SEND_GRAD, i))
             ? PG_ERR
             : PG_OK;
}

int pg_schedule_build(pg_schedule_kind kind, int P, int M, int s, pg_action **out, int *n) {
  if (P < 1 || M < 1 || s < 0 || s >= P) return pg_fail("schedule: bad sizes (P=%d, M=%d, stage %d)", P, M, s);
  /* at most 6 actions per micro-batch, counted in an int (push doubles its capacity) */
  if ((int64_t)M > INT_MAX / 8) return pg_fail("schedule: %d micro-batches are more than a schedule holds", M);
  builder b = {0};
  int rc = PG_OK;
  if (kind == PG_SCHEDULE_GPIPE) {
    for (int i = 0; i < M && !rc; i++) rc = forward_step(&b, P, s, i);
    for (int i = 0; i < M && !rc; i++) rc = backward_step(&b, P, s, i);
  } else {
    /* 1F1B: warm up with the forwards the later stages need before the first
     * backward can reach us, then alternate one forward and one backward,
     * then drain the remaining backwards. */
    int warm = P - s - 1 < M ? P - s - 1 : M;
    for (int i = 0; i < warm && !rc; i++) rc = forward_step(&b, P, s, i);
    for (int j = 0; j < M - warm && !rc; j++) rc = forward_step(&b, P, s, warm + j) || backward_step(&b, P, s, j);
    for (int j = M - warm; j < M && !rc; j++) rc = backward_step(&b, P, s, j);
  }
  if (rc) {
    free(b.a);
    return PG_ERR;
  }
  *out = b.a;
  *n = b.n;
  return PG_OK;
}

int pg_schedule_max_in_flight(const pg_action *a, int n) {
  int live = 0, peak = 0;
  for (int i = 0; i < n; i++) {
    if (a[i].kind == PG_ACT_FORWARD && ++live > peak) peak = live;
    if (a[i].kind == PG_ACT_BACKWARD) live--;
  }
  return peak;
}

int pg_schedule_validate(pg_action **stages, const int *lens, int P, int M) {
  int rc = PG_OK;
  int *pos = calloc((size_t)P, sizeof *pos);
  /* sent[s][kind][mb]: a send has been posted (activation: s -> s+1; gradient: s -> s-1) */
  char *act_sent = calloc((size_t)P * M, 1), *grad_sent = calloc((size_t)P * M, 1);
  char *fwd = calloc((size_t)P * M, 1), *bwd = calloc((size_t)P * M, 1);
  char *have_act = calloc((size_t)P * M, 1), *have_grad = calloc((size_t)P * M, 1);
  if (!pos || !act_sent || !grad_sent || !fwd || !bwd || !have_act || !have_grad) {
    rc = pg_fail("out of memory");
    goto done;
  }
  /* Simulate: each round, every stage runs actions until it reaches a receive
   * whose send has not been posted. No progress in a round = deadlock. */
  for (;;) {
    int progress = 0, finished = 1;
    for (int s = 0; s < P; s++) {
      while (pos[s] < lens[s]) {
        pg_action a = stages[s][pos[s]];
        if (a.mb < 0 || a.mb >= M) {
          rc = pg_fail("stage %d: micro-batch %d out of range 1..%d", s, a.mb + 1, M);
          goto done;
        }
        size_t k = (size_t)s * M + a.mb;
        if (a.kind == PG_ACT_RECV_ACT) {
          if (s == 0) { rc = pg_fail("stage 0 receives an activation"); goto done; }
          /* Each send feeds one receive: a second receive of the same
           * micro-batch would block forever under MPI (it used to pass). */
          if (have_act[k]) { rc = pg_fail("stage %d receives activation %d twice", s, a.mb + 1); goto done; }
          if (!act_sent[(size_t)(s - 1) * M + a.mb]) break;
          have_act[k] = 1;
        } else if (a.kind == PG_ACT_RECV_GRAD) {
          if (s == P - 1) { rc = pg_fail("the last stage receives a gradient"); goto done; }
          if (have_grad[k]) { rc = pg_fail("stage %d receives gradient %d twice", s, a.mb + 1); goto done; }
          if (!grad_sent[(size_t)(s + 1) * M + a.mb]) break;
          have_grad[k] = 1;
        } else if (a.kind == PG_ACT_FORWARD) {
          if (fwd[k]) { rc = pg_fail("stage %d forwards micro-batch %d twice", s, a.mb + 1); goto done; }
          if (s > 0 && !have_act[k]) { rc = pg_fail("stage %d forwards micro-batch %d before receiving it", s, a.mb + 1); goto done; }
          fwd[k] = 1;
        } else if (a.kind == PG_ACT_BACKWARD) {
          if (!fwd[k] || bwd[k]) { rc = pg_fail("stage %d: backward of micro-batch %d out of order", s, a.mb + 1); goto done; }
          if (s < P - 1 && !have_grad[k]) { rc = pg_fail("stage %d backwards micro-batch %d before its gradient", s, a.mb + 1); goto done; }
          bwd[k] = 1;
        } else if (a.kind == PG_ACT_SEND_ACT) {
          if (s == P - 1 || !fwd[k]) { rc = pg_fail("stage %d sends activation %d wrongly", s, a.mb + 1); goto done; }
          /* a second send would never be received */
          if (act_sent[k]) { rc = pg_fail("stage %d sends activation %d twice", s, a.mb + 1); goto done; }
          act_sent[k] = 1;
        } else {
          if (s == 0 || !bwd[k]) { rc = pg_fail("stage %d sends gradient %d wrongly", s, a.mb + 1); goto done; }
          if (grad_sent[k]) { rc = pg_fail("stage %d sends gradient %d twice", s, a.mb + 1); goto done; }
          grad_sent[k] = 1;
        }
        pos[s]++;
        progress = 1;
      }
      if (pos[s] < lens[s]) finished = 0;
    }
    if (finished) break;
    if (!progress) {
      /* Name where every unfinished stage waits (1-based positions, as the
       * lists read in Lua), not just stage 0's 0-based index. */
      char msg[512];
      int len = snprintf(msg, sizeof msg, "schedule deadlocks:");
      for (int s = 0; s < P && len < (int)sizeof msg; s++)
        if (pos[s] < lens[s])
          len += snprintf(msg + len, sizeof msg - (size_t)len, " stage %d waits at action %d of %d (%s %d);", s,
                          pos[s] + 1, lens[s], pg_action_name(stages[s][pos[s]].kind), stages[s][pos[s]].mb + 1);
      rc = pg_fail("%s", msg);
      goto done;
    }
  }
  for (int s = 0; s < P && !rc; s++)
    for (int i = 0; i < M && !rc; i++) {
      size_t k = (size_t)s * M + i;
      if (!fwd[k] || !bwd[k]) rc = pg_fail("stage %d never runs micro-batch %d both ways", s, i + 1);
      if (s < P - 1 && !act_sent[k]) rc = pg_fail("stage %d never sends activation %d", s, i + 1);
      if (s > 0 && !grad_sent[k]) rc = pg_fail("stage %d never sends gradient %d", s, i + 1);
      if (s > 0 && !have_act[k]) rc = pg_fail("stage %d never receives activation %d", s, i + 1);
    }
done:
  free(pos);
  free(act_sent);
  free(grad_sent);
  free(fwd);
  free(bwd);
  free(have_act);
  free(have_grad);
  return rc;
}
