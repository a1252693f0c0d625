/* pg_module: runtime modules — the pieces a model stage is built from.
 *
 * A module has forward(slot) and backward(slot). `slot` is the micro-batch in
 * flight: a module keeps its output and whatever its backward needs per slot,
 * so several micro-batches can be in flight (pipeline schedules). Backward
 * runs one micro-batch at a time, so the input gradient has one buffer.
 *
 * Pointers passed between modules:
 *   - forward(x) may keep x until backward of the same slot: every producer
 *     (a module's per-slot output, the engine's per-slot stage input) keeps
 *     its buffer intact until that backward has run.
 *   - backward returns its input gradient in its own buffer, valid until its
 *     next backward.
 *
 * Tensor parallelism lives inside the modules: a module built with a
 * context whose tensor group has T > 1 holds its shard and calls the
 * collectives it needs (pg_comm.h) on the tensor group. Every member of the
 * group runs the same module sequence, so the collectives match.
 *
 * Memory and arithmetic go through the module's backend (pg_backend.h): its
 * buffers are that backend's memory, its kernels that backend's kernels.
 *
 * Parameters: a module creates its pg_params (shard shape and where the
 * shard sits in the full tensor); the engine places them in one flat buffer
 * and sets data/grad. Composite modules (sequential, residual) own children. */
#ifndef PG_MODULE_H
#define PG_MODULE_H

#include <stdint.h>

#include "kernels.h" /* pg_rope_scaling */
#include "pg_backend.h"
#include "pg_context.h"

#define PG_PARAM_MAX_DIMS 4
#define PG_PARAM_MAX_BLOCKS 8

typedef enum { PG_INIT_ZEROS = 0, PG_INIT_ONES, PG_INIT_NORMAL } pg_init_kind;
/* "zeros", "ones", "normal" (exactly): PG_OK, else PG_ERR naming the known ones. */
int pg_init_from_name(const char *name, pg_init_kind *out);

typedef struct pg_param {
  char *name;                            /* full path, e.g. "blocks.3.attn.qkv.weight" */
  int ndim;
  int64_t shape[PG_PARAM_MAX_DIMS];      /* this rank's shard */
  int64_t full_shape[PG_PARAM_MAX_DIMS]; /* the serial tensor */
  int64_t numel;
  /* Shard: the full tensor's dimension split_dim is seen as split_blocks
   * blocks of split_sizes[b] rows each (3 for a fused q|k|v, unequal when
   * there are fewer key/value heads than query heads), each cut into
   * split_parts pieces; this rank holds piece split_index of every block,
   * the pieces one after the other. split_parts == 1: whole tensor. */
  int split_dim, split_blocks, split_parts, split_index;
  int64_t split_sizes[PG_PARAM_MAX_BLOCKS];
  int64_t valid_rows; /* rows (dim 0) of the full tensor that are real; later rows are padding, kept 0 */
  pg_init_kind init;
  float init_std;
  int weight_decay;  /* AdamW decay applies (tensors of 2+ dimensions) */
  int replicated;    /* the same on every tensor rank: counted once in the gradient norm */
  int tied_copy;     /* second copy of a tied weight on another pipeline stage: not counted in the
                        norm; its gradient is summed with the original's over the embedding group */
  int expert;        /* an expert's weight under expert parallelism (expert > 1): held by one member of
                        each expert group, its gradient averaged over the expert_data group */
  int sequence_parallel; /* replicated, but used by a module that sees only this tensor rank's rows
                            (sequence parallelism): its gradient is a partial sum, summed over the
                            tensor group by the engine (pg_engine_sync_grads) */
  int64_t offset;    /* in the engine's flat buffers (elements) */
  float *data, *grad;
  /* ZeRO-3 under precision bf16 (pg_module_bf16_gathered): read only as a bf16 GEMM operand, so the engine
   * gathers it in bf16 and data16 points at the gathered bits while its unit is gathered (data NULL then) */
  int gather_bf16;
  const uint16_t *data16;
} pg_param;

typedef struct pg_module pg_module;
/* A kind's descriptor: its ops and its traits (src/nn/module_impl.h; callers ask pg_kind_traits below). */
typedef struct pg_module_kind pg_module_kind;

#define PG_WIDE_SCRATCH 3 /* float32 scratch buffers of precision bf16 (pg_io.wide_scratch) */

/* Decoding with the key/value cache (pg_engine_decode): the micro-batch's row
 * b is sequence row0 + b of the cache, its T tokens at positions pos[b] ..
 * pos[b] + T - 1 (pos on the host). The attentions keep every sequence's keys
 * and values of the positions before (pg_module_release_cache frees them);
 * the position-dependent modules (learned positions, RoPE, ALiBi) take the
 * positions from here. Forward only. */
