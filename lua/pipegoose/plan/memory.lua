--- pipegoose.plan.memory: bytes one rank holds at its peak, in closed form.
--
-- For a rank of pipeline stage i (layers and edges of that stage, split T
-- ways by tensor parallelism):
--
--   total = weights + gradients + optimizer state + activations (+ transient logits)
--
-- Weights, gradients, optimizer state, per parameter held by the rank
-- (matrices / T, norms and row-parallel biases whole):
--   bf16: weight 2 bytes; gradient 4 (accumulated and all-reduced in fp32, as
--         Megatron-LM does for bf16, since bf16 sums lose small updates);
--         optimizer 12 = fp32 master copy 4 + AdamW m 4 + v 4.
--   fp32 (and tf32: fp32 storage): weight 4, gradient 4, optimizer 8 (m, v).
--   ZeRO-1 shards the optimizer state over the D x C data x context group
--   (M.shard_group: gradients are summed over data and context together, as
--   Megatron-LM's dp-cp group): optimizer / (D*C). (bf16 without ZeRO: 18 bytes
--   per parameter; with: 6 + 12/(D*C).)
--   ZeRO-3 (FSDP) shards everything persistent over that group: the fp32
--   master (the weight itself under fp32), its fp32 gradient and AdamW's m, v:
--   16 bytes x params / (D*C) in both precisions (bf16: 4 + 4 + 8; fp32: 4 +
--   4 + 8). What is not sharded: the gathered unit (M.gathered_unit_params:
--   the largest module gathered at once, one transformer block or the
--   embedding or the head) in the compute precision, twice (the unit running
--   and the next one prefetched, FSDP2's one-ahead prefetch), and that unit's
--   full gradient before it is reduce-scattered (g bytes, once). Parameters
--   are assumed resharded after the forward (FSDP2's reshard_after_forward =
--   true), so nothing else stays gathered (M.zero3_bytes).
--
-- Activations kept for the backward pass, per layer and micro-batch
-- (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
-- Transformer Models", section 4): with s tokens, micro-batch b, width h, a
-- heads and 16-bit tensors, one layer keeps
--     s*b*h*34 + 5*a*s^2*b bytes              (T = 1)
--     s*b*h*(10 + 24/T) + 5*a*s^2*b/T         (tensor parallel, Megatron split)
--     (s*b*h*34 + 5*a*s^2*b) / T              (with sequence parallelism)
-- Where the numbers come from, per token (unit s*b*h elements, e bytes each):
--   replicated under tensor parallelism (split by T with sequence parallelism):
--     two norm inputs (2), attention input (1), MLP input (1)       -> 4 e
--     two dropout masks (1 byte each)                                -> 2
--   split by T:
--     Q and K (2), V (1), attention output projection input (1),
--     MLP activation input (4), second MLP matrix input (4)          -> 12 e
--   attention scores (unit a*s^2*b, split by T): softmax output e,
--     its dropout mask 1 byte, the dropout output e                  -> 2e + 1
--   With e = 2: 4*2 + 2 = 10, 12*2 = 24, 2*2 + 1 = 5: the paper's figures.
-- This module writes the same sums for any shape, so that fp32 (e = 4, our
-- CPU path), grouped-query attention (K, V are kv_heads*head_dim wide), a
-- SwiGLU MLP (two activation inputs of width ffn) and no dropout (Llama) follow
-- from the same derivation instead of the GPT-3-only constants. A mixture of
-- experts keeps the MLP activations of top_k experts per token.
--   selective recomputation recomputes the attention scores: drop the a*s^2 term
--   (a fused "flash" attention never stores them either).
--   full recomputation keeps only each layer's input: s*b*h*e (/T with
--   sequence parallelism), plus, once, the full activations of the one layer
--   being recomputed in the backward pass. With L.recompute_every = k > 1
--   (torchtitan's "selective layer" checkpointing: every k-th block; a
--   planner-only option, pinned for the published comparison) only
--   floor(layers/k) of a stage's layers keep just their input
--   (M.recomputed_layers), the others everything.
-- Context parallelism over C ranks splits every sequence into 2C chunks, two
-- per rank (pg.ParallelContext{context = C}): each rank keeps the activations
-- of seq/C tokens of every layer, attention included (its queries against the
-- K/V blocks the ring brings: the a*s^2 score term is a*(s/C)*s). Everything
-- above is divided by C (M.layer_activation_bytes with o.c; the logits too).
-- A stage holds them for every micro-batch between its forward and backward:
-- counted from its schedule's action list (1F1B: min(P - i, M) for stage i,
-- 0-based; GPipe: M).
-- The last stage also holds one micro-batch's logits while the loss runs:
-- s*b*V/T elements in the compute precision plus their fp32 softmax.
local models = require "pipegoose.plan.models"

