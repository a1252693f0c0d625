--- pipegoose.plan.published: measured large-scale runs to hold the planner to.
--
-- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
-- Clusters Using Megatron-LM", SC'21 (arXiv 2104.04473). Selene: DGX A100
-- nodes, 8 x A100-80GB per node, NVLink/NVSwitch inside, 8 x 200 Gb/s HDR
-- InfiniBand per node. GPT models, vocabulary 51200, sequence length 2048,
-- mixed precision, activation recomputation; per-GPU throughput counts
-- F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h)) FLOPs per step (recomputation
-- included: 4 forward passes' worth of layer FLOPs, 3 of the logits).
--   table1: the paper's Table 1 (weak scaling, 1.7B to 1T parameters).
--   table2: the PTD-P half of Table 2 (175B and 530B, strong scaling,
--           micro-batch 1; model-parallel size 96 = T8 x P12, 280 = T8 x P35).
--   sec5_1: Section 5.1's end-to-end estimate, GPT-3 175B on 1024 GPUs at
--           batch 1536: 140 TFLOP/s per GPU ("34 days" for 300B tokens). The
--           paragraph does not print the layout; T=8, P=16 is the one issue
--           17 records for it and is marked as such.
-- The paper's software had no sequence parallelism and no distributed
-- optimizer (zero = 0), recomputed every layer (recompute = full) and used
-- the interleaved 1F1B schedule for some runs, which the planner does not
-- model yet (it simulates plain 1F1B: a larger bubble, so a lower estimate).
local gpt2 = require "pipegoose.models.gpt2"

local M = {}

-- the paper's GPT models: the GPT-2 family's architecture (models/gpt2.lua)
local function gpt(layers, hidden, heads)
  return { arch = gpt2.name, layers = layers, hidden = hidden, heads = heads, ffn = 4 * hidden, vocab = 51200,
    seq_len = 2048 }
end

M.SOURCE = "Narayanan et al. 2021 (arXiv 2104.04473)"

M.ROWS = {
  { id = "table1", params_b = 1.7, model = gpt(24, 2304, 24), t = 1, p = 1, gpus = 32, batch = 512, tflops = 137 },
  { id = "table1", params_b = 3.6, model = gpt(30, 3072, 32), t = 2, p = 1, gpus = 64, batch = 512, tflops = 138 },
  { id = "table1", params_b = 7.5, model = gpt(36, 4096, 32), t = 4, p = 1, gpus = 128, batch = 512, tflops = 142 },
  { id = "table1", params_b = 18.4, model = gpt(40, 6144, 48), t = 8, p = 1, gpus = 256, batch = 1024, tflops = 135 },
  { id = "table1", params_b = 39.1, model = gpt(48, 8192, 64), t = 8, p = 2, gpus = 512, batch = 1536, tflops = 138 },
  { id = "table1", params_b = 76.1, model = gpt(60, 10240, 80), t = 8, p = 4, gpus = 1024, batch = 1792, tflops = 140 },
  { id = "table1", params_b = 145.6, model = gpt(80, 12288, 96), t = 8, p = 8, gpus = 1536, batch = 2304, tflops = 148 },
  { id = "table1", params_b = 310.1, model = gpt(96, 16384, 128), t = 8, p = 16, gpus = 1920, batch = 2160, tflops = 155 },
  { id = "table1", params_b = 529.6, model = gpt(105, 20480, 128), t = 8, p = 35, gpus = 2520, batch = 2520, tflops = 163 },
  { id = "table1", params_b = 1008.0, model = gpt(128, 25600, 160), t = 8, p = 64, gpus = 3072, batch = 3072, tflops = 163 },
  { id = "table2", params_b = 174.6, model = gpt(96, 12288, 96), t = 8, p = 12, gpus = 384, batch = 1536, b = 1, tflops = 153 },
  { id = "table2", params_b = 174.6, model = gpt(96, 12288, 96), t = 8, p = 12, gpus = 768, batch = 1536, b = 1, tflops = 149 },
  { id = "table2", params_b = 174.6, model = gpt(96, 12288, 96), t = 8, p = 12, gpus = 1536, batch = 1536, b = 1, tflops = 141 },
  { id = "table2", params_b = 529.6, model = gpt(105, 20480, 128), t = 8, p = 35, gpus = 560, batch = 2240, b = 1, tflops = 171 },
  { id = "table2", params_b = 529.6, model = gpt(105, 20480, 128), t = 8, p = 35, gpus = 1120, batch = 2240, b = 1, tflops = 167 },
  { id = "table2", params_b = 529.6, model = gpt(105, 20480, 128), t = 8, p = 35, gpus = 2240, batch = 2240, b = 1, tflops = 159 },
  { id = "sec5_1", params_b = 174.6, model = gpt(96, 12288, 96), t = 8, p = 16, gpus = 1024, batch = 1536, tflops = 140,
    layout_from = "issue 17" },
}

-- Fully sharded data parallelism: torchtitan's published FSDP2 runs
-- (pytorch/torchtitan, docs/performance.md, "Llama 3 performance numbers";
-- the torchtitan paper, arXiv 2410.06511, reports the same setup). Llama 3 8B
-- on 64 A100-80GB, FSDP2 only (1D: D = 64, no TP/PP/CP), local batch 1
-- (global 64), sequence 8192 (the repository's llama3_8b.toml, "a preset for
-- 64 A100 GPUs"), bf16 with fp32 gradient reduction, SDPA flash attention,
-- "selective layer" activation checkpointing = selective_ac_option '2': every
-- second block recomputed in full (recompute = "full", recompute_every = 2).
-- Published: 2904 tokens/s per GPU, MFU 56.8%. torchtitan's MFU counts
-- 6 x (all parameters, embedding included) + 12 x layers x hidden x seq FLOPs
-- per token against 312 TFLOP/s: 2904 x (6 x 8.03e9 + 12 x 32 x 4096 x 8192)
-- / 312e12 = 56.9%, which is how the table's figure comes out; the planner's
-- own mfu leaves the embedding lookup out (models.step_flops), so the
-- comparison is made in torchtitan's convention (M.torchtitan_mfu), i.e. on
-- tokens per second.
M.LLAMA3_8B = { name = "llama3-8b", arch = "llama", layers = 32, hidden = 4096, heads = 32, kv_heads = 8, ffn = 14336,
  vocab = 128256, seq_len = 8192 }

M.FSDP_SOURCE = "torchtitan docs/performance.md (pytorch/torchtitan; arXiv 2410.06511)"

M.FSDP_ROWS = {
  { id = "torchtitan", params_b = 8.03, model = M.LLAMA3_8B, gpus = 64, batch = 64, seq_len = 8192,
    recompute = "full", recompute_every = 2, wps = 2904, mfu = 0.568 },
}

--- A layout's MFU counted as torchtitan counts it (see above).
function M.torchtitan_mfu(L, row, peak)
  local models = require "pipegoose.plan.models"
  local s = models.check(row.model)
  local per_token = 6 * models.num_params(s) + 12 * s.layers * s.hidden * row.seq_len
  return L.tokens_per_s / row.gpus * per_token / peak
end

--- The planner's query for an FSDP row: FSDP only (zero 3, T = P = C = 1),
-- the row's checkpointing, flash attention, micro-batch = the local batch.
function M.fsdp_query(row, extra)
  local q = { model = row.model, gpus = row.gpus, gpu = "a100-80gb", gpus_per_node = 8, global_batch = row.batch,
    seq_len = row.seq_len, precision = "bf16", tensor = 1, pipeline = 1, context = 1, zero = 3,
    recompute = row.recompute, recompute_every = row.recompute_every, micro_batch_size = row.batch // row.gpus,
    flash_attention = true }
  for k, v in pairs(extra or {}) do q[k] = v end
  return q
end

--- The planner's query for a row: the paper's model, cluster, batch, T and P
-- and software (no SP, no ZeRO, full recomputation, 1F1B, an unfused attention core: the paper's 2021
-- Megatron-LM predates fused attention); the micro-batch
-- size is left to the planner unless the paper prints it.
function M.query(row, extra)
  local q = { model = row.model, gpus = row.gpus, gpu = "a100-80gb", gpus_per_node = 8, global_batch = row.batch,
    seq_len = 2048, precision = "bf16", tensor = row.t, pipeline = row.p, context = 1, zero = 0, recompute = "full",
    sequence_parallel = false, schedule = "1f1b", micro_batch_size = row.b, flash_attention = false } -- the paper's schedule (plan checks the name)
  for k, v in pairs(extra or {}) do q[k] = v end
  return q
end

return M