typedef struct pg_decode {
  int row0, rows;     /* the sequences of this call; the cache holds `rows` at least (grown on demand) */
  const int32_t *pos; /* [B] host */
  int cache_rows;     /* sequences the cache is sized for */
} pg_decode;

/* Per micro-batch information passed down a stage. */
typedef struct pg_io {
  int B, T;                /* micro-batch shape: rows = B*T */
  const int32_t *tokens;   /* [B*T] inputs (read by the embedding) */
  const int32_t *targets;  /* [B*T] or NULL (read by the head) */
  float dloss;             /* d objective / d each token's loss */
  int want_grad;           /* 0: evaluation (the head skips dlogits) */
  double loss_sum;         /* out: the head adds the sum of token losses */
  float *logits;           /* out when not NULL: the head writes full logits [B*T, vocab] */
  int mb;                  /* which micro-batch (0-based) of the call */
  int64_t row0;            /* its first row in this rank's batch */
  const int32_t *host_targets; /* targets in host memory (an objective written in Lua reads them) */
  /* Mixture of experts: the load-balancing loss is one function of every
   * MoE layer's routing (transformers' load_balancing_loss_func concatenates
   * the layers), so the layers of a micro-batch share its routing totals:
   * [2 * experts] doubles, the choices made of each expert, then the summed
   * router probabilities. Forward adds each layer's; by backward they hold
   * the whole model's (a pipeline hands them down the stages and back).
   * NULL: a module standing alone is the only MoE layer. */
  double *router;
  double aux_sum;          /* out: MoE layers add their auxiliary losses, times the rows */
  int recomputing;         /* a recomputation's forward: activations only, nothing added to the totals */
  /* Called after the backward of every module that owns parameters (leaf or
   * composite), once its parameters' gradients for this micro-batch are
   * written: the engine starts a bucket's gradient reduction as soon as the
   * last module owning one of its parameters is done (pg_engine.c). NULL:
   * nobody listens. A module that reads a parameter it does not own (a tied
   * head) must run its backward before the owner's (it comes later in
   * forward), which the model builders guarantee. Non-zero: the error. */
  int (*backward_done)(void *ud, pg_module *m);
  /* Called before the backward of every module that owns parameters (with
   * the same ud): ZeRO-2 points the parameters' gradients at the staging
   * buffer of their bucket there (pg_engine.c). NULL: nobody listens. */
  int (*backward_begin)(void *ud, pg_module *m);
  /* Called before and after the forward of every module that owns parameters
   * or is a gather unit (the same ud), recomputations included: ZeRO-3
   * gathers the unit's parameters before and frees them after (pg_engine.c).
   * NULL: nobody listens. The engine's hooks are idempotent: a recomputed
   * forward inside a unit's backward finds its parameters there. The
   * backward hooks above are called for gather units too. */
  int (*forward_begin)(void *ud, pg_module *m);
  int (*forward_done)(void *ud, pg_module *m);
  void *backward_ud;
  /* Where the micro-batch sits in the training run, for noise that every
   * layout draws alike (MoE jitter): the engine's forward_backward count, and
   * the micro-batch's first row in the global batch (data ranks hold
   * consecutive rows). */
  int64_t step, global_row0;
  /* Precision bf16: room for the rounded operands of one GEMM (the input or output gradient, and the input),
   * and float32 room for a module's bf16 activations widened or its results before rounding,
   * pg_module_bf16_scratch's sizes; shared by every module, which use it within one call. */
  uint16_t *bf16_scratch[2];
  float *wide_scratch[PG_WIDE_SCRATCH];
  const pg_decode *decode; /* NULL, or decoding with the key/value cache (above) */
  /* Context parallelism (the module's context has context = C > 1): 0, or the chunk length L: each of the B
   * sequences is this context rank's two chunks of 2C (T = 2L rows, pg_cp_position gives their positions), and
   * the attentions exchange keys and values over the context group. */
  int cp_chunk;
} pg_io;

typedef struct pg_module_ops {
  const char *kind;
  /* Size per-slot buffers for nslots micro-batches of at most max_rows rows. */
  int (*alloc)(pg_module *m, int nslots, int max_rows);
  int (*forward)(pg_module *m, int slot, pg_io *io, const float *x, const float **y);
  int (*backward)(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx);
  void (*destroy)(pg_module *m); /* frees kind-specific state (not params, not children) */
} pg_module_ops;

