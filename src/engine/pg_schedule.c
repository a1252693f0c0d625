#include "pg_schedule.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg_error.h"

static const char *action_names[] = {"recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad"};

const char *pg_action_name(pg_action_kind k) { return (unsigned)k < 6 ? action_names[k] : "?"; }

static const char *schedule_names[] = {"gpipe", "1f1b", "interleaved", "forward"};

int pg_schedule_from_name(const char *name, pg_schedule_kind *out) {
  for (int k = 0; k < 4; k++)
    if (!strcmp(name, schedule_names[k])) {
      *out = (pg_schedule_kind)k;
      return PG_OK;
    }
  return pg_fail("unknown schedule '%s' (expected gpipe, 1f1b, interleaved or forward)", name);
}

const char *pg_schedule_name(pg_schedule_kind k) { return (unsigned)k < 4 ? schedule_names[k] : "?"; }

/* the default first: parallelize's and the planner's */
static const pg_schedule_kind offered[] = {PG_SCHEDULE_1F1B, PG_SCHEDULE_GPIPE};

const pg_schedule_kind *pg_schedule_offered(int *n) {
  *n = (int)(sizeof offered / sizeof offered[0]);
  return offered;
}

int pg_schedule_chunked(pg_schedule_kind k) {
  switch (k) {
  case PG_SCHEDULE_1F1B:
  case PG_SCHEDULE_INTERLEAVED: return PG_SCHEDULE_INTERLEAVED;
  case PG_SCHEDULE_FORWARD: return PG_SCHEDULE_FORWARD;
  default: return -1;
  }
}

/* 1F1B's warm-up on stage s: the forwards the later stages need before the
 * first backward can reach it (its generator and its in-flight count). */
static int warmup_1f1b(int P, int M, int s) { return P - s - 1 < M ? P - s - 1 : M; }

typedef struct builder {
  pg_action *a;
  int n, cap;
} builder;

static int push(builder *b, pg_action_kind k, int mb, int chunk) {
  if (b->n == b->cap) {
    b->cap = b->cap ? 2 * b->cap : 32;
    pg_action *na = realloc(b->a, (size_t)b->cap * sizeof *na);
    if (!na) return pg_fail("out of memory");
    b->a = na;
  }
  b->a[b->n++] = (pg_action){k, mb, chunk};
  return PG_OK;
}

/* Where a rank's chunk sits in the model: piece pg_schedule_piece(P, r, v) of G = P*V. */
typedef struct place {
  int P, V, rank;
} place;

static int is_first_piece(place p, int v) { return pg_schedule_piece(p.P, p.rank, v) == 0; }
static int is_last_piece(place p, int v) { return pg_schedule_piece(p.P, p.rank, v) == p.P * p.V - 1; }

static int forward_step(builder *b, place p, int v, int i) {
  return (!is_first_piece(p, v) && push(b, PG_ACT_RECV_ACT, i, v)) || push(b, PG_ACT_FORWARD, i, v) ||
                 (!is_last_piece(p, v) && push(b, PG_ACT_SEND_ACT, i, v))
             ? PG_ERR
             : PG_OK;
}

static int backward_step(builder *b, place p, int v, int i) {
  return (!is_last_piece(p, v) && push(b, PG_ACT_RECV_GRAD, i, v)) || push(b, PG_ACT_BACKWARD, i, v) ||
                 (!is_first_piece(p, v) && push(b, PG_ACT_SEND_GRAD, i, v))
             ? PG_ERR
             : PG_OK;
}

/* The k-th (chunk, micro-batch) a rank runs in the interleaved order: groups
 * of P micro-batches (the last group may be smaller) go through chunk 0, then
 * chunk 1, ...; backwards run the chunks in reverse. Every rank uses the same
 * order, so rank r+1 needs what rank r produced in the order it produced it. */
static void interleaved_item(int k, int P, int V, int M, int backward, int *v, int *mb) {
  int group0 = k / (P * V) * P, size = M - group0 < P ? M - group0 : P, in = k - group0 * V;
  *v = in / size;
  if (backward) *v = V - 1 - *v;
  *mb = group0 + in % size;
}

static int interleaved_step(builder *b, place p, int M, int k, int backward) {
  int v, mb;
  interleaved_item(k, p.P, p.V, M, backward, &v, &mb);
  return backward ? backward_step(b, p, v, mb) : forward_step(b, p, v, mb);
}