local M = {}

-- Of an accelerator's memory, what a training process can use: the CUDA
-- context, NCCL buffers and the caching allocator's fragmentation take the
-- rest (commonly 5-10% on 80 GB parts). A stated constant, not fitted.
M.USABLE_FRACTION = 0.9

function M.element_bytes(precision)
  if precision == "bf16" then return 2 end
  if precision == "fp32" or precision == "tf32" then return 4 end
  error(("plan: precision must be bf16, fp32 or tf32, got %s"):format(tostring(precision)), 0)
end

--- Bytes per parameter: weight, gradient, optimizer state (before ZeRO).
function M.state_bytes(precision)
  if precision == "bf16" then return 2, 4, 12 end
  M.element_bytes(precision)
  return 4, 4, 8
end

--- Activation bytes one layer keeps for one micro-batch (see the derivation above).
-- o: { seq, b, t, sp, recompute, precision, flash_attention, c (context size, 1 if nil) }
function M.layer_activation_bytes(s, o)
  local e = M.element_bytes(o.precision)
  local C = o.c or 1
  local tokens = o.seq * o.b / C -- this context rank's two chunks of every sequence
  local h, t = s.hidden, o.t
  local rep_div = o.sp and t or 1
  if o.recompute == "full" then return tokens * h * e / rep_div end
  local dropout = s.dropout
  local kv = models.kv_dim(s)
  local replicated = tokens * h * (4 * e + (dropout and 2 or 0))
  local gated = s.gated_mlp
  local mlp = s.top_k * tokens * s.ffn * ((gated and 2 or 1) + 1) * e
  -- fewer key/value heads than ranks: each rank keeps the whole key/value head its query heads use
  -- (kind_kv_heads.c), 2 * head_dim wide, in place of its 2 * kv / t share
  local kv_kept = t > (s.kv_heads or s.heads) and 2 * models.head_dim(s) * t or 2 * kv
  local split = tokens * (h + kv_kept + h) * e + mlp
  local scores = 0
  if o.recompute ~= "selective" and not o.flash_attention then
    scores = s.heads * tokens * o.seq * (dropout and (2 * e + 1) or e) -- its queries against every key
  end
  return replicated / rep_div + (split + scores) / t
end

--- The group ZeRO shards over and gradients are summed over: data x context
-- (D*C ranks; the context ranks hold the same parameters as data replicas).
function M.shard_group(L) return L.d * (L.c or 1) end

--- How many of a stage's `layers` recompute their forward in the backward:
-- all under full recomputation, every k-th with L.recompute_every = k, none otherwise.
function M.recomputed_layers(L, layers)
  if L.recompute ~= "full" then return 0 end
  return layers // (L.recompute_every or 1)
end

--- Micro-batches a stage holds between forward and backward, from its actions.
function M.in_flight(actions)
  local live, most = 0, 0
  for _, a in ipairs(actions) do
    if a[1] == "forward" then
      live = live + 1
      if live > most then most = live end
    elseif a[1] == "backward" then
      live = live - 1
    end
  end
  return most
end

--- Parameters a rank of a stage holds: { layers = n, first = bool, last = bool }.
function M.stage_params(s, stage, t, P)
  local lp = models.layer_params(s)
  local embed, head = models.edge_params(s)
  local n = stage.layers * (lp.split / t + lp.replicated)
  if stage.first then n = n + embed.split / t + embed.replicated end
  if stage.last then
    n = n + head.replicated
    -- an untied head, or a tied one whose embedding lives on another stage
    if not head.tied or P > 1 then n = n + head.split / t end
  end
  return n
end