struct pg_module {
  const pg_module_ops *ops;   /* &kind->ops */
  const pg_module_kind *kind; /* its descriptor: what the framework asks instead of which kind it is */
  char *name;
  pg_context *ctx;          /* NULL: serial */
  const pg_backend *be;     /* where its buffers live and its kernels run (cpu unless set) */
  int in_width, out_width;  /* features per row; in 0 = token ids, out 0 = the loss */
  int nslots, max_rows;     /* max_rows: of a micro-batch (B*T), whatever the module holds of them */
  int slot_rows;            /* rows of each slot's output in `out`: max_rows, or with sequence parallelism
                               this rank's most (pg_sp_rows_max) where the output is this rank's rows */
  pg_param **params;        /* owned parameters (a tied head refers to another's: not owned) */
  int nparams;
  pg_module **children;
  int nchildren;
  /* Precision bf16 (pg_module_set_precision): the elements of the input x and its gradient dx are bf16
   * (uint16_t, behind the float pointers of forward and backward) when in_bf16, those of the output y, its
   * gradient dy and `out` when out_bf16; float32 otherwise. A producer and its consumer agree. */
  int in_bf16, out_bf16;
  float *out;               /* [nslots][max_rows * out_width] elements (bf16 when out_bf16) */
  float *dinp;              /* [max_rows * in_width] elements (bf16 when in_bf16) */
  size_t saved_bytes_per_slot; /* activations kept per micro-batch (outputs + saved statistics) */
  struct pg_recompute_arena *arena; /* recompute modules and selectively recomputing attention: shared memory */
  int sp;                   /* sequence parallelism is on for this module (pg_module_sequence_parallel) */
  int gather_unit;          /* ZeRO-3 gathers the parameters of this module's tree as one unit (pg_engine.c): the
                               pg_io forward and backward hooks are called for it too, owning none itself */
  void *state;              /* kind-specific */
};

/* ---- constructors (NULL + pg_error() on bad arguments) ---- */

typedef enum { PG_LINEAR_PLAIN = 0, PG_LINEAR_COLUMN, PG_LINEAR_ROW } pg_linear_mode;

typedef struct pg_linear_opts {
  int in, out;           /* full (serial) widths */
  int bias;
  pg_linear_mode mode;
  int blocks;            /* column: output blocks sharded separately (3 for q|k|v); default 1 */
  int block_sizes[PG_PARAM_MAX_BLOCKS]; /* their widths (all 0: equal blocks) */
  int gather_output;     /* column: all-gather the output to full width */
  int input_is_parallel; /* row: input arrives split (in/T wide); else it is split here */
  float init_std;        /* weight init std (GPT-2: 0.02, residual projections scaled) */
} pg_linear_opts;

pg_module *pg_linear_new(pg_context *ctx, const char *name, const pg_linear_opts *o);
pg_module *pg_layernorm_new(pg_context *ctx, const char *name, int width);
/* RMS normalisation (LLaMA): x / sqrt(mean(x^2) + eps) * weight. */
pg_module *pg_rmsnorm_new(pg_context *ctx, const char *name, int width, float eps);
pg_module *pg_gelu_new(pg_context *ctx, const char *name, int width);
/* silu(gate) * up on a [gate | up] input of 2 * width (this rank's columns). */
pg_module *pg_swiglu_new(pg_context *ctx, const char *name, int width);

typedef struct pg_attention_opts {
  int heads, kv_heads; /* query heads; key/value heads (kv_heads divides heads; 0 = heads) */
  int head_dim;
  int max_seq;
  double rope_theta;   /* > 0: rotary position embeddings on q and k (rotate_half); 0: none */
  pg_rope_scaling rope_scaling; /* with rope_theta: the frequencies' scaling (zeroed: plain) */
  int alibi;           /* 1: ALiBi biases on the scores (BLOOM; pg_alibi_slopes of `heads`, this rank's slice);
                          excludes rope_theta */
  int recompute;       /* 1: keep the probabilities of one micro-batch only and recompute them in
                          backward (selective recomputation, Korthikanti et al. 2022) */
  int kv_gathered;     /* 1: tensor > kv_heads, the input is pg_kv_heads_new's (this rank's query heads and the
                          one key/value head they use); 0: heads and kv_heads both split over the tensor group */
} pg_attention_opts;
/* Causal self-attention core on a split q|k|v input (heads/T query and
 * kv_heads/T key/value heads per rank: both must divide by T; or with
 * kv_gathered heads/T and one). */
pg_module *pg_attention_new(pg_context *ctx, const char *name, const pg_attention_opts *o);
/* Between a column-parallel q|k|v and the attention core when tensor = T > kv_heads (T a multiple of kv_heads,
 * dividing heads): gathers the key/value head this rank's query heads use from the ranks that hold its pieces
 * (kind_kv_heads.c). */
pg_module *pg_kv_heads_new(pg_context *ctx, const char *name, int heads, int kv_heads, int head_dim);
/* Token (+ position, if positions > 0) embedding, vocab-parallel over the tensor group. */
pg_module *pg_embedding_new(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width, int positions,
                            float init_std);