int pg_schedule_build(pg_schedule_kind kind, int P, int V, int M, int s, pg_action **out, int *n) {
  if (P < 1 || V < 1 || M < 1 || s < 0 || s >= P)
    return pg_fail("schedule: bad sizes (P=%d, V=%d, M=%d, stage %d)", P, V, M, s);
  /* tags count micro-batches x chunks (pg_action_message); at most 6 actions
   * each, counted in an int (push doubles its capacity) */
  if ((int64_t)M * V > PG_MAX_SCHEDULE_ITEMS)
    return pg_fail("schedule: %d micro-batches x %d chunks are more than a schedule holds (%d)", M, V,
                   PG_MAX_SCHEDULE_ITEMS);
  if (V > 1 && (kind == PG_SCHEDULE_GPIPE || kind == PG_SCHEDULE_1F1B))
    return pg_fail("schedule: %s runs one chunk per stage, not %d (more chunks need the interleaved schedule)",
                   pg_schedule_name(kind), V);
  /* Megatron-LM's rule: the groups of P micro-batches that the order above
   * cycles through the chunks must all be whole */
  if (kind == PG_SCHEDULE_INTERLEAVED && V > 1 && M % P)
    return pg_fail("schedule: interleaved with %d chunks per stage needs micro-batches (%d) to be a multiple of the "
                   "pipeline size (%d)",
                   V, M, P);
  builder b = {0};
  place p = {P, V, s};
  int rc = PG_OK;
  if (kind == PG_SCHEDULE_GPIPE) {
    for (int i = 0; i < M && !rc; i++) rc = forward_step(&b, p, 0, i);
    for (int i = 0; i < M && !rc; i++) rc = backward_step(&b, p, 0, i);
  } else if (kind == PG_SCHEDULE_1F1B) {
    /* 1F1B: warm up with the forwards the later stages need before the first
     * backward can reach us, then alternate one forward and one backward,
     * then drain the remaining backwards. */
    int warm = warmup_1f1b(P, M, s);
    for (int i = 0; i < warm && !rc; i++) rc = forward_step(&b, p, 0, i);
    for (int j = 0; j < M - warm && !rc; j++) rc = forward_step(&b, p, 0, warm + j) || backward_step(&b, p, 0, j);
    for (int j = M - warm; j < M && !rc; j++) rc = backward_step(&b, p, 0, j);
  } else if (kind == PG_SCHEDULE_INTERLEAVED) {
    /* Megatron-LM's warm-up: every rank forwards the first V-1 chunks of the
     * first group, and earlier ranks two more forwards per later rank (one to
     * fill the pipeline, one to cover the gradient's way back), so that the
     * alternating phase rarely waits. Then one forward and one backward, and
     * the remaining backwards. */
    int total = M * V, warm = (P - s - 1) * 2 + (V - 1) * P;
    if (warm > total) warm = total;
    for (int k = 0; k < warm && !rc; k++) rc = interleaved_step(&b, p, M, k, 0);
    for (int j = 0; j < total - warm && !rc; j++)
      rc = interleaved_step(&b, p, M, warm + j, 0) || interleaved_step(&b, p, M, j, 1);
    for (int j = total - warm; j < total && !rc; j++) rc = interleaved_step(&b, p, M, j, 1);
  } else {
    for (int k = 0; k < M * V && !rc; k++) rc = interleaved_step(&b, p, M, k, 0);
  }
  if (rc) {
    free(b.a);
    return PG_ERR;
  }
  *out = b.a;
  *n = b.n;
  return PG_OK;
}

int pg_schedule_max_in_flight(const pg_action *a, int n, int chunk) {
  int live = 0, peak = 0;
  for (int i = 0; i < n; i++) {
    if (a[i].chunk != chunk) continue;
    if (a[i].kind == PG_ACT_FORWARD && ++live > peak) peak = live;
    if (a[i].kind == PG_ACT_BACKWARD) live--;
  }
  return peak;
}

int pg_schedule_in_flight(pg_schedule_kind kind, int P, int V, int M, int stage, int chunk, int *out) {
  if (P < 1 || V < 1 || M < 1 || stage < 0 || stage >= P || chunk < 0 || chunk >= V)
    return pg_fail("schedule: bad sizes (P=%d, V=%d, M=%d, stage %d, chunk %d)", P, V, M, stage, chunk + 1);
  if (V > 1 && (kind == PG_SCHEDULE_GPIPE || kind == PG_SCHEDULE_1F1B))
    return pg_fail("schedule: %s runs one chunk per stage, not %d (more chunks need the interleaved schedule)",
                   pg_schedule_name(kind), V);
  /* the two the planner searches, in closed form (no list of M actions per
   * layout and stage); a spec checks them against pg_schedule_max_in_flight */
  if (kind == PG_SCHEDULE_GPIPE) {
    *out = M;
    return PG_OK;
  }
  if (kind == PG_SCHEDULE_1F1B) {
    int warm = warmup_1f1b(P, M, stage);
    *out = warm < M ? warm + 1 : M;
    return PG_OK;
  }
  pg_action *a;
  int n;
  if (pg_schedule_build(kind, P, V, M, stage, &a, &n)) return PG_ERR;
  *out = pg_schedule_max_in_flight(a, n, chunk);
  free(a);
  return PG_OK;
}

