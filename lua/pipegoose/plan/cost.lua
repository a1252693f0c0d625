--- pipegoose.plan.cost: seconds per pipeline action, from a hardware description.
--
-- The simulator asks three things of a layout: how long a stage's forward and
-- backward of one micro-batch take (split into compute and tensor-parallel
-- communication), how long an activation or gradient takes to reach the next
-- stage, and what a step adds after the pipeline drains (data-parallel
-- gradient reduction, the optimizer). Everything here reads the hardware only
-- through `hw` (see hardware.lua), so a measured profile replaces a datasheet
-- without changes here.
--
-- Costs, per layer and micro-batch of b sequences of s tokens:
--   matrix products  FLOPs / (peak FLOP/s * M.gemm_efficiency(rows)). Forward
--                    FLOPs are models.layer_gemm_flops / T; backward is twice
--                    the forward (gradients of inputs and of weights). The
--                    efficiency falls as the product's rows (b*s/C tokens)
--                    shrink: see M.gemm_efficiency. The attention core's
--                    two products (scores, values) use the same curve at
--                    their own rows (s/2 at C = 1, s/(2C) in the ring).
--                    Under C > 1 each later block adds an online-softmax
--                    merge (memory-bound) and its kernels.
--   memory-bound ops bytes moved / (HBM bandwidth * memory_efficiency):
--                    norms, residual adds, dropout, activation functions,
--                    rotary embedding and, unless attention is fused, the
--                    softmax over the a*s*s scores. Backward moves twice the
--                    forward's bytes.
--   tensor parallel  Megatron's layer needs 2 all-reduces of the b*s*h
--                    activation in the forward pass and 2 in the backward
--                    (sequence parallelism swaps each for an all-gather and a
--                    reduce-scatter: the same bytes on the wire). Ring cost:
--                    2(T-1)/T * bytes / bandwidth + 2(T-1) * latency, at
--                    intra-node bandwidth (T stays within a node). Not
--                    overlapped with compute. With fewer key/value heads
--                    than T, an all-gather of every head's k|v (b*s*2*kv
--                    elements) forward and its reduce-scatter backward.
--   kernel overhead  hw.kernel_overhead per kernel launched (small layers)
--   recomputation    full: the backward first repeats the whole forward
--                    (its products, memory traffic and its 2 all-reduces);
--                    selective: it repeats the attention scores only.
-- Pipeline transfers carry the b*s*h activation (or its gradient). With T > 1
-- each of the T ranks sends its 1/T share over its own link (sequence
-- parallelism shards it already; without it, Megatron's scatter/gather does
-- the same), so a transfer is latency + b*s*h*e/T / bandwidth, intra-node or
-- inter-node depending on where the two stages' ranks live.
--   context (C)      ring attention (Megatron-LM's context parallelism, Liu et
--                    al. 2023's ring): each rank holds seq/C tokens of every
--                    sequence, so every per-token cost above is /C while the
--                    attention FLOPs per token stay those of the whole
--                    sequence (its queries meet every key). Per layer and
--                    micro-batch the forward passes this rank's K/V block
--                    round the ring, C-1 steps of b*(seq/C)*2*kv/T elements
--                    (M.context_ring); the backward passes K/V again and
--                    dK/dV back: twice those bytes (2 messages a step). Each
--                    step's transfer overlaps the attention compute of the
--                    block in hand, 1/C of the rank's attention core, so per
--                    step max(0, transfer - block attention) is exposed,
--                    plus every message's link latency (the send/receive
--                    handshake the next block waits on; never hidden). At
--                    short sequences the block's s/C x s/C attention is too
--                    short to hide its (s/C)-row K/V transfer. The ring's
--                    hops are point to point: NVLink while T*C fits in a
--                    node, else the inter-node link (the slowest hop paces
--                    the ring). (M.context_ring, M.context_exposed)
--   ZeRO-3 (FSDP)    per micro-batch: the stage's parameters all-gathered in
--                    the forward and again in the backward (resharded after
--                    the forward), in the compute precision, and the
--                    gradients reduce-scattered in the gradient's precision
--                    (fp32, as the ZeRO-1/2 reduction): 2w + g bytes per
--                    parameter, each a ring over the D*C group ((n-1)/n of
--                    the buffer per rank). Gathered one unit (block,
--                    embedding, head) at a time with the next prefetched on
--                    the communication stream: assumed to overlap compute
--                    fully (no slowdown of the kernels), so what is exposed is
--                    the first unit's gather and, per later unit, what its
--                    communication exceeds the unit's compute (M.zero3_exposed).
--                    The step adds no reduction after the pipeline; the
--                    optimizer runs on the 1/(D*C) shard.
-- Collectives over a group that spans nodes (M.group_link): NCCL runs one
-- ring channel per NIC, and the k ranks of the group on one node each drive
-- their own NIC (one per GPU), so the group's inter-node bandwidth is k
-- links (at most the NVLink rate the ring also crosses). A Megatron data
-- group at T = 8 has k = 1 (one rank per node); a pure-data FSDP group has
-- k = 8. (Pricing every such ring at one GPU's link made a 64-GPU FSDP step
-- 8x more communication-bound than the hardware is.)
-- Rank placement is pipegoose's (src/parallel/pg_context.c), which is also Megatron's:
-- rank = t + T*(c + C*(d + D*p)) (tensor fastest, then context, then data,
-- then pipeline: Megatron's tp-cp-dp-pp), nodes of gpus_per_node consecutive
-- ranks. The data x context group (gradients, ZeRO) is every rank of a stage
-- with the same t: stride T, D*C long.
local models = require "pipegoose.plan.models"
local memory = require "pipegoose.plan.memory"

local M = {}

-- The one efficiency constant the planner states: the share of the dense
-- peak a large bf16/tf32 matrix product reaches in cuBLAS. NVIDIA's and
-- others' published GEMM measurements on A100 and H100 for the large square-ish
-- shapes of billion-parameter layers land at 70-80% of the datasheet peak;
-- the middle of that range. Not fitted to the comparison in docs/PLANNER.md.
M.DEFAULTS = {
  gemm_efficiency = 0.75,
  -- pipegoose's attention is flash attention on every backend (kernels.h: no [s, s] scores kept or moved);
  -- false plans an unfused core whose softmax over s x s scores goes through memory (Megatron-LM's 2021 runs)
  flash_attention = true,
  -- false: the gradient reduction after the last backward (exposed), as the device backend does; true: it
  -- overlaps the last micro-batch's backward, max(0, dp - bwd) exposed (overlap_grad_reduce over MPI)
  dp_overlap = false,
}

--- The share of peak FLOP/s a matrix product of `rows` rows reaches (rows:
-- the tokens of the micro-batch on this rank, b*s/C; the weights are the
-- other operand). The stated constant (hw.gemm_efficiency or
-- o.gemm_efficiency, what a large square product reaches) is the rate of the
-- math; on top of it the product streams its weight operand (K*N elements)
-- from HBM once, which its math hides less the fewer rows share each weight
-- element: a product of 2*rows*K*N FLOPs reads K*N*e bytes, an arithmetic
-- intensity of 2*rows/e FLOPs a byte (NVIDIA's "Matrix Multiplication
-- Background User's Guide", section "Math and memory bounds": intensity
-- ~ rows for a thin bf16 product, memory-bound below the GPU's FLOP/byte
-- ratio). Adding the two times instead of taking their maximum (the roofline's
-- corner rounded, a product's operand fetch only partly overlapped with its
-- math) gives
--   efficiency(rows) = e / (1 + rows0 / rows),
--   rows0 = peak * e * element_bytes / (2 * HBM bandwidth * memory_efficiency),
-- 143 rows for bf16 on A100 (7% below the constant at 2048 rows, 22% at 512),
-- a curve from the datasheet only: nothing fitted to docs/PLANNER.md's
-- comparisons.
function M.gemm_efficiency(hw, o, precision, rows)
  local e = hw.gemm_efficiency or o.gemm_efficiency
  local f = hw.peak_flops[precision]
  if not f or not rows or rows <= 0 then return e end
  local rows0 = f * e * memory.element_bytes(precision) / (2 * hw.memory_bandwidth * hw.memory_efficiency)
  return e / (1 + rows0 / rows)
end

local function ring(bytes, n, link, eff, factor)
  if n <= 1 or bytes == 0 then return 0 end
  return factor * (n - 1) / n * bytes / (link.bandwidth * eff) + factor * (n - 1) * link.latency
end
M.ring_all_reduce = function(bytes, n, link, eff) return ring(bytes, n, link, eff, 2) end
-- all-gather and reduce-scatter: half an all-reduce (bytes: the full buffer)
M.ring_gather = function(bytes, n, link, eff) return ring(bytes, n, link, eff, 1) end

--- Whether the transfer from stage p to p+1 (0-based) crosses a node for some
-- (t, d): the ranks T*D*p + x and T*D*(p+1) + x, x in [0, T*D) (D here: the
-- D*C ranks of a stage's data x context group).
function M.pipeline_crosses_node(T, D, G, p)
  local TD = T * D
  if TD >= G then return true end
  local lo, hi = TD * p + 1, TD * (p + 2) - 1
  return (hi // G) * G >= lo
end

--- Whether stage p's data-parallel group (ranks t + T*(d + D*p), d in [0, D);
-- D here: D*C, the data x context group) spans more than one node.
function M.data_group_crosses_node(T, D, G, p)
  if D <= 1 then return false end
  for _, t in ipairs{ 0, T - 1 } do
    local first = t + T * D * p
    local last = first + T * (D - 1)
    if first // G ~= last // G then return true end
  end
  return false
end

--- The link a ring over a stride-T group of n ranks (data x context) runs at,
-- for stage p: NVLink inside a node; across nodes, one inter-node link per
-- member of the group on a node (NCCL's one channel per NIC), capped by NVLink.
function M.group_link(hw, T, n, G, p)
  if not M.data_group_crosses_node(T, n, G, p) then return hw.intra end
  local per_node = math.max(1, math.min(n, G // T))
  return { bandwidth = math.min(per_node * hw.inter.bandwidth, hw.intra.bandwidth), latency = hw.inter.latency }
end

--- One step of the context-parallel ring for a layer and micro-batch: the
-- bytes of this rank's K/V block, the transfer's seconds and the link's
-- latency per message (C - 1 steps a pass; forward 1 message a step,
-- backward 2: K/V again and dK/dV back). nil when C = 1.
function M.context_ring(s, L, hw)
  local C = L.c or 1
  if C <= 1 then return nil end
  local e = memory.element_bytes(L.precision)
  -- K and V of this rank's kv heads (a whole head each when T exceeds the kv heads, kind_kv_heads.c)
  local kv = L.t > (s.kv_heads or s.heads) and models.head_dim(s) or models.kv_dim(s) / L.t
  local block = L.b * L.seq / C * 2 * kv * e
  local link = L.t * C > hw.gpus_per_node and hw.inter or hw.intra
  return { steps = C - 1, bytes = block, transfer = block / (link.bandwidth * hw.link_efficiency),
    latency = link.latency }
end

--- Exposed seconds of the ring's forward and backward passes, given the
-- rank's attention-core seconds `attn` of one layer's forward (all C blocks;
-- the backward's is twice): per step, the transfer beyond the block's
-- attention (attn / C) plus each message's latency.
function M.context_exposed(r, attn, C)
  if not r then return 0, 0 end
  local block = attn / C
  local fwd = r.steps * (r.latency + math.max(0, r.transfer - block))
  local bwd = r.steps * (2 * r.latency + math.max(0, 2 * r.transfer - 2 * block))
  return fwd, bwd
end

local function peak(hw, precision)
  local f = hw.peak_flops[precision]
  if not f then
    error(("plan: %s has no %s FLOP/s"):format(hw.name or "hardware", precision), 0)
  end
  return f
end

--- Per-layer costs of one micro-batch: { fwd = {compute=, tp=}, bwd = {compute=, tp=} }.
-- L: the layout (t, b, seq, precision, recompute, sp, flash_attention); o: options.
function M.layer_costs(s, L, hw, o)
  local e = memory.element_bytes(L.precision)
  local bw = hw.memory_bandwidth * hw.memory_efficiency
  local C = L.c or 1
  -- this rank's tokens: its two chunks of each sequence under context parallelism
  local T, seq, tokens, h = L.t, L.seq, L.seq * L.b / C, s.hidden
  local rep = L.sp and T or 1 -- replicated elementwise work is split by sequence parallelism
  local fused = L.flash_attention
  -- the weight products have `tokens` rows (sequence parallelism gathers them back first)
  local weights_rate = peak(hw, L.precision) * M.gemm_efficiency(hw, o, L.precision, tokens)

  local gemm = tokens * models.layer_gemm_flops(s, seq) / T / weights_rate
  -- the attention core's products: this rank's queries (b*s/C rows) against one block of keys at a time
  -- (the ring's s/C, or the whole s at C = 1); intensity 2*q*k/(e*(q+k)) FLOPs a byte per head, so
  -- M.gemm_efficiency's rows are q*k/(q+k) per sequence (s/2 at C = 1, s/(2C) in the ring)
  local attn_rate = peak(hw, L.precision) * M.gemm_efficiency(hw, o, L.precision, seq / C / 2)
  local scores_gemm = tokens * 4 * seq * h / T / attn_rate

  -- elements moved by the forward's memory-bound ops (each e bytes)
  local kv = models.kv_dim(s)
  local elems = tokens * h * (4 + 6) / rep -- two norms (read, write), two residual adds (2 reads, 1 write)
  local act_width = s.top_k * s.ffn / T
  local scores = 0
  if s.dropout then elems = elems + tokens * h * 4 / rep end -- two dropouts (read, write)
  if s.gated_mlp then
    elems = elems + tokens * act_width * 3 -- SwiGLU (two reads, one write)
  else
    elems = elems + tokens * act_width * 2 -- bias + GeLU (read, write)
  end
  if s.rope then elems = elems + tokens * (h + kv) / T * 2 end -- rotary embedding on q and k
  if not fused then -- softmax (GPT's: scale-mask-softmax and its dropout)
    scores = s.heads * tokens * seq / T * (s.dropout and 4 or 2)
  end
  local mem_f = (elems + scores) * e / bw
  -- the online-softmax merge after each ring step: the forward reads the running fp32 output and the
  -- block's and writes the merged (3 passes over tokens*h/T fp32); the backward adds the block's dQ into the
  -- fp32 accumulator (read, write) and the arriving dK/dV into theirs (read, write of tokens*2*kv/T)
  local merge_f = (C - 1) * 3 * tokens * h / T * 4 / bw
  local merge_b = (C - 1) * (2 * tokens * h / T + 2 * tokens * 2 * kv / T) * 4 / bw
  local scores_mem = scores * e / bw

  -- kernels a layer's forward launches: norms, the matrix products, the
  -- elementwise ops (13 for a GPT layer with unfused attention, of which 4 in
  -- the attention core; a fused attention is 1 kernel); backward twice as many
  local core_kernels = fused and 1 or 4
  -- the ring runs the attention core once per block and merges each later block's partial output into the
  -- running one (online softmax): one merge kernel a step
  local ring_kernels = (C - 1) * (core_kernels + 1)
  core_kernels = core_kernels + ring_kernels
  local kernels = 9 + core_kernels
  local launch = hw.kernel_overhead or 0

  local ar = M.ring_all_reduce(tokens * h * e, T, hw.intra, hw.link_efficiency)
  -- the context ring, overlapped with the attention core's compute (scores and values products)
  local cp_f, cp_b = M.context_exposed(M.context_ring(s, L, hw), scores_gemm + scores_mem, C)
  local fwd = { compute = gemm + mem_f + merge_f + kernels * launch, tp = 2 * ar, cp = cp_f }
  local bwd = { compute = 2 * (gemm + mem_f + kernels * launch) + merge_b, tp = 2 * ar, cp = cp_b }
  if T > (s.kv_heads or s.heads) then -- fewer key/value heads than ranks (kind_kv_heads.c): every head's k|v all-gathered
    local kv_gather = ring(tokens * 2 * kv * e, T, hw.intra, hw.link_efficiency, 1) -- forward, reduce-scattered back
    fwd.tp, bwd.tp = fwd.tp + kv_gather, bwd.tp + kv_gather
  end
  if L.recompute == "full" then
    bwd.compute = bwd.compute + fwd.compute
    bwd.tp = bwd.tp + fwd.tp
    bwd.cp = bwd.cp + fwd.cp
  elseif L.recompute == "selective" then
    bwd.compute = bwd.compute + scores_gemm + scores_mem + merge_f + core_kernels * launch
  end
  return { fwd = fwd, bwd = bwd }
end

--- Embedding (first stage) and head + loss (last stage) costs of one micro-batch.
function M.edge_costs(s, L, hw, o)
  local e = memory.element_bytes(L.precision)
  local bw = hw.memory_bandwidth * hw.memory_efficiency
  local T, tokens, h = L.t, L.seq * L.b / (L.c or 1), s.hidden
  local flops_rate = peak(hw, L.precision) * M.gemm_efficiency(hw, o, L.precision, tokens)
  local ar = M.ring_all_reduce(tokens * h * e, T, hw.intra, hw.link_efficiency)
  -- embedding: gather rows (write b*s*h), add positions; backward scatters
  -- the gradient back; vocabulary-parallel lookup all-reduces its output
  local embed = {
    fwd = { compute = tokens * h * 3 * e / bw, tp = ar },
    bwd = { compute = tokens * h * 3 * e / bw, tp = 0 },
  }
  -- head: final norm, the logits product, cross-entropy over b*s*V/T logits
  -- in fp32 (forward: read, exp-sum, write the softmax; backward: read, write)
  local logits = tokens * s.vocab / T
  local head_gemm = tokens * models.head_flops(s) / T / flops_rate
  local head = {
    fwd = { compute = head_gemm + tokens * h * 2 * e / bw + logits * (e + 4 * 2) / bw, tp = 0 },
    bwd = { compute = 2 * head_gemm + tokens * h * 4 * e / bw + logits * (4 + e) / bw, tp = ar },
  }
  return embed, head
end

--- A stage's compute per micro-batch from its parts' costs (layer, embedding,
-- head: {fwd = {compute, tp}, bwd = {compute, tp}}): forward and backward
-- totals, their tensor-parallel shares, and the last layer's backward (what
-- an overlapped data-parallel reduction can hide behind). Shared by the GPU
-- path here and the CPU path (cpu.lua).
-- `plain` (optional): the costs of a layer that is not recomputed, for the
-- `n_plain` layers of the stage that keep their activations under
-- L.recompute_every > 1 (memory.recomputed_layers).
function M.stage_compute(part, layer, embed, head, plain, n_plain)
  local c = { fwd = 0, bwd = 0, fwd_tp = 0, bwd_tp = 0, fwd_cp = 0, bwd_cp = 0 }
  local function add(x, n)
    local fcp, bcp = x.fwd.cp or 0, x.bwd.cp or 0
    c.fwd = c.fwd + n * (x.fwd.compute + x.fwd.tp + fcp)
    c.bwd = c.bwd + n * (x.bwd.compute + x.bwd.tp + bcp)
    c.fwd_tp = c.fwd_tp + n * x.fwd.tp
    c.bwd_tp = c.bwd_tp + n * x.bwd.tp
    c.fwd_cp = c.fwd_cp + n * fcp
    c.bwd_cp = c.bwd_cp + n * bcp
  end
  n_plain = plain and n_plain or 0
  add(layer, part.layers - n_plain)
  if n_plain > 0 then add(plain, n_plain) end
  if part.first then add(embed, 1) end
  if part.last then add(head, 1) end
  c.last_bwd_layer = layer.bwd.compute + layer.bwd.tp + (layer.bwd.cp or 0)
  return c
end

--- ZeRO-3's exposed communication of one pass over a stage of `units`
-- gathered units: `comm` seconds of communication against `busy` seconds of
-- compute, a unit's communication running under the previous unit's compute
-- (one-ahead prefetch; units taken as equal): the first unit's share cannot
-- hide, each later one hides up to one unit's compute, and `tail` (the last
-- unit's reduce-scatter, backward) runs after the last compute.
function M.zero3_exposed(comm, busy, units, tail)
  local u, cu = comm / units, busy / units
  return u + (units - 1) * math.max(0, u - cu) + (tail or 0)
end

--- Everything the simulator and the step need for one layout:
-- stages[i] = { fwd, bwd (seconds, busy), fwd_tp, bwd_tp (of which TP comm),
--   send_act, send_grad (transfer seconds to the next / previous stage),
--   dp (gradient reduction seconds), dp_overlap_window, optimizer (seconds),
--   params (held by a rank) }
-- `parts`: the stages' layer counts and edges ({ layers =, first =, last = }).
function M.stage_costs(s, L, hw, o, parts)
  -- a calibrated CPU profile prices pipegoose's own CPU engine op by op
  if hw.cpu then return require("pipegoose.plan.cpu").stage_costs(s, L, hw, parts, memory.stage_params) end
  local layer = M.layer_costs(s, L, hw, o)
  local plain -- a layer without recomputation, when only every k-th is recomputed
  if L.recompute == "full" and (L.recompute_every or 1) > 1 then
    local Lp = {}
    for k, v in pairs(L) do Lp[k] = v end
    Lp.recompute = "none"
    plain = M.layer_costs(s, Lp, hw, o)
  end
  local embed, head = M.edge_costs(s, L, hw, o)
  local e = memory.element_bytes(L.precision)
  local G = hw.gpus_per_node
  local DC = memory.shard_group(L) -- the data x context group
  local act_bytes = L.seq * L.b / (L.c or 1) * s.hidden * e / L.t
  local _, grad_b = memory.state_bytes(L.precision)
  local weight_b = memory.state_bytes(L.precision)
  -- AdamW reads the gradient, reads and writes m, v and the fp32 weights (or
  -- master copy) and, for bf16, writes the bf16 weights: bytes per parameter
  local opt_bytes = L.precision == "bf16" and (4 + 8 + 8 + 8 + 2) or (4 + 8 + 8 + 8)
  local out = {}
  for i, part in ipairs(parts) do
    local p = i - 1
    local c = M.stage_compute(part, layer, embed, head, plain, part.layers - memory.recomputed_layers(L, part.layers))
    -- transfers out of this stage
    local function link(crosses) return crosses and hw.inter or hw.intra end
    if p < L.p - 1 then
      local l = link(M.pipeline_crosses_node(L.t, DC, G, p))
      c.send_act = l.latency + act_bytes / (l.bandwidth * hw.link_efficiency)
    end
    if p > 0 then
      local l = link(M.pipeline_crosses_node(L.t, DC, G, p - 1))
      c.send_grad = l.latency + act_bytes / (l.bandwidth * hw.link_efficiency)
    end
    -- data-parallel gradient reduction and the optimizer
    local params = memory.stage_params(s, part, L.t, L.p)
    c.params = params
    local dlink = M.group_link(hw, L.t, DC, G, p)
    local grads = params * grad_b
    c.fwd_zero3, c.bwd_zero3 = 0, 0
    if L.zero == 3 then
      -- per micro-batch: gather (forward), gather + reduce-scatter (backward), overlapped (M.zero3_exposed)
      local units = part.layers + (part.first and 1 or 0) + (part.last and 1 or 0)
      local gather = M.ring_gather(params * weight_b, DC, dlink, hw.link_efficiency)
      local scatter = M.ring_gather(grads, DC, dlink, hw.link_efficiency)
      c.fwd_zero3 = M.zero3_exposed(gather, c.fwd, units)
      c.bwd_zero3 = M.zero3_exposed(gather + scatter, c.bwd, units, scatter / units)
      c.fwd, c.bwd = c.fwd + c.fwd_zero3, c.bwd + c.bwd_zero3
      -- bytes each rank sends per step (the ring's (n-1)/n of each buffer): the theory a measurement compares with
      c.zero3_bytes = L.m * (2 * weight_b + grad_b) * params * (DC - 1) / DC
      c.dp = 0
      c.optimizer = params / DC * opt_bytes / (hw.memory_bandwidth * hw.memory_efficiency)
    elseif L.zero >= 1 then
      -- reduce-scatter the gradients (ZeRO-2: after every micro-batch's backward, since only the shard
      -- accumulates), step on 1/D, all-gather the new weights
      c.dp = (L.zero == 2 and L.m or 1) * M.ring_gather(grads, DC, dlink, hw.link_efficiency)
        + M.ring_gather(params * weight_b, DC, dlink, hw.link_efficiency)
      c.optimizer = params / DC * opt_bytes / (hw.memory_bandwidth * hw.memory_efficiency)
    else
      c.dp = M.ring_all_reduce(grads, DC, dlink, hw.link_efficiency)
      c.optimizer = params * opt_bytes / (hw.memory_bandwidth * hw.memory_efficiency)
    end
    -- a tied embedding: the first and last stages all-reduce its gradient
    -- (across the pipeline, so across nodes unless P*T*D fits in one)
    local _, hd = models.edge_params(s)
    if hd.tied and L.p > 1 and (part.first or part.last) then
      local cross = L.t * DC * L.p > G
      c.dp = c.dp + M.ring_all_reduce(hd.split / L.t * grad_b, 2, cross and hw.inter or hw.intra, hw.link_efficiency)
    end
    out[i] = c
  end
  return out
end

return M