/* LM head + fused cross-entropy. weight: a parameter of shape [padded_vocab/T, width]
 * (the embedding's, when tied on the same stage) or NULL to create one named
 * `weight_name` (tied_copy says whether it is a copy of a tied weight). */
pg_module *pg_lm_head_new(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width,
                          pg_param *weight, const char *weight_name, int tied_copy, float init_std);
/* The same head without the loss: it outputs this rank's vocabulary slice of
 * the logits, [B*T, padded_vocab/T] (a split output), for an objective. */
pg_module *pg_lm_logits_new(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width,
                            pg_param *weight, const char *weight_name, int tied_copy, float init_std);
pg_module *pg_sequential_new(pg_context *ctx, const char *name, pg_module **children, int n);
pg_module *pg_residual_new(pg_context *ctx, const char *name, pg_module *inner);
/* Full activation recomputation around `inner` (a transformer block): inner
 * keeps the activations of one micro-batch only; backward(slot) runs inner's
 * forward again from the saved input, then its backward. Per micro-batch in
 * flight only the block's output is kept. Results are bit for bit those
 * without it (the same kernels on the same inputs). */
pg_module *pg_recompute_new(pg_context *ctx, const char *name, pg_module *inner);

/* Mixtral's sparse feed-forward block: a router Linear(dim -> experts, no
 * bias), softmax, the top_k experts of each token, their probabilities
 * renormalised, and the weighted sum of those experts' SwiGLU outputs
 * (w2(silu(w1 x) * w3 x)). Under tensor parallelism each expert's w1/w3 are
 * column-parallel and w2 row-parallel, the router replicated; the output is
 * reduced over the tensor group once. Parameters: "<name>.gate.weight"
 * [experts, dim] and "<name>.experts.<e>.w1|w2|w3.weight", one set per
 * expert; under expert parallelism (the context's expert = G > 1) a rank
 * holds experts / G of them, and tokens reach them by all-to-all over the
 * expert group (kind_moe.c explains the order that keeps results serial). Auxiliary
 * losses (pg_io's router totals): aux_loss_coef x the load-balancing loss
 * over the model's `layers` MoE layers (this is number `layer`, 0-based),
 * z_loss_coef x the mean over tokens and layers of logsumexp(logits)^2. */
typedef struct pg_moe_opts {
  int dim, hidden, experts, top_k;
  int layer, layers;
  double aux_loss_coef, z_loss_coef;
  double capacity_factor; /* > 0: each expert takes at most ceil(c seq_len top_k / experts) choices per sequence; 0: all */
  double jitter;          /* > 0: training multiplies the router's input by uniform noise in [1 - j, 1 + j] */
  float init_std;
} pg_moe_opts;
pg_module *pg_moe_new(pg_context *ctx, const char *name, const pg_moe_opts *o);

/* A module computed by someone else (the Lua bindings run a Lua table):
 * callbacks get the row count and contiguous buffers in the memory of be,
 * the module's backend (a device engine's: device memory). */
typedef struct pg_custom_fns {
  int (*forward)(void *ud, const pg_backend *be, int slot, const pg_io *io, const float *x, int rows, float *y);
  int (*backward)(void *ud, const pg_backend *be, int slot, const pg_io *io, const float *dy, int rows, float *dx);
  void (*release)(void *ud);
  void *ud;
} pg_custom_fns;

/* The end of a stage whose loss someone else computes (an objective written
 * in Lua): it takes the stage's last output ([rows, width] per micro-batch)
 * and produces the loss. call() gets the rows in host memory and returns the
 * micro-batch's loss in *loss; with dx (training) it also writes d loss / d x
 * there, already scaled by the step (the engine's dloss times rows). */
typedef struct pg_objective_fns {
  int (*call)(void *ud, const pg_io *io, const float *x, int rows, int width, float *dx, double *loss);
  void (*release)(void *ud);
  void *ud;
} pg_objective_fns;
pg_module *pg_objective_new(pg_context *ctx, const char *name, int width, const pg_objective_fns *fns);

/* How a module's input and output relate to the tensor group (the regions
 * of Megatron's tensor parallelism, named once here; every module that
 * shards uses these pieces rather than its own collectives):
 *   input  REPLICATED  the full activation, the same on every rank, and the
 *                      module's input gradient is complete on every rank;
 *          COPY        the full activation, but the module holds a shard of
 *                      the computation: its input gradient is a partial sum,
 *                      all-reduced over the tensor group in backward
 *                      (Megatron's copy-to-region);
 *          SPLIT       this rank's columns of a split activation.
 *   output REPLICATED  the full activation, the same on every rank;
 *          REDUCE      a partial sum, all-reduced over the tensor group in
 *                      forward (reduce-from-region; the gradient passes as is);
 *          SPLIT       this rank's columns. */
