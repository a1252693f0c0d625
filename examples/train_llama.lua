-- Train a small LLaMA (RMSNorm, rotary embeddings, grouped-query attention,
-- SwiGLU, untied head) on the default corpus, on one rank or many: the
-- recipe of examples/train_gpt.lua with --model=llama, whose options it takes:
--   ./pglua examples/train_llama.lua --corpus=data/corpus [--steps=1000] [--kv-heads=2] [--save-hf=runs/llama_hf] ...
--   mpirun -np 8 ./pglua examples/train_llama.lua --tensor=2 --pipeline=2 --data=2 --micro-batches=4
-- (make run is the first line with make's corpus of fortunes and the King James Bible.)
-- The model: pg.nn.Llama{vocab = the corpus's (256 without --corpus: bytes), seq_len = 128,
-- dim = 128, heads = 8, kv_heads = 2, hidden = 344, layers = 4, rope_theta = 10000}.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
-- train_gpt.lua under this script's name (its usage and messages), with
-- --model's default llama (a --model= given still wins)
assert(loadfile(here .. "train_gpt.lua"))({ name = "train_llama.lua", model = "llama",
  description = "Train a small LLaMA (or --model=gpt | mixtral) on the default corpus with the Trainer "
    .. "(the recipe of examples/train_gpt.lua)." })
