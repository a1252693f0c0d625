-- The parts of scripts/bench.lua, in the order they run. A part is
--   name         what BENCH_ONLY calls it
--   description  a line or more ("\n") for --help
--   needs        parts that must run first when this one runs, selected or
--                not (their figures are this one's reference: the sgemm peak)
--   run(ctx)     measures and prints; figures later parts use go into ctx.results
--   finish(ctx)  shared by neighbouring parts that print one table together:
--                called once, after the last of them that runs
-- A part without run is a peer that other parts measure next to their own
-- figures when it is selected (ctx.want).
-- ctx: ncores, want(name), steps(n) (BENCH_STEPS or n, as a worker's --steps),
-- results (figures passed from part to part).
local pg = require "pipegoose"
local common = require "bench.common"
local steps = require "bench.steps"
local scaling = require "bench.scaling"

--- Prints the lines of a script that measures on its own (its figures are its own peers).
local function external(title, cmd, failure)
  local _, lines, rc = common.run(cmd)
  print(title)
  for _, l in ipairs(lines) do print("  " .. l) end
  if rc ~= 0 then common.failures[#common.failures + 1] = failure end
end

return {
  { name = "peak", description = "sgemm GFLOP/s through pg.ops.linear, all cores and one thread",
    run = require "bench.peak" },
  { name = "gpt2", description = "GPT-2 124M (padded vocab 50304, 12 x 768, seq 64), batch 4 x 64, fp32, all cores",
    needs = { "peak" }, run = steps.part("gpt2_124m", "gpt2", "", true), finish = steps.table },
  { name = "gpt2_b8", description = "GPT-2 124M on a larger batch, 8 x 256, fp32, all cores",
    needs = { "peak" }, run = steps.part("gpt2_124m_b8x256", "gpt2_b8", "--batch 8 --seq-len 256"),
    finish = steps.table },
  { name = "small", description = "a small GPT (dim 256, 4 heads, 4 layers), batch 16 x 128, all cores",
    needs = { "peak" }, run = steps.part("small", "small", "--small"), finish = steps.table },
  { name = "llama", description = "a LLaMA of GPT-2 124M's shape (GQA 12/4 heads, RoPE, SwiGLU 2048, vocab 32000), "
      .. "batch 4 x 64",
    needs = { "peak" }, run = steps.part("llama_124m", "llama", "--llama"), finish = steps.table },
  { name = "bf16", description = "GPT-2 124M and the small model in fp32 and precision = \"bf16\" in the same run:\n"
      .. "tokens/s, ratio, memory per rank, and which bf16 GEMM path ran (oneDNN or the fallback) and why",
    run = require "bench.precision" },
  { name = "torch", description = "the same steps (gpt2, small, llama) in PyTorch (scripts/bench_torch.py), "
      .. "skipped without torch" },
  { name = "llmc", description = "GPT-2 124M's step in llm.c's CPU trainer (train_gpt2.c, same B = 4, T = 64),\n"
      .. "when LLMC_DIR names a checkout of github.com/karpathy/llm.c (built here\n"
      .. "with its own `make train_gpt2` if needed; nothing of it is in this repository)" },
  { name = "tp", description = "GPT-2 124M: tensor = 2 (2 ranks x 1 thread) against 1 rank x 1 thread",
    needs = { "peak" }, run = scaling.tp, finish = scaling.finish },
  { name = "dp", description = "GPT-2 124M, 4 x 64 per rank: data = 2 (zero 0 and 1) against 1 rank x 1 thread",
    needs = { "peak" }, run = scaling.dp, finish = scaling.finish },
  { name = "overlap", description = "data = 2 over MPI, the small model: step, gradient reduction and its exposed "
      .. "part with\noverlap_grad_reduce off and on; bytes per parameter for zero 0, 1 and 2",
    run = require "bench.overlap" },
  { name = "zero3", description = "data = 2 over MPI, the small model: zero = 3 against zero = 1 (and 2), step time "
      .. "ratio,\nbytes moved per step over the data group against the 3x-parameter-bytes theory, memory per rank",
    run = require("bench.zero3").part },
  { name = "pp", description = "pipeline = 2, M = 1..16 micro-batches: bubble and activation peak, GPipe and 1F1B",
    run = require "bench.pp" },
  { name = "memory", description = "the small model with recompute = full and selective (against none), and\n"
      .. "sequence_parallel at tensor = 2 (against tensor = 2 without): activation peak and step time",
    run = require "bench.memory" },
  { name = "context", description = "context parallelism (ring attention), a tiny GPT on one 4096-token sequence:\n"
      .. "context = 2 against 1 (step time, activation bytes per rank)",
    run = require "bench.context" },
  { name = "cp_longest", description = "the longest sequence a tiny GPT trains within 24 GiB in all (its ranks "
      .. "share it) at context = 4\n(4 ranks x 1 thread) against context = 1, from engine:memory() fitted at "
      .. "T = 256..2048 and the planner's\nmodel; then 2 real steps at context = 4 (that T, or the longest that "
      .. "trains in about 3 minutes)",
    run = require("bench.cp_longest").part },
  { name = "moe", description = "a mixture of experts (4 experts, top-2) over data = 2, expert = 2 against the dense\n"
      .. "model with the same active parameters, and all_to_all against MPI_Alltoall",
    run = require "bench.moe" },
  { name = "slowlink", description = "two network-namespace hosts over a 10 Mbit/s link (tc tbf), a rank each: "
      .. "tokens/s of data = 2 across\nthem against 2 DiLoCo islands at H = 50 (skipped where ip netns is not "
      .. "permitted)",
    run = require("bench.slowlink").run },
  { name = "diloco", description = "DiLoCo: 4 islands syncing every H = 10 and 50 steps against data = 4 on the "
      .. "default corpus,\nthe same tokens: final val loss and bytes communicated per step",
    run = require "bench.diloco" },
  { name = "comm", description = "scripts/bench_comm.lua (collectives against bare MPI)",
    run = function()
      print()
      external("== collectives (scripts/bench_comm.lua, 2 ranks)",
        ("OMP_NUM_THREADS=1 scripts/mpirun.sh -np 2 -x OMP_NUM_THREADS %s scripts/bench_comm.lua"):format(common.PGLUA),
        "comm")
    end },
  { name = "gpu", description = "scripts/bench_gpu.lua on this rank's GPU (GPT-2 124M tokens/s and MFU against\n"
      .. "the cuBLAS FP32 sgemm rate measured in the same run), skipped without a GPU",
    run = function()
      print()
      local ok, why = pg.cuda.available()
      if not ok then
        print("== GPU: skipped (" .. tostring(why) .. ")")
        return
      end
      external("== GPU (scripts/bench_gpu.lua)", ("%s scripts/bench_gpu.lua"):format(common.PGLUA), "gpu")
    end },
  { name = "generate", description = "pg.generate tokens/s (LLaMA ~26M, prompt 32, 128 new, batch 1 and 8, greedy): "
      .. "the key/value\ncache against recompute and transformers' generate (scripts/bench_generate.py)",
    run = require "bench.generate" },
  { name = "tokenizer", description = "pg.tokenizer encode MB/s on >= 20 MB (the Debian fortunes, repeated) against\n"
      .. "tiktoken and Hugging Face tokenizers (scripts/bench_tokenizer.py) on the same texts, 1 thread,\n"
      .. "2 and all; training time against BpeTrainer (scripts/bench/tokenizer.lua)",
    run = require "bench.tokenizer" },
}
