--- pipegoose.plan.cpu: the cost and memory of pipegoose's own CPU engine,
-- priced from a calibrated profile (scripts/calibrate.lua writes it; its
-- `cpu` section is described in hardware.lua).
--
-- The datasheet model (cost.lua) prices a layer as FLOPs at one efficiency
-- and bytes at one bandwidth, which is right for large GPU kernels. On a CPU
-- the rate of a matrix product depends on its shape, every operation has a
-- dispatch cost, and the ranks of a node share its cores. So with a profile
-- that has a `cpu` section, a layer is priced operation by operation, as the
-- engine runs it (src/nn/kind_*.c):
--
--   matrix products   each Linear's forward [r, in] x [in, out] and its two
--                     backward products (dx: [r, out] x [out, in], dw:
--                     [out, r] x [r, in]) at the measured FLOP/s of the
--                     nearest calibrated shapes (r = b*s rows)
--   attention core    4*b*s^2*(heads/T)*head_dim FLOPs forward at the
--                     measured attention rate (backward its own rate)
--   memory-bound ops  bytes read and written / the measured bandwidth of
--                     that kernel at that size (norms, residual adds, GeLU or
--                     SwiGLU, RoPE; the embedding and the cross-entropy at
--                     the residual add's and the norm's); backward: the same
--                     bytes at the kernel's measured backward rate
--   per operation     hw.kernel_overhead (the measured cost of one tiny op)
--   tensor parallel   pg.dist all-reduces of the r*h activation: 2 forward,
--                     2 backward per layer (the engine's column-parallel
--                     backward and row-parallel forward), measured by group
--                     size. With sequence parallelism (L.sp) each becomes
--                     an all-gather before a column-parallel product
--                     (backward: a reduce-scatter, and the input gathered
--                     again for the weight gradient) and a reduce-scatter
--                     after a row-parallel one (backward: an all-gather),
--                     and the norms and residual adds see r/T rows
--   pipeline          p2p latency + r*h*4 bytes / bandwidth: every tensor
--                     rank sends the whole activation to its peer (its r/T
--                     rows with sequence parallelism)
--   data parallel     the engine's shared-memory gradient reduction, measured
--                     by group size; a tied embedding's gradient all-reduce
--   optimizer         AdamW over the rank's parameters at the measured AdamW
--                     bandwidth, zero_grad at the elementwise bandwidth, and
--                     the engine's fixed per-step cost
--
-- Cores: pipegoose gives each of the R ranks of a node max(1, cores // R)
-- threads (src/parallel/pg_context.c). Rates are measured at 1 thread and at all
-- cores; a rank's rate is that of its thread count. With more ranks than
-- cores, R ranks of one thread time-share `cores` cores: everything a rank
-- does takes R / cores times longer. There is no overlap of compute and
-- communication (on one node the engine reduces over shared memory after
-- backward; overlap_grad_reduce applies to MPI only), and a collective measured
-- with g ranks on the node is scaled the same way when R ranks share it.
local models = require "pipegoose.plan.models"
local memory = require "pipegoose.plan.memory"

local M = {}

local F32 = 4

--- Threads of a rank when R ranks share a node, and the share of a core each
-- thread gets when all ranks are busy.
function M.threads(hw, R)
  local cores = hw.cpu.cores
  local t = math.max(1, cores // math.max(1, R))
  return t, math.min(1, cores / (R * t))
end

-- The entry of a table keyed by thread count for t threads: the largest
-- measured count <= t, scaled linearly to t (and the smallest if none is).
local function by_threads(tab, t)
  local best
  for n in pairs(tab) do
    if n <= t and (not best or n > best) then best = n end
  end
  if not best then
    for n in pairs(tab) do if not best or n < best then best = n end end
  end
  return tab[best] * math.min(t, math.max(best, t)) / best
end
M.by_threads = by_threads

-- Rows of a measured table at thread count t (the nearest measured count:
-- equal, else the largest below, else the smallest), and the scale to t.
local function rows_at(list, t)
  local have = {}
  for _, r in ipairs(list) do have[r.threads] = true end
  local best
  for n in pairs(have) do
    if n <= t and (not best or n > best) then best = n end
  end
  if not best then
    for n in pairs(have) do if not best or n < best then best = n end end
  end
  local out = {}
  for _, r in ipairs(list) do if r.threads == best then out[#out + 1] = r end end
  return out, math.max(best, t) / best
end

-- Inverse-distance weighting in log2 space over the 4 nearest measured
-- shapes: a shape between calibrated ones gets a rate between theirs, an
-- exact one its own.
local function interpolate(list, key_fields, query, rate_field)
  local scored = {}
  for _, r in ipairs(list) do
    local d = 0
    for _, f in ipairs(key_fields) do
      local x = math.log(query[f], 2) - math.log(r[f], 2)
      d = d + x * x
    end
    scored[#scored + 1] = { d = d, v = r[rate_field] }
  end
  table.sort(scored, function(a, b) return a.d < b.d end)
  if scored[1].d < 1e-12 then return scored[1].v end
  local wsum, vsum = 0, 0
  for i = 1, math.min(4, #scored) do
    local w = 1 / scored[i].d
    wsum, vsum = wsum + w, vsum + w * scored[i].v
  end
  return vsum / wsum
end

--- Measured FLOP/s of an [m, k] x [k, n] product at t threads.
function M.gemm_rate(hw, m, k, n, t)
  local list, scale = rows_at(hw.cpu.gemm, t)
  return interpolate(list, { "m", "k", "n" }, { m = m, k = k, n = n }, "flops") * scale
end

--- Measured bytes/s of elementwise kernel `op` moving `bytes` (forward, or backward with bwd).
function M.elementwise_rate(hw, op, bytes, t, bwd)
  local list, scale = rows_at(hw.cpu.elementwise[op], t)
  return interpolate(list, { "bytes" }, { bytes = bytes }, bwd and "backward_bandwidth" or "bandwidth") * scale
end

--- Measured FLOP/s of the attention core (forward, or backward with bwd).
function M.attention_rate(hw, q, t, bwd)
  local list, scale = rows_at(hw.cpu.attention, t)
  return interpolate(list, { "batch", "seq", "heads", "head_dim" }, q, bwd and "backward_flops" or "flops") * scale
end

--- Seconds of a collective on g ranks of a buffer of `bytes`, with R ranks
-- on the node (the measurement had g of them).
function M.collective(hw, name, g, bytes, R)
  if g <= 1 then return 0 end
  local tab = hw.cpu.collectives[name]
  local best
  for n in pairs(tab) do
    if not best or math.abs(n - g) < math.abs(best - g) then best = n end
  end
  local l = tab[best]
  local busy = math.max(1, R / hw.cpu.cores) / math.max(1, best / hw.cpu.cores)
  return (l.latency + bytes / l.bandwidth) * math.max(1, busy)
end

-- Sequence parallelism is on for a layout (it needs T > 1).
local function sp_of(L) return L.sp and L.t > 1 end

-- The operations of one layer's forward for r rows (b sequences of s) on a
-- rank of tensor group T: a list of { "gemm", m, k, n } | { "ew", op, bytes } |
-- { "attn", query } | { "allreduce", bytes } | { "sp_gather", bytes } |
-- { "sp_scatter", bytes } (sequence parallelism's transitions of the r*h
-- activation: before a column-parallel product, after a row-parallel one).
local function layer_ops(s, L, r)
  local T, h = L.t, s.hidden
  local hd = models.head_dim(s)
  local kv = models.kv_dim(s)
  local sp = sp_of(L)
  local rr = sp and r / T or r -- the rows of the norms and residual adds
  local ops = {}
  local function add(...) ops[#ops + 1] = { ... } end
  local attn = { batch = L.b, seq = L.seq, heads = s.heads // T, head_dim = hd }
  local norm = s.norm -- the calibrated kernels are named as the shape's norms
  local function into_column() if sp then add("sp_gather", r * h * F32) end end
  local function out_of_row() add(sp and "sp_scatter" or "allreduce", r * h * F32) end
  local function attention()
    add("ew", norm, 2 * rr * h * F32) -- read, write
    into_column()
    add("gemm", r, h, (h + 2 * kv) // T)
    if s.rope then add("ew", "rope", 2 * r * (h + kv) // T * F32) end -- rotary on q and k
    add("attn", attn)
    add("gemm", r, h // T, h)
    out_of_row()
    add("ew", "residual", 3 * rr * h * F32) -- two reads, one write
  end
  local function mlp()
    add("ew", norm, 2 * rr * h * F32)
    into_column()
    if s.gated_mlp then
      add("gemm", r, h, 2 * s.ffn // T)
      add("ew", s.activation, 3 * r * s.ffn // T * F32) -- e.g. silu(gate) * up
    else
      add("gemm", r, h, s.ffn // T)
      add("ew", s.activation, 2 * r * s.ffn // T * F32)
    end
    add("gemm", r, s.ffn // T, h)
    out_of_row()
    add("ew", "residual", 3 * rr * h * F32)
  end
  attention()
  mlp()
  return ops
end

-- Compute and communication seconds of a list of operations, forward and backward.
local function price(hw, ops, t, R, T)
  local over = hw.kernel_overhead or 0
  local f = { compute = 0, tp = 0 }
  local b = { compute = 0, tp = 0 }
  for _, op in ipairs(ops) do
    local kind = op[1]
    if kind == "gemm" then
      local m, k, n = op[2], op[3], op[4]
      f.compute = f.compute + 2 * m * k * n / M.gemm_rate(hw, m, k, n, t) + over
      b.compute = b.compute + 2 * m * k * n / M.gemm_rate(hw, m, n, k, t)
        + 2 * m * k * n / M.gemm_rate(hw, n, m, k, t) + 2 * over
    elseif kind == "ew" then
      local name, bytes = op[2], op[3]
      f.compute = f.compute + bytes / M.elementwise_rate(hw, name, bytes, t) + over
      b.compute = b.compute + bytes / M.elementwise_rate(hw, name, bytes, t, true) + over
    elseif kind == "attn" then
      local q = op[2]
      local flops = 4 * q.batch * q.seq * q.seq * q.heads * q.head_dim
      f.compute = f.compute + flops / M.attention_rate(hw, q, t) + over
      b.compute = b.compute + flops / M.attention_rate(hw, q, t, true) + over
    elseif kind == "allreduce" then
      local c = M.collective(hw, "all_reduce", T, op[2], R)
      f.tp, b.tp = f.tp + c, b.tp + c
    elseif kind == "sp_gather" then -- backward: the input gradient reduce-scattered, the input gathered again
      local ag, rs = M.collective(hw, "all_gather", T, op[2], R), M.collective(hw, "reduce_scatter", T, op[2], R)
      f.tp, b.tp = f.tp + ag, b.tp + rs + ag
    elseif kind == "sp_scatter" then -- backward: the output gradient gathered
      f.tp = f.tp + M.collective(hw, "reduce_scatter", T, op[2], R)
      b.tp = b.tp + M.collective(hw, "all_gather", T, op[2], R)
    end
  end
  return f, b
end

-- Time-sharing of the cores: everything a rank computes takes 1/share longer.
local function shared(x, share)
  return { compute = x.compute / share, tp = x.tp }
end

--- Per-layer costs { fwd = {compute, tp}, bwd = {compute, tp} } of one micro-batch.
function M.layer_costs(s, L, hw, R)
  local t, share = M.threads(hw, R)
  local f, b = price(hw, layer_ops(s, L, L.seq * L.b), t, R, L.t)
  if L.recompute == "full" then
    b.compute, b.tp = b.compute + f.compute, b.tp + f.tp
  end
  return { fwd = shared(f, share), bwd = shared(b, share) }
end

--- Embedding and head (+ final norm and loss) costs of one micro-batch.
function M.edge_costs(s, L, hw, R)
  local t, share = M.threads(hw, R)
  local r, h, T = L.seq * L.b, s.hidden, L.t
  local V = math.ceil(s.vocab / T)
  local sp = sp_of(L)
  local ef, eb = price(hw, { { "ew", "residual", 3 * r * h * F32 } }, t, R, T)
  if T > 1 then -- vocabulary-parallel lookup: the output is all-reduced (sequence parallelism: reduce-scattered)
    local c = { { sp and "sp_scatter" or "allreduce", r * h * F32 } }
    local cf, cb = price(hw, c, t, R, T)
    ef.tp, eb.tp = ef.tp + cf.tp, eb.tp + (sp and cb.tp or 0)
  end
  -- ln_f, the logits product, cross-entropy over r*V/T logits (max, sum of
  -- exponentials, the gradient written in place)
  local norm = s.norm
  local hf, hb = price(hw, { { "ew", norm, 2 * (sp and r / T or r) * h * F32 }, { "gemm", r, h, V },
    { "ew", norm, 3 * r * V * F32 } }, t, R, T)
  if sp then -- the head's input rows gathered (backward: reduce-scattered, and gathered again)
    local cf, cb = price(hw, { { "sp_gather", r * h * F32 } }, t, R, T)
    hf.tp, hb.tp = hf.tp + cf.tp, hb.tp + cb.tp
  elseif T > 1 then
    hb.tp = hb.tp + M.collective(hw, "all_reduce", T, r * h * F32, R)
  end
  return { fwd = shared(ef, share), bwd = shared(eb, share) }, { fwd = shared(hf, share), bwd = shared(hb, share) }
end

--- Stage costs in cost.stage_costs's shape, for the CPU engine.
function M.stage_costs(s, L, hw, parts, stage_params)
  local N = L.t * L.p * L.d
  local R = math.min(N, hw.gpus_per_node)
  local t, share = M.threads(hw, R)
  local layer = M.layer_costs(s, L, hw, R)
  local embed, head = M.edge_costs(s, L, hw, R)
  local act = L.seq * L.b * s.hidden * F32 / (sp_of(L) and L.t or 1) -- sequence parallelism: this rank's rows
  local p2p = hw.cpu.p2p
  local send = (p2p.latency + act / p2p.bandwidth) * math.max(1, R / hw.cpu.cores) / math.max(1, 2 / hw.cpu.cores)
  local out = {}
  for i, part in ipairs(parts) do
    -- cost.lua is loaded already: it calls this function
    local c = require("pipegoose.plan.cost").stage_compute(part, layer, embed, head)
    if i < L.p then c.send_act = send end
    if i > 1 then c.send_grad = send end
    local params = stage_params(s, part, L.t, L.p)
    c.params = params
    local grads = params * F32
    -- ZeRO-1's reduce-scatter plus parameter all-gather move what the
    -- all-reduce moves: priced as one (only the all-reduce is calibrated)
    c.dp = M.collective(hw, "shm_all_reduce", L.d, grads, R)
    local _, hd = models.edge_params(s)
    if hd.tied and L.p > 1 and (part.first or part.last) then
      c.dp = c.dp + M.collective(hw, "all_reduce", 2, hd.split / L.t * F32, R)
    end
    local updated = L.zero >= 1 and params / L.d or params
    -- AdamW, and zero_grad's one write of the gradients (at the residual add's rate)
    c.optimizer = (updated * 28 / by_threads(hw.cpu.adamw, t)
      + params * F32 / M.elementwise_rate(hw, "residual", params * F32, t)) / share + hw.cpu.step_overhead
    out[i] = c
  end
  return out
end

---------------------------------------------------------------- memory
--
-- What engine:memory() counts, in closed form (fp32, 4 bytes a float), for a
-- rank of a stage with r = b*s rows per micro-batch, tensor size T:
--   per micro-batch in flight ("slot"), every module keeps its output
--   (src/nn/pg_module.c, alloc_leaf) and what its backward needs:
--     GPT layer   residual outputs 2 x h, norm outputs 2 x h and their mean
--                 and 1/std (2 x 2 floats a row), attention and MLP output
--                 projections 2 x h (full width after the all-reduce);
--                 q|k|v 3h/T, attention output h/T, fc and GeLU outputs
--                 2 x ffn/T; the flash attention's log-sum-exp heads/T a
--                 row (no [S, S] probabilities: linear in the rows)
--     LLaMA layer the same with RMSNorm (1 float a row each), q|k|v
--                 (h + 2kv)/T plus its rotated copy (h + 2kv)/T, gate|up
--                 2ffn/T and SwiGLU ffn/T
--     first stage the embedding output h
--     other stages the received activation h (the pipeline's input slot)
--     last stage  the final norm (h + its statistics) and the loss head's 3
--                 statistics a row (max, sum of exponentials, target logit)
--   full recomputation keeps each block's output h per slot, and the rank
--   keeps one micro-batch of one block's inside (fixed_activation_bytes: the
--   rank's blocks share the buffers, as backward recomputes one at a time);
--   selective keeps one micro-batch of one layer's log-sum-exp.
--   Sequence parallelism (L.sp, T > 1): everything counted at full width h
--   above (residual, norm and projection outputs, the norms' statistics, the
--   embedding output or received activation, a recomputed block's output,
--   the final norm) is kept for r/T rows; the loss head's 3 statistics stay
--   per row of the micro-batch.
-- Parameters and gradients: 4 bytes each (the flat buffers, padded to a
-- multiple of D; ZeRO-2 does not shard them yet); AdamW: m and v, 8 bytes (/ D with ZeRO-1 and 2).

--- Activation floats per row of one layer: slot part and, with recompute,
-- fixed part. sp: sequence parallelism (the full-width part kept for 1/T of the rows).
function M.layer_floats(s, T, recompute, sp)
  local h, kv = s.hidden, models.kv_dim(s)
  local heads = s.heads // T
  local rep = (sp and T > 1) and T or 1
  -- q|k|v (and its rotated copy with rotary embeddings), the attention's
  -- output, the MLP's inputs and outputs split by T (gate|up and SwiGLU, or fc
  -- and GeLU); two norms' statistics
  local full = 6 * h
  local split = (s.rope and 2 or 1) * (h + 2 * kv) // T + h // T + (s.gated_mlp and 3 or 2) * s.ffn // T
  local stats = 2 * models.norm_stats(s)
  full, stats = full / rep, stats / rep
  local lse = heads -- the flash attention keeps one float per row and head, whatever S
  local all = full + split + stats + lse
  if recompute == "full" then return h / rep, all end
  if recompute == "selective" then return all - lse, lse end
  return all, 0
end

--- engine:memory()'s parts for a rank of `stage` ({ layers, first, last })
-- under layout L with `in_flight` micro-batches: bytes of params, grads,
-- optimizer, activations (peak), and total.
function M.stage_bytes(s, L, stage, in_flight, stage_params)
  local r = L.seq * L.b
  local h = s.hidden
  local slot_f, fixed_f = M.layer_floats(s, L.t, L.recompute, L.sp)
  local rep = sp_of(L) and L.t or 1
  local per_slot = stage.layers * slot_f + h / rep -- + the embedding output or the received activation
  if stage.last then per_slot = per_slot + (h + models.norm_stats(s)) / rep + 3 end
  -- the recomputed blocks (or attentions) of the rank share one micro-batch of buffers
  local fixed = stage.layers > 0 and fixed_f or 0
  local activations = (per_slot * in_flight + fixed) * r * F32
  local params = stage_params(s, stage, L.t, L.p)
  local opt = params * 8 / (L.zero >= 1 and L.d or 1)
  local parts = { weights = params * F32, gradients = memory.gradient_bytes(s, L, stage, params, F32), optimizer = opt,
    activations = activations,
    transient = 0, params = params }
  parts.total = parts.weights + parts.gradients + parts.optimizer + parts.activations
  return parts.total, parts
end

return M