--- Gradient bytes of a rank holding `params` parameters of `stage` (g per
-- parameter): the flat buffer; with ZeRO-2 over d > 1 the engine keeps its
-- shard plus staging (pg_engine.h): a pool of about two buckets of bucket_mb
-- (25 MiB unless L.bucket_mb says; at most the stage's other gradients) and
-- the tied embedding's own, kept while a head borrows it (stage 1) or its copy
-- waits for the embedding group's sum (first and last stage when p > 1).
function M.gradient_bytes(s, L, stage, params, g)
  local n = M.shard_group(L)
  if (L.zero or 0) < 2 or n == 1 then return params * g end
  local _, head = models.edge_params(s)
  local resident = 0
  if head.tied and (stage.first or (stage.last and L.p > 1)) then resident = head.split / L.t end
  local bucket = (L.bucket_mb or 25) * 1024 * 1024 / 4
  local pool = math.min(2 * bucket, params - resident)
  return params * g / n + (pool + resident) * 4
end

--- Parameters of the largest module a rank of `stage` gathers at once under
-- ZeRO-3: one transformer block, or the embedding (first stage), or the
-- final norm and head (last stage), each as this tensor rank holds it.
function M.gathered_unit_params(s, stage, t, P)
  local lp = models.layer_params(s)
  local embed, head = models.edge_params(s)
  local most = stage.layers > 0 and lp.split / t + lp.replicated or 0
  if stage.first then most = math.max(most, embed.split / t + embed.replicated) end
  if stage.last then
    local n = head.replicated
    if not head.tied or P > 1 then n = n + head.split / t end
    most = math.max(most, n)
  end
  return most
end

--- ZeRO-3 state of a rank holding `params` of `stage` (see the top of this
-- file): weights (fp32 shard under fp32; the gathered unit twice), gradients
-- (fp32 shard; the gathered unit's full gradient), optimizer (shard).
function M.zero3_bytes(s, L, stage, params)
  local w, g, opt = M.state_bytes(L.precision)
  local n = M.shard_group(L)
  local unit = M.gathered_unit_params(s, stage, L.t, L.p)
  local master = L.precision == "bf16" and 0 or params * w / n -- bf16: the master is in opt's 12
  return master + 2 * unit * w, params * g / n + unit * g, params * opt / n
end

--- Peak bytes of a rank of `stage` under layout `L`
-- ({ t, p, d, b, seq, precision, zero, recompute, sp, flash_attention }),
-- `in_flight` micro-batches held. Returns total and its parts.
function M.stage_bytes(s, L, stage, in_flight)
  local params = M.stage_params(s, stage, L.t, L.p)
  local w, g, opt = M.state_bytes(L.precision)
  -- ZeRO-1 and 2 shard the AdamW state, ZeRO-2 the gradients too (M.gradient_bytes), ZeRO-3 everything
  if L.zero >= 1 then opt = opt / M.shard_group(L) end
  local C = L.c or 1
  local act_o = { seq = L.seq, b = L.b, t = L.t, sp = L.sp, recompute = L.recompute, precision = L.precision,
    flash_attention = L.flash_attention, c = C }
  local per_layer = M.layer_activation_bytes(s, act_o)
  local activations = per_layer * stage.layers * in_flight
  local recomputed = M.recomputed_layers(L, stage.layers)
  if recomputed > 0 then
    -- the layers not recomputed keep everything; the layer being recomputed holds its full activations once
    local full = {}
    for k, v in pairs(act_o) do full[k] = v end
    full.recompute = "none"
    local kept = M.layer_activation_bytes(s, full)
    activations = (per_layer * recomputed + kept * (stage.layers - recomputed)) * in_flight + kept
  end
  local transient = 0
  if stage.last then
    transient = L.seq / C * L.b * s.vocab / L.t * (M.element_bytes(L.precision) + 4)
  end
  local weights, gradients, optimizer = params * w, M.gradient_bytes(s, L, stage, params, g), params * opt
  if L.zero == 3 then weights, gradients, optimizer = M.zero3_bytes(s, L, stage, params) end
  local parts = { weights = weights, gradients = gradients, optimizer = optimizer,
    activations = activations, transient = transient, params = params }
  parts.total = parts.weights + parts.gradients + parts.optimizer + parts.activations + parts.transient
  return parts.total, parts
end

return M
