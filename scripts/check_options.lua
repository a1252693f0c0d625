-- The options the check scripts share (gpt2_check.lua, model_check.lua): the
-- AdamW steps on one batch and the parallel layout they run in.
--   dofile(dir .. "check_options.lua")(parser, {steps = "10", weight_decay_help = "..."})
-- adds them to a lua-argparse parser.
-- Run by itself (pglua scripts/check_options.lua --help) it says what it is and how it is used.
require "pipegoose.library_file"("dofile(dir .. \"check_options.lua\")(parser, {steps = \"10\"})",
  "check_options.lua is not a script: gpt2_check.lua and model_check.lua load it to add the options they share "
  .. "(AdamW steps on one batch, the parallel layout) to their lua-argparse parser.")
return function(p, o)
  o = o or {}
  local function to_int(s) return math.tointeger(tonumber(s)) end
  p:option("--steps", "AdamW steps on the same batch.", o.steps or "0"):convert(to_int)
  p:option("--lr", "Learning rate.", "1e-3"):convert(tonumber)
  p:option("--beta1", "AdamW beta1.", "0.9"):convert(tonumber)
  p:option("--beta2", "AdamW beta2.", "0.95"):convert(tonumber)
  p:option("--eps", "AdamW eps.", "1e-8"):convert(tonumber)
  p:option("--weight-decay", "Decoupled weight decay (tensors of 2+ dimensions).", "0.1"):convert(tonumber)
  p:option("--clip", "Clip the global gradient norm to this (0: no clipping).", "0"):convert(tonumber)
  p:option("--tensor", "Tensor-parallel size.", "1"):convert(to_int)
  p:option("--pipeline", "Pipeline stages.", "1"):convert(to_int)
  p:option("--data", "Data-parallel size.", "1"):convert(to_int)
  p:option("--expert", "Expert-parallel size (divides --data; a mixture of experts' experts spread over it).", "1")
    :convert(to_int)
  p:option("--micro-batches", "Micro-batches per step.", "1"):convert(to_int)
  local schedules = require("pipegoose.core").schedules() -- the runtime's (src/engine/pg_schedule.c)
  p:option("--schedule", "Pipeline schedule.", schedules.default):choices(schedules.offered)
  p:option("--virtual-stages", "Model chunks per pipeline stage (more than 1: the interleaved 1F1B schedule).", "1")
    :convert(to_int)
  p:option("--zero", "ZeRO stage.", "0"):convert(to_int)
  p:option("--device", "cpu, cuda or cuda:N.", "cpu")
  p:option("--recompute", "Activation recomputation: none, full (each block) or selective (attention).", "none")
    :choices{ "none", "full", "selective" }
  p:option("--precision", "fp32, or bf16 (bf16 GEMM operands, float32 sums, masters and optimizer).", "fp32")
    :choices{ "fp32", "bf16" }
  p:flag("--sequence-parallel", "Sequence parallelism: the norms and residuals hold 1/tensor of the rows (tensor > 1).")
  return to_int
end
