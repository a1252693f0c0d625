-- Training-step benchmark on a GPU: tokens/s and MFU of GPT-2 and LLaMA, float32 against the cuBLAS FP32 sgemm
-- rate and precision = "bf16" against the bf16 GEMM rate (bf16 inputs, float32 sums: the products bf16 training
-- runs), both measured in the same run on the same device.
--
--   pglua scripts/bench_gpu.lua [--model=124m|small|tiny|llama-1b|llama-tiny] [--batch=B] [--seq=T]
--       [--seqs=T1,T2,...] [--tokens=N] [--steps=N] [--warmup=W] [--peak-n=N] [--precision=fp32|bf16|both]
--
-- Prints, one per line (rank 0):
--   gpu cuda runtime R driver D cuBLAS C NCCL N   (library versions)
--   peak sgemm_fp32 <GFLOP/s> (n = N)                          (fp32, both)
--   peak gemm_bf16 <GFLOP/s> (n = N)                           (bf16, both)
--   <model> BxT tokens_per_s <v> step_ms <v> mfu_vs_sgemm <v> mfu_attn <v> (fp32, TF32 off)
--   <model> BxT tokens_per_s <v> step_ms <v> mfu_vs_bf16_gemm <v> mfu_attn <v> (bf16 ...)
--   attention_bf16 T <T> HS <hs> BxNH <B>x<NH> fwd_ms <v> bwd_ms <v> tokens_per_s <v> fwd_tflops <v>
--       bwd_tflops <v> fwd_vs_bf16_gemm <v> bwd_vs_bf16_gemm <v>          (--attention: the kernel alone)
-- (<model>: gpt2-124m, gpt2-small, gpt2-tiny, llama-1b, llama-tiny), one line per sequence length of --seqs.
-- MFU = 6 x parameters x tokens/s (the matmul FLOPs of forward and backward) over the measured GEMM rate of the
-- run's precision; mfu_attn adds attention's score and value products, 12 x layers x dim x T per token (forward
-- and backward of a causal model counted in full, as PaLM's appendix does), so long sequences are not
-- understated. scripts/bench_torch_gpu.py prints the same figures for PyTorch. --tokens fixes the tokens of a
-- step (the batch is tokens / T) so that sequence lengths compare at equal work. Against a datasheet's dense
-- bf16 peak (lua/pipegoose/plan/hardware.lua: H100 SXM 989.5 TFLOP/s), multiply by peak gemm_bf16 / datasheet.
-- On the emulated device (build-emu) use --model=tiny or llama-tiny: it checks the script, not the speed.
-- --attention=T,T,...: before the training steps, the bf16 tensor-core flash attention kernels
-- (pg.cuda.flash_bf16_seconds: causal, multi-head) at each T with head sizes 64 and 128, B = --attention-tokens
-- / T sequences and NH = --attention-dim / HS heads. FLOPs counted as the causal products' useful half:
-- forward 2 products (Q K^T, P V) of 2 T^2 HS / 2 per (sequence, head), backward 5 (S again, dP, dV, dK, dQ);
-- the rates against the bf16 GEMM peak of the same run (measured for it whatever --precision says).
local pg = require "pipegoose"
local argparse = require "argparse"

-- lua-argparse, as the other scripts: --help, and an unknown option is an error
-- (defaults that depend on --model are filled in below)
local parser = argparse("bench_gpu.lua", "GPT-2 training-step tokens/s and MFU on a GPU against the cuBLAS GEMM "
  .. "rates measured in the same run.")
local function to_int(s) return math.tointeger(tonumber(s)) end
parser:option("--model", "124m, small, tiny, llama-1b or llama-tiny (the tiny ones check the script on the "
  .. "emulated device).", "124m"):choices{ "124m", "small", "tiny", "llama-1b", "llama-tiny" }
parser:option("--batch", "Sequences per step (default 8 for 124m, else 4; or --tokens / T)."):convert(to_int)
parser:option("--seq", "Tokens per sequence (default: the model's seq_len)."):convert(to_int)
parser:option("--seqs", "Several sequence lengths, comma-separated (one engine, of seq_len T, and one line "
  .. "each)."):convert(function(v)
  local list = {}
  for t in v:gmatch("[^,]+") do
    local n = to_int(t)
    if not n or n < 1 then return nil, "--seqs: '" .. t .. "' is not a positive integer" end
    list[#list + 1] = n
  end
  if #list == 0 then return nil, "--seqs: no lengths" end
  return list
end)
parser:option("--tokens", "Tokens per step: the batch is tokens / T (at least 1) for each T."):convert(to_int)
parser:option("--steps", "Timed steps.", "10"):convert(to_int)
parser:option("--warmup", "Untimed steps first.", "2"):convert(to_int)
parser:option("--peak-n", "The GEMM size n of the peak rate (default 8192; tiny 64)."):convert(to_int)
parser:option("--precision", "fp32, bf16 or both.", "both"):choices{ "fp32", "bf16", "both" }
parser:option("--attention", "T list of the bf16 flash attention kernel bench (none: skip; default "
  .. "1024,4096,8192, tiny 64).")
parser:option("--attention-tokens", "Tokens (B x T) of each attention bench shape (default 16384; tiny 64)."):convert(to_int)
parser:option("--attention-dim", "NH x HS of the attention bench (default 2048; tiny 128).", nil):convert(to_int)
local args = parser:parse()
local opt = { model = args.model, batch = args.batch, seq = args.seq, steps = args.steps, warmup = args.warmup,
              ["peak-n"] = args.peak_n, precision = args.precision, tokens = args.tokens }
local function int(k, d) return math.tointeger(tonumber(opt[k] or d)) or error("--" .. k .. " needs an integer", 0) end

-- family: the pg.nn constructor; label: the name printed (bench_torch_gpu.py's MODELS are the same shapes)
local MODELS = {
  ["124m"] = { family = "GPT", label = "gpt2-124m",
    cfg = { vocab = 50257, padded_vocab = 50304, seq_len = 1024, dim = 768, heads = 12, layers = 12 } },
  small = { family = "GPT", label = "gpt2-small",
    cfg = { vocab = 8192, padded_vocab = 8192, seq_len = 256, dim = 384, heads = 6, layers = 6 } },
  tiny = { family = "GPT", label = "gpt2-tiny",
    cfg = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 } },
  -- TinyLlama-1.1B's shape: 22 layers of 2048, 32 query and 4 key/value heads, SwiGLU of 5632
  ["llama-1b"] = { family = "Llama", label = "llama-1b",
    cfg = { vocab = 32000, seq_len = 4096, dim = 2048, heads = 32, kv_heads = 4, hidden = 5632, layers = 22 } },
  ["llama-tiny"] = { family = "Llama", label = "llama-tiny",
    cfg = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, kv_heads = 2, hidden = 48,
            layers = 2 } },
}
local name = opt.model or "124m"
local model = MODELS[name] or error("bench_gpu.lua: --model is 124m, small, tiny, llama-1b or llama-tiny", 0)
local cfg = model.cfg
local seqs = args.seqs or { int("seq", cfg.seq_len) }
-- the model of one length: seq_len = T (GPT-2's position table has T rows, as bench_torch_gpu.py's)
local function cfg_for(T)
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.seq_len = T
  return c
end
local function batch_for(T)
  if opt.tokens then return math.max(1, opt.tokens // T) end
  return int("batch", name == "124m" and 8 or 4)
end
local steps, warmup = int("steps", 10), int("warmup", 2)

local ok, why = pg.cuda.available()
if not ok then error("bench_gpu.lua: no GPU: " .. tostring(why), 0) end
local v = pg.cuda.versions()
print(("gpu cuda runtime %d driver %d cuBLAS %d NCCL %d"):format(v.runtime, v.driver, v.cublas, v.nccl))

local which = opt.precision or "both"
local PRECISIONS = { fp32 = { "fp32" }, bf16 = { "bf16" }, both = { "fp32", "bf16" } }
local precisions = PRECISIONS[which] or error("bench_gpu.lua: --precision is fp32, bf16 or both", 0)

-- The peak each precision is measured against: cuBLAS sgemm (TF32 off) and GemmEx (bf16 x bf16 -> float32).
-- the tiny models check the script on the emulated device: small peaks and attention shapes
local tiny = name == "tiny" or name == "llama-tiny"
local n = int("peak-n", tiny and 64 or 8192)
local reps = tiny and 2 or 20
local peaks = {}
for _, p in ipairs(precisions) do
  if p == "fp32" then
    peaks.fp32 = pg.cuda.sgemm_gflops(n, reps)
    print(("peak sgemm_fp32 %.1f GFLOP/s (n = %d)"):format(peaks.fp32, n))
  else
    peaks.bf16 = pg.cuda.bf16_gemm_gflops(n, reps)
    print(("peak gemm_bf16 %.1f GFLOP/s (n = %d, bf16 inputs, float32 sums)"):format(peaks.bf16, n))
  end
end

-- the bf16 flash attention kernels alone, at each T and head size (the bf16 GEMM peak measured if not yet)
local attention = args.attention or (tiny and "64" or "1024,4096,8192")
if attention ~= "none" then
  local tokens = args.attention_tokens or (tiny and 64 or 16384)
  local dim = args.attention_dim or (tiny and 128 or 2048)
  if not peaks.bf16 then
    peaks.bf16 = pg.cuda.bf16_gemm_gflops(n, reps)
    print(("peak gemm_bf16 %.1f GFLOP/s (n = %d, bf16 inputs, float32 sums)"):format(peaks.bf16, n))
  end
  for ts in attention:gmatch("[^,]+") do
    local at = to_int(ts) or error("bench_gpu.lua: --attention is a list of integers or none, not " .. ts, 0)
    for _, hs in ipairs{ 64, 128 } do
      local ab, nh = math.max(1, tokens // at), math.max(1, dim // hs)
      local fwd, bwd = pg.cuda.flash_bf16_seconds(ab, at, nh, nh, hs, tiny and 1 or 10)
      local flop = 2.0 * ab * nh * at * at * hs -- the forward's two causal products
      print(("attention_bf16 T %d HS %d BxNH %dx%d fwd_ms %.3f bwd_ms %.3f tokens_per_s %.0f fwd_tflops %.1f "
        .. "bwd_tflops %.1f fwd_vs_bf16_gemm %.3f bwd_vs_bf16_gemm %.3f"):format(at, hs, ab, nh, fwd * 1e3, bwd * 1e3,
        ab * at / (fwd + bwd), flop / fwd / 1e12, 2.5 * flop / bwd / 1e12, flop / fwd / (peaks.bf16 * 1e9),
        2.5 * flop / bwd / (peaks.bf16 * 1e9)))
    end
  end
end


-- A step's tokens: B sequences of T + 1 (inputs and targets shifted by one).
local function batch_of(B, T)
  local ids = {}
  for b = 1, B do
    ids[b] = {}
    for t = 1, T + 1 do ids[b][t] = (b * 7919 + t * 104729) % cfg.vocab end
  end
  local all = pg.tensor(ids, { dtype = "int32" })
  return all:narrow(2, 1, T), all:narrow(2, 2, T)
end

-- which attention core precision bf16 asked for: the tensor-core kernels take head sizes 64 and 128 at T a
-- multiple of 16 (kind_attention.c's tensor_cores: 124m, small and llama-1b have head size 64; the tiny models'
-- 8 take the float32 core), PG_FLASH_BF16=0 the float32 core on the widened q|k|v everywhere
local attention_path = pg.core.env("PG_FLASH_BF16") and "attention on tensor cores where the shape allows"
  or "attention in float32, PG_FLASH_BF16=0"
for _, precision in ipairs(precisions) do
  for _, T in ipairs(seqs) do
    local B = batch_for(T)
    local x, y = batch_of(B, T)
    local engine = pg.parallelize(pg.nn[model.family](cfg_for(T)), nil,
      { device = "cuda", seed = 1, precision = precision })
    local optim = pg.optim.AdamW(engine, { lr = 1e-4, weight_decay = 0.1 })
    local function step()
      engine:zero_grad()
      local loss = engine:forward_backward(x, y)
      optim:clip_grad_norm(1.0)
      optim:step()
      return loss
    end
    for _ = 1, warmup do step() end
    pg.cuda.synchronize()

    local t0 = pg.wtime()
    local loss
    for _ = 1, steps do loss = step() end
    pg.cuda.synchronize()
    local dt = (pg.wtime() - t0) / steps
    local params = engine:num_parameters()
    local tps = B * T / dt
    local flops_per_token = 6 * params
    local attn_per_token = 12 * cfg.layers * cfg.dim * T
    local mfu = flops_per_token * tps / (peaks[precision] * 1e9)
    local mfu_attn = (flops_per_token + attn_per_token) * tps / (peaks[precision] * 1e9)
    if precision == "fp32" then
      print(("%s %dx%d tokens_per_s %.0f step_ms %.2f mfu_vs_sgemm %.3f mfu_attn %.3f loss %.4f (fp32, TF32 off, "
        .. "%d parameters)"):format(model.label, B, T, tps, dt * 1e3, mfu, mfu_attn, loss, params))
    else
      print(("%s %dx%d tokens_per_s %.0f step_ms %.2f mfu_vs_bf16_gemm %.3f mfu_attn %.3f loss %.4f (bf16 linear "
        .. "and lm_head products, float32 sums and masters, %d parameters, %s)")
        :format(model.label, B, T, tps, dt * 1e3, mfu, mfu_attn, loss, params, attention_path))
    end
    engine, optim = nil, nil
    collectgarbage() -- this engine's device memory goes before the next is made (124M: both would fit, 1B not)
  end
end