void pg_action_message(pg_action a, int P, int M, int rank, int *peer, int *tag) {
  /* the ring's neighbours hold pieces g + 1 (next) and g - 1 (prev); the tag names the receiving chunk */
  int g = pg_schedule_piece(P, rank, a.chunk), next = (rank + 1) % P, prev = (rank + P - 1) % P, r, v;
  switch (a.kind) {
  case PG_ACT_RECV_ACT: *peer = prev, *tag = 2 * (a.chunk * M + a.mb); return;
  case PG_ACT_SEND_ACT: pg_schedule_place(P, g + 1, &r, &v), *peer = next, *tag = 2 * (v * M + a.mb); return;
  case PG_ACT_RECV_GRAD: *peer = next, *tag = 2 * (a.chunk * M + a.mb) + 1; return;
  case PG_ACT_SEND_GRAD: pg_schedule_place(P, g - 1, &r, &v), *peer = prev, *tag = 2 * (v * M + a.mb) + 1; return;
  default: *peer = -1, *tag = -1; return;
  }
}

/* How the checker names a rank's chunk: "stage 1" with one chunk per rank,
 * "stage 1 chunk 2" with more (chunks from 1, as in Lua). */
static const char *where(char *buf, size_t size, int V, int s, int v) {
  if (V == 1) snprintf(buf, size, "stage %d", s);
  else snprintf(buf, size, "stage %d chunk %d", s, v + 1);
  return buf;
}