typedef enum { PG_TP_REPLICATED = 0, PG_TP_COPY, PG_TP_REDUCE, PG_TP_SPLIT } pg_tp_region;
/* An input region ("replicated", "copy", "split") when is_input, else an output
 * region ("replicated", "reduce", "split"); PG_ERR for any other name. */
int pg_tp_region_from_name(const char *name, int is_input, pg_tp_region *out);

/* in_width, out_width: this rank's widths (split ones already divided). params:
 * made with pg_param_new / pg_param_new_split, owned by the module afterwards. */
pg_module *pg_custom_new(pg_context *ctx, const char *name, int in_width, int out_width, pg_tp_region input,
                         pg_tp_region output, const pg_custom_fns *fns, pg_param **params, int nparams);

/* A parameter of a replicated (unsharded) tensor; for pg_custom_new. */
pg_param *pg_param_new(const char *name, int ndim, const int64_t *shape, pg_init_kind init, float std);
/* A parameter sharded over the tensor group of ctx: dimension split_dim
 * (0-based) of the full shape seen as `blocks` blocks of sizes[b] (NULL:
 * equal), each cut into T pieces; this rank holds piece tp_rank of each. */
pg_param *pg_param_new_split(pg_context *ctx, const char *name, int ndim, const int64_t *full_shape, int split_dim,
                             int blocks, const int64_t *sizes, pg_init_kind init, float std);

void pg_param_free(pg_param *p);

/* Parameters that modules of m's tree write gradients to without owning
 * them (a tied head's weight), at most cap of them into out; returns how
 * many there are. */
int pg_module_borrowed_params(const pg_module *m, pg_param **out, int cap);
/* The first module of m's tree whose parameters' gradients are written by
 * someone else through views of the flat buffer (a module written in Lua),
 * or NULL. */
const pg_module *pg_module_find_foreign_writer(const pg_module *m);

/* The embedding module's token weight (to tie a head to it). */
pg_param *pg_embedding_weight(pg_module *m);

/* ---- the registry of module kinds ----
 * One descriptor per kind holds its ops and its traits, and one table
 * (src/nn/module_registry.c) holds every descriptor: the framework, the
 * bindings and pg.nn ask a kind's traits instead of testing which kind it is.
 * Leaf kinds are built by name from a description's fields (pg.nn's describe
 * output, read through pg_desc: the Lua bindings read a Lua table; a C caller
 * can read anything else); containers from the modules their caller built
 * first (pg_module_assemble); modules written in Lua by the bindings
 * (pg_custom_new). Adding a kind: a kind_*.c file (or a family's) with its
 * constructor, builder and descriptor, one entry in the registry's table,
 * and its class in lua/pipegoose/nn.lua. */

/* How a kind's descriptions become modules. */
typedef enum {
  PG_KIND_BUILT = 0, /* from the description's fields: pg_module_build */
  PG_KIND_LIST,      /* from its children ({children = {...}}), built first: pg_module_assemble (sequential) */
  PG_KIND_WRAPPER,   /* around its inner module ({inner = ...}), built first: pg_module_assemble (residual, recompute) */
  PG_KIND_LUA,       /* by the bindings, from the Lua table of a module written in Lua (pg_custom_new) */
  PG_KIND_INTERNAL,  /* never from a description (the objective: the bindings end a stage with it) */
} pg_kind_assembly;

/* What a module of the kind does under sequence parallelism (pg_module_sequence_parallel). */
typedef enum {
  PG_SP_ALL_ROWS = 0, /* needs every row of the micro-batch: refuses; it goes between sp_gather and sp_scatter */
  PG_SP_ROW_WISE,     /* takes and gives this rank's rows; its replicated parameters then see only those */
  PG_SP_GATHERS,      /* takes this rank's rows and all-gathers them (backward reduce-scatters the gradient) */
  PG_SP_SCATTERS,     /* gives this rank's rows: partial sums reduce-scattered (backward all-gathers) */
  PG_SP_TRANSITION,   /* sp_gather, sp_scatter: the transitions themselves, always on */
} pg_sp_role;

#define PG_KIND_MAX_MODES 3

/* Flags of pg_kind_traits. */
#define PG_KIND_PASSES_BF16 (1u << 0)    /* precision bf16: its output has its input's element type */
#define PG_KIND_BF16_BRANCH (1u << 1)    /* takes its inner module's bf16 output (residual: added widened) */
#define PG_KIND_RECOMPUTES (1u << 2)     /* full recomputation: its inner block keeps one micro-batch, in the arena */
#define PG_KIND_SELECTIVE (1u << 3)      /* recompute = "selective" marks its descriptions {recompute = true} */
#define PG_KIND_WRITTEN_IN_LUA (1u << 4) /* computed by Lua callbacks, its parameters' gradients through views */
#define PG_KIND_ROUTER (1u << 5)         /* adds to the routing totals (pg_io.router): parallelize numbers them */
#define PG_KIND_HEAD (1u << 6)           /* the LM head: the vocabulary, a tied weight, the loss or the logits */

