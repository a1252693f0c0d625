-- Train a small LLaMA (RMSNorm, rotary embeddings, grouped-query attention,
-- SwiGLU, untied head) on the default corpus, on one rank or many: the
-- recipe of examples/train_gpt.lua with --model=llama, whose options it takes:
--   ./pglua examples/train_llama.lua [--steps=300] [--kv-heads=2] [--save-hf=runs/llama_hf] ...
--   mpirun -np 8 ./pglua examples/train_llama.lua --tensor=2 --pipeline=2 --data=2 --micro-batches=4
-- The model: pg.nn.Llama{vocab = 256, seq_len = 128, dim = 256, heads = 8,
-- kv_heads = 2, hidden = 688, layers = 4, rope_theta = 10000}.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
table.insert(arg, 1, "--model=llama") -- a --model= given after it still wins
dofile(here .. "train_gpt.lua")