int pg_schedule_validate(pg_action **stages, const int *lens, int P, int V, int M, int forward_only) {
  if (P < 1 || V < 1 || M < 1 || (int64_t)M * V > PG_MAX_SCHEDULE_ITEMS)
    return pg_fail("schedule_validate: bad sizes (P=%d, V=%d, M=%d)", P, V, M);
  int rc = PG_OK, G = P * V;
  size_t GM = (size_t)G * M;
  int *pos = calloc((size_t)P, sizeof *pos);
  /* per piece g and micro-batch (index g*M + mb): what happened. A send is
   * recorded at its sender (activation: g -> g+1; gradient: g -> g-1) with its
   * place in the sequence of transfers from its rank to the receiving rank. */
  char *act_sent = calloc(GM, 1), *grad_sent = calloc(GM, 1), *fwd = calloc(GM, 1), *bwd = calloc(GM, 1);
  char *have_act = calloc(GM, 1), *have_grad = calloc(GM, 1);
  int *act_seq = calloc(GM, sizeof(int)), *grad_seq = calloc(GM, sizeof(int));
  int *sent_n = calloc((size_t)P * P, sizeof(int)), *recv_n = calloc((size_t)P * P, sizeof(int));
  char w[64];
  if (!pos || !act_sent || !grad_sent || !fwd || !bwd || !have_act || !have_grad || !act_seq || !grad_seq ||
      !sent_n || !recv_n) {
    rc = pg_fail("out of memory");
    goto done;
  }
  /* Simulate: each round, every rank runs actions until it reaches a receive
   * whose send has not been posted. No progress in a round = deadlock. */
  for (;;) {
    int progress = 0, finished = 1;
    for (int s = 0; s < P; s++) {
      while (pos[s] < lens[s]) {
        pg_action a = stages[s][pos[s]];
        if (a.chunk < 0 || a.chunk >= V) {
          rc = pg_fail("stage %d: chunk %d out of range 1..%d", s, a.chunk + 1, V);
          goto done;
        }
        if (a.mb < 0 || a.mb >= M) {
          rc = pg_fail("%s: micro-batch %d out of range 1..%d", where(w, sizeof w, V, s, a.chunk), a.mb + 1, M);
          goto done;
        }
        int g = pg_schedule_piece(P, s, a.chunk);
        size_t k = (size_t)g * M + a.mb;
        if (forward_only && a.kind != PG_ACT_RECV_ACT && a.kind != PG_ACT_FORWARD && a.kind != PG_ACT_SEND_ACT) {
          rc = pg_fail("%s: a forward-only schedule has %s %d", where(w, sizeof w, V, s, a.chunk), pg_action_name(a.kind),
                       a.mb + 1);
          goto done;
        }
        if (a.kind == PG_ACT_RECV_ACT) {
          if (g == 0) { rc = pg_fail("%s receives an activation", where(w, sizeof w, V, s, a.chunk)); goto done; }
          /* Each send feeds one receive: a second receive of the same
           * micro-batch would block forever under MPI (it used to pass). */
          if (have_act[k]) { rc = pg_fail("%s receives activation %d twice", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          if (!act_sent[k - M]) break;
          int from = (g - 1) % P;
          if (act_seq[k - M] != recv_n[from * P + s]) {
            rc = pg_fail("%s receives activation %d out of the order stage %d sent it (device links match in order)",
                         where(w, sizeof w, V, s, a.chunk), a.mb + 1, from);
            goto done;
          }
          recv_n[from * P + s]++;
          have_act[k] = 1;
        } else if (a.kind == PG_ACT_RECV_GRAD) {
          if (g == G - 1) { rc = pg_fail("the last stage receives a gradient"); goto done; }
          if (have_grad[k]) { rc = pg_fail("%s receives gradient %d twice", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          if (!grad_sent[k + M]) break;
          int from = (g + 1) % P;
          if (grad_seq[k + M] != recv_n[from * P + s]) {
            rc = pg_fail("%s receives gradient %d out of the order stage %d sent it (device links match in order)",
                         where(w, sizeof w, V, s, a.chunk), a.mb + 1, from);
            goto done;
          }
          recv_n[from * P + s]++;
          have_grad[k] = 1;
        } else if (a.kind == PG_ACT_FORWARD) {
          if (fwd[k]) { rc = pg_fail("%s forwards micro-batch %d twice", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          if (g > 0 && !have_act[k]) { rc = pg_fail("%s forwards micro-batch %d before receiving it", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          fwd[k] = 1;
        } else if (a.kind == PG_ACT_BACKWARD) {
          if (!fwd[k] || bwd[k]) { rc = pg_fail("%s: backward of micro-batch %d out of order", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          if (g < G - 1 && !have_grad[k]) { rc = pg_fail("%s backwards micro-batch %d before its gradient", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          bwd[k] = 1;
        } else if (a.kind == PG_ACT_SEND_ACT) {
          if (g == G - 1 || !fwd[k]) { rc = pg_fail("%s sends activation %d wrongly", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          /* a second send would never be received */
          if (act_sent[k]) { rc = pg_fail("%s sends activation %d twice", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          act_sent[k] = 1;
          act_seq[k] = sent_n[s * P + (s + 1) % P]++;
        } else {
          if (g == 0 || !bwd[k]) { rc = pg_fail("%s sends gradient %d wrongly", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          if (grad_sent[k]) { rc = pg_fail("%s sends gradient %d twice", where(w, sizeof w, V, s, a.chunk), a.mb + 1); goto done; }
          grad_sent[k] = 1;
          grad_seq[k] = sent_n[s * P + (s + P - 1) % P]++;
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
        if (pos[s] < lens[s]) {
          pg_action a = stages[s][pos[s]];
          w[0] = 0;
          if (V > 1) snprintf(w, sizeof w, ", chunk %d", a.chunk + 1);
          len += snprintf(msg + len, sizeof msg - (size_t)len, " stage %d waits at action %d of %d (%s %d%s);", s,
                          pos[s] + 1, lens[s], pg_action_name(a.kind), a.mb + 1, w);
        }
      rc = pg_fail("%s", msg);
      goto done;
    }
  }
  for (int g = 0; g < G && !rc; g++)
    for (int i = 0; i < M && !rc; i++) {
      size_t k = (size_t)g * M + i;
      int s, v;
      pg_schedule_place(P, g, &s, &v);
      if (!fwd[k] || (!forward_only && !bwd[k]))
        rc = pg_fail("%s never runs micro-batch %d %s", where(w, sizeof w, V, s, v), i + 1,
                     forward_only ? "forward" : "both ways");
      else if (g < G - 1 && !act_sent[k]) rc = pg_fail("%s never sends activation %d", where(w, sizeof w, V, s, v), i + 1);
      else if (!forward_only && g > 0 && !grad_sent[k])
        rc = pg_fail("%s never sends gradient %d", where(w, sizeof w, V, s, v), i + 1);
      else if (g > 0 && !have_act[k]) rc = pg_fail("%s never receives activation %d", where(w, sizeof w, V, s, v), i + 1);
    }
done:
  free(pos);
  free(act_sent);
  free(grad_sent);
  free(fwd);
  free(bwd);
  free(have_act);
  free(have_grad);
  free(act_seq);
  free(grad_seq);
  free(sent_n);
  free(recv_n);
  return rc;
}
