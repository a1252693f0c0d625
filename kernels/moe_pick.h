/* moe_pick.h — the router's choice rule, the one copy kernels/cpu/moe.c and
 * kernels/cuda/moe.cu both call, so the device makes the CPU's choices:
 * the k-th expert of a row is the largest logit not yet taken (softmax is
 * monotone, and a comparison of the same floats is exact on every backend,
 * whereas expf may round differently); a strict > keeps the lower index on
 * ties, the order torch.topk returns them in. */
#ifndef PG_MOE_PICK_H
#define PG_MOE_PICK_H

#include <stdint.h>

#ifdef __CUDACC__
#define PG_MOE_HOST_DEVICE __host__ __device__
#else
#define PG_MOE_HOST_DEVICE
#endif

/* The k-th choice among E logits l, given the k choices ex[0..k-1] before it. */
static inline PG_MOE_HOST_DEVICE int pg_moe_pick(const float *l, int E, const int32_t *ex, int k) {
  int best = -1;
  for (int e = 0; e < E; e++) {
    int taken = 0;
    for (int j = 0; j < k; j++) taken |= ex[j] == e;
    if (!taken && (best < 0 || l[e] > l[best])) best = e;
  }
  return best;
}

#endif