typedef struct pg_kind_traits {
  const char *name;          /* the kind in descriptions ({kind = name}) */
  pg_kind_assembly assembly;
  pg_sp_role sp;             /* its role under sequence parallelism, when nmodes == 0 */
  /* a kind whose role depends on its description's `mode` (linear's plain, column, row): the role of each */
  int nmodes;
  const char *modes[PG_KIND_MAX_MODES];
  pg_sp_role sp_modes[PG_KIND_MAX_MODES];
  const char *host_only;     /* NULL: any backend; else why it runs on the cpu backend only (the error says it) */
  unsigned flags;            /* PG_KIND_* */
} pg_kind_traits;

/* The registry's kinds, i from 0 to pg_module_kind_count() - 1. */
int pg_module_kind_count(void);
const pg_kind_traits *pg_module_kind_at(int i);
/* The kind named `name` in descriptions, or NULL. */
const pg_kind_traits *pg_module_kind_named(const char *name);

typedef struct pg_desc pg_desc;
typedef struct pg_desc_ops {
  int64_t (*integer)(const pg_desc *d, const char *key, int64_t def);
  double (*number)(const pg_desc *d, const char *key, double def);
  const char *(*string)(const pg_desc *d, const char *key, const char *def); /* valid while building */
  int (*boolean)(const pg_desc *d, const char *key, int def);
  /* A list of integers: its length (at most max read into out), or -1 when absent. */
  int (*integers)(const pg_desc *d, const char *key, int64_t *out, int max);
} pg_desc_ops;
struct pg_desc {
  const pg_desc_ops *ops;
  void *ud;
};

/* What the builders of one stage share: the embeddings built so far (a tied head finds its weight there). */
typedef struct pg_module_env {
  pg_module *embeddings[8];
  int nembeddings;
} pg_module_env;

/* The module of kind `kind` named `name`; NULL and pg_error() for an unknown kind or bad fields. */
pg_module *pg_module_build(pg_context *ctx, const char *kind, const char *name, const pg_desc *d, pg_module_env *env);
/* The container of kind `kind` (PG_KIND_LIST: n children; PG_KIND_WRAPPER: one) around modules built first; NULL
 * and pg_error() for a kind that is no container or bad children, which then stay the caller's. */
pg_module *pg_module_assemble(pg_context *ctx, const char *kind, const char *name, pg_module **children, int n);

/* ---- tensor-parallel pieces ----
 * The communication of Megatron's regions, named once; the modules that
 * shard (column/row Linear, vocabulary-parallel embedding and head, modules
 * written in Lua) are built from these instead of their own collectives.
 * Each works on the module's backend memory over its context's tensor group
 * and is a no-op (or a plain copy) when T = 1. */

/* reduce-from-region, forward: y (n elements of dtype: float32, or bfloat16 for precision bf16's activations) =
 * its sum over the tensor group, in place. */
int pg_tp_reduce_forward(pg_module *m, void *y, int64_t n, pg_dtype dtype);
/* copy-to-region, backward: dx = its sum over the tensor group, in place. */
int pg_tp_copy_backward(pg_module *m, float *dx, int64_t n);
/* gather-from-region, forward (and scatter-to-region's backward): every rank's
 * [N, w] columns into the full [N, T*w] matrix. Each rank's w columns are
 * `blocks` sub-blocks of bw[b] columns (a fused q|k|v, gate|up), and the
 * full row is block-major: rank k's sub-block b lands at columns
 * T*(bw[0] + ... + bw[b-1]) + k*bw[b]. scratch: T*N*w floats (mine may
 * already sit at rank r's place in it). */
int pg_tp_gather_forward(pg_module *m, float *full, const float *mine, float *scratch, int N, int w, int blocks,
                         const int *bw);
/* scatter-to-region, forward (and gather-from-region's backward): this rank's
 * [N, w] columns of the full [N, T*w] matrix, in the layout above. */
int pg_tp_scatter_forward(pg_module *m, float *mine, const float *full, int N, int w, int blocks, const int *bw);

/* ---- sequence parallelism (Korthikanti et al. 2022) ----
 * Outside the tensor-parallel regions (the norms, residual adds, the
 * embedding's output, the stage boundaries) each tensor rank holds only its
 * share of a micro-batch's N = B*T rows (batch-major, as everywhere): rank r
 * of T holds rows [N r / T, N (r+1) / T), uneven when T does not divide N
 * (none when N < T: a row-wise module then runs no kernel), so that the
 * ranks' rows in rank order are the serial rows. Where Megatron's
 * regions all-reduce, the rows are all-gathered before a column-parallel
 * layer (its backward reduce-scatters the input gradient) and
 * reduce-scattered after a row-parallel one (its backward all-gathers the
 * output gradient). */
