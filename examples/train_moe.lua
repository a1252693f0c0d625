-- Train a small mixture of experts (Mixtral's blocks: LLaMA's attention, a
-- sparse MoE feed-forward of --experts SwiGLU experts, each token routed to
-- --top-k of them) on the default corpus: the recipe of examples/train_gpt.lua
-- with --model=mixtral, whose options it takes. Logs ce_loss, aux_loss (the
-- load-balancing term, --aux-loss-coef times transformers'
-- load_balancing_loss_func) and expert_tokens_<e> (each expert's choices over
-- all layers in the last batch) to metrics.jsonl.
--   ./pglua examples/train_moe.lua [--steps=300] [--experts=4] [--top-k=2] ...
--   mpirun -np 4 ./pglua examples/train_moe.lua --tensor=2 --pipeline=2 --micro-batches=4
--   mpirun -np 4 ./pglua examples/train_moe.lua --data=4 --expert=2
-- --expert=E spreads the experts over groups of E data ranks (each holds
-- experts / E of every layer; tokens travel to them by all-to-all);
-- --capacity-factor=c drops the choices beyond each expert's capacity,
-- --jitter=j adds router input noise. cpu backend only.
-- The model: pg.nn.Mixtral{vocab = 256, seq_len = 128, dim = 256, heads = 8,
-- kv_heads = 2, hidden = 688, layers = 4, experts = 4, top_k = 2}.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
-- train_gpt.lua under this script's name (its usage and messages), with
-- --model's default mixtral (a --model= given still wins)
assert(loadfile(here .. "train_gpt.lua"))({ name = "train_moe.lua", model = "mixtral",
  description = "Train a small mixture of experts (or --model=gpt | llama) on the default corpus with the Trainer "
    .. "(the recipe of examples/train_gpt.lua)." })