static inline int64_t pg_sp_row0(int64_t N, int T, int r) { return N * r / T; }
static inline int64_t pg_sp_rows(int64_t N, int T, int r) { return N * (r + 1) / T - N * r / T; }
/* The most rows a rank holds of a micro-batch of at most N rows. */
static inline int64_t pg_sp_rows_max(int64_t N, int T) { return (N + T - 1) / T; }

/* Turns sequence parallelism on for m (before its buffers are allocated; a
 * no-op when T = 1). What it means depends on m's kind (its traits' pg_sp_role):
 *   row-wise kinds (layernorm, rmsnorm, gelu, swiglu, a plain linear,
 *     residual, recompute, sequential) take and give this rank's rows; their
 *     replicated parameters now see only those rows, so they are marked
 *     sequence_parallel (the engine sums their gradients over the tensor group);
 *   a column-parallel linear and the LM head take this rank's rows and
 *     all-gather them (backward: the input gradient is reduce-scattered);
 *   a row-parallel linear and the embedding give this rank's rows, the
 *     partial sums reduce-scattered instead of all-reduced (backward: the
 *     output gradient is all-gathered);
 *   sp_gather / sp_scatter are the transitions themselves (always on).
 * Kinds that need whole sequences (attention, moe, modules and objectives
 * written in Lua) refuse: wrap them in sp_gather ... sp_scatter. */
int pg_module_sequence_parallel(pg_module *m);

/* The transitions around a module that needs every row of the micro-batch
 * replicated (Megatron's gather-from- and scatter-to-sequence-parallel
 * regions): sp_gather all-gathers this rank's rows into the full [N, width]
 * activation (backward: this rank's rows of the gradient, which is the same on
 * every rank); sp_scatter keeps this rank's rows of a replicated activation
 * (backward: all-gathers the rows of the gradient). */
pg_module *pg_sp_gather_new(pg_context *ctx, const char *name, int width);
pg_module *pg_sp_scatter_new(pg_context *ctx, const char *name, int width);

/* The collectives of the sequence-parallel regions, named once (every module
 * uses these): all-gather of rows: full [N, w] from every rank's rows (`mine`,
 * this rank's rows, may already sit at its place in full); reduce-scatter of
 * rows: full [N, w] holds partial sums on every rank, and this rank's rows of
 * their sum are copied to mine (or, mine = NULL, left in place at row
 * pg_sp_row0 of full). Elements of dtype: float32, or bfloat16 (precision bf16's activations). */
int pg_sp_gather_rows(pg_module *m, void *full, const void *mine, int64_t N, int w, pg_dtype dtype);
int pg_sp_reduce_scatter_rows(pg_module *m, void *full, void *mine, int64_t N, int w, pg_dtype dtype);

/* Frees the tree (children, owned params, buffers). */
void pg_module_free(pg_module *m);
/* Decoding (pg_io.decode): frees every attention's key/value cache (the next decode starts empty). */
void pg_module_release_cache(pg_module *m);
/* PG_OK when every module of the tree has a cache path (pg_io.decode), else PG_ERR naming the first that has not. */
int pg_module_check_decode(const pg_module *m);

/* Puts the whole tree on a backend (before its buffers are allocated). */
int pg_module_set_backend(pg_module *m, const pg_backend *be);

/* Arithmetic precision of the tree (a root: the tree's input and output are
 * float32). FP32: everything in float32. BF16, torch.autocast's rules: the
 * GEMMs of linear, lm_head and moe modules take bf16 operands (a bf16
 * working copy of the float32 master weight) and sum in float32, and the
 * activations a Linear makes bf16 stay bf16 through GELU, SwiGLU and the
 * attention core until a float32 consumer (pg_module.in_bf16/out_bf16, set
 * here); norms, softmax, the loss, the residual stream, parameter gradients
 * and the optimizer stay float32. A module written in Lua computes in
 * float32 (its input, output and arithmetic). Before the buffers are allocated. */
typedef enum { PG_PRECISION_FP32 = 0, PG_PRECISION_BF16 } pg_precision;
int pg_module_set_precision(pg_module *m, pg_precision p);
/* Bytes of the tree's bf16 working weights (0 in FP32). */
size_t pg_module_bf16_bytes(const pg_module *m);
/* ZeRO-3 with bf16 gathers: every module whose GEMM weight is read only as bf16 (linear, an untied lm_head) frees
 * its working weight and marks the weight gather_bf16; from then on its products read the engine's gathered bits
 * (pg_param.data16), refreshed by every gather instead of once a call. moe keeps its own copies (its w1 and w3
 * rows concatenated), so its weights stay float32 gathers. */
void pg_module_bf16_gathered(pg_module *m);
/* The scratch precision bf16 needs of the engine, in elements: the rounded GEMM operands (pg_io.bf16_scratch)
 * and the float32 room for widened bf16 activations (pg_io.wide_scratch). */
typedef struct pg_bf16_need {
  int64_t operand[2];
  int64_t wide[PG_WIDE_SCRATCH];
} pg_bf16_need;
/* Raises each of *need to the largest the tree's modules need once allocated (left alone in FP32). */
void pg_module_bf16_scratch(const pg_module *m, pg_bf16_need *need);

/* Allocates per-slot buffers in the whole tree. */
int pg_module_alloc(pg_module *m, int nslots, int max_rows);

/* Every parameter in the tree, each once, in tree order; *n set. Caller frees the array. */
pg_param **pg_module_collect_params(pg_module *m, int *n);

/* Recomputation's shared memory, one per engine. Backward recomputes one
 * block (recompute = "full") or one attention's probabilities ("selective")
 * at a time, so the insides of all recomputed blocks of a rank, and all
 * recomputed probabilities, live in one region: the activations of a
 * recomputed model are its blocks' outputs per micro-batch in flight plus
 * ONE block's inside, as in Megatron-LM, also with a single micro-batch.
 * The region grows to the largest block's need (a block that outgrows it
 * gets a larger one; the outgrown region is kept until the next reset, for
 * the blocks allocated in it). Lives until after the modules that use it. */
typedef struct pg_recompute_arena pg_recompute_arena;
pg_recompute_arena *pg_recompute_arena_new(const pg_backend *home); /* NULL + pg_error() */
void pg_recompute_arena_free(pg_recompute_arena *a);
/* Before every module of the trees that use it is allocated again (more
 * rows): the outgrown regions go. */
void pg_recompute_arena_reset(pg_recompute_arena *a);
/* The recompute modules and selectively recomputing attentions of m's tree
 * take their recomputed buffers from a (after pg_module_set_backend, before
 * pg_module_alloc). */
int pg_module_use_recompute_arena(pg_module *m, pg_recompute_arena *a);

/* Saved activation bytes per slot, whole tree (what each micro-batch in
 * flight keeps). */
size_t pg_module_saved_bytes(const pg_module *m);
/* Activation bytes kept once, whatever the micro-batches in flight: the
 * largest recomputed unit of the tree (a block's inside, or an attention's
 * probabilities of one micro-batch), which the rank's arena holds; the
 * engine's is the largest over its chunks. */
size_t pg_module_fixed_bytes(const pg_module *m);

/* Calls dispatch. */
static inline int pg_module_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  int hooked = m->nparams > 0 || m->gather_unit;
  if (io->forward_begin && hooked && io->forward_begin(io->backward_ud, m)) return -1;
  int rc = m->ops->forward(m, slot, io, x, y);
  if (rc || !io->forward_done || !hooked) return rc;
  return io->forward_done(io->backward_ud, m);
}
static inline int pg_module_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  int hooked = m->nparams > 0 || m->gather_unit;
  if (io->backward_begin && hooked && io->backward_begin(io->backward_ud, m)) return -1;
  int rc = m->ops->backward(m, slot, io, dy, dx);
  if (rc || !io->backward_done || !hooked) return rc;
  return io->backward_done(io->backward_ud, m);
}

/* Fills a parameter's shard from the init rule: the value of full-tensor
 * element i is a pure function of (seed, name, i). */
void pg_param_init(pg_param *p, uint64_t seed);
/* Index into the full tensor of the shard's local element i. */
int64_t pg_param_full_index(const pg_param *p, int64_t local);
/* The same for the shard held by tensor rank `index`. */
int64_t pg_param_full_index_of(const pg_param *p, int64_t local, int index);
/* Fills the shard from a full tensor of `full_rows` rows (dim 0) laid out as
 * p->full_shape otherwise; rows past full_rows (padding) become 0. */
void pg_param_load_full(pg_param *p, const float *full, int64_t full_rows);
/* Copies local elements [lo, lo + n) of the shard described by p (ndim,
 * shape, full_shape, split_*; data is not used) to or from a full tensor of
 * full_numel elements laid out as p->full_shape (fewer rows are allowed).
 * to_full: full[f(lo + i)] = piece[i], skipping elements past full_numel;
 * else piece[i] = full[f(lo + i)], or 0 past full_numel (padding rows).
 * Checkpoints use it to assemble full tensors from shards and to cut a
 * layout's shard (or a ZeRO range of it) out of a full tensor. */
void pg_param_shard_copy(const pg_param *p, float *full, int64_t full_numel, float *piece, int64_t lo, int64_t n,
                         int to_full);

#endif
