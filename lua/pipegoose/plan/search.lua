--- pipegoose.plan.search: every layout of a model on a cluster, the ones that
-- fit, ranked by simulated step time.
--
-- Enumerated (N GPUs, G per node):
--   T  tensor parallel: divides G and N, the heads and the kv heads (Megatron
--      splits attention by heads), and the MLP width
--   P  pipeline stages: divides N/T, at most the number of layers (layers
--      need not divide evenly: stages are cut by pipegoose's own FLOP
--      balancer, parallel.balance, as pg.parallelize cuts them)
--   C  context parallel: divides N/(T*P), and 2C divides the sequence (the
--      engine's 2C-chunk causal split); C = 1 on a cpu profile (plan/cpu.lua
--      prices pipegoose's CPU engine, whose context path it has not measured)
--   D  = N / (T*P*C), and D must divide the global batch
--   b  micro-batch size 1, 2, 4, ... dividing global_batch / D; M = that / b
--   schedule: the runtime's one-chunk schedules (core.schedules().offered:
--      1f1b, gpipe), zero 0 | 1 | 3 over the D*C group (1 and 3 only when
--      D*C > 1; 2 when fixed; 3 not on a cpu profile, as C),
--   recompute none | selective | full, sequence parallel on | off when T > 1
-- A layout whose busiest rank exceeds the usable memory is dropped. The rest
-- are simulated in order of a lower bound on their step time (the busiest
-- stage's work with no bubble), stopping once the bound passes the K-th best
-- simulated step: the answer is the same as simulating all of them, in a
-- fraction of the time.
local models = require "pipegoose.plan.models"
local memory = require "pipegoose.plan.memory"
local cost = require "pipegoose.plan.cost"
local simulate = require "pipegoose.plan.simulate"
local core = require "pipegoose.core"
local common = require "pipegoose.models.common"

-- the schedules searched, in the runtime's order (the default first)
local SCHEDULES = core.schedules().offered

local M = {}

local function divisors(n)
  local out = {}
  for i = 1, n do if n % i == 0 then out[#out + 1] = i end end
  return out
end

--- Stage contents for P stages: { { layers =, first =, last = }, ... }, cut
-- like pg.parallelize cuts a model's top-level modules (embedding, layers,
-- head), by forward+backward FLOPs.
function M.partition(s, P)
  local balance = require("pipegoose.parallel").balance
  local costs = { 1 }
  local layer = 3 * models.layer_gemm_flops(s, s.seq_len) + 1
  for i = 1, s.layers do costs[i + 1] = layer end
  costs[#costs + 1] = 3 * models.head_flops(s) + 1
  local sizes = balance(costs, P)
  local parts, first = {}, 1
  local n = #costs
  for p = 1, P do
    local last = first + sizes[p] - 1
    local layers = sizes[p]
    if first == 1 then layers = layers - 1 end
    if last == n then layers = layers - 1 end
    parts[p] = { layers = layers, first = p == 1, last = p == P }
    first = last + 1
  end
  return parts
end

--- Micro-batches stage i (1-based) holds at once: the runtime's count
-- (core.schedule_in_flight, pg_schedule_in_flight: what the schedules' action
-- lists give; checked against simulate in the specs).
function M.in_flight(schedule, P, Mb, i)
  return core.schedule_in_flight(schedule, P, Mb, i - 1)
end

--- Peak memory of the busiest rank of a layout, and which stage it is.
-- With a calibrated CPU profile (hw.cpu), what pipegoose's CPU engine keeps
-- (cpu.lua); otherwise Megatron-style GPU training's closed form (memory.lua).
function M.layout_memory(s, L, parts, hw)
  local worst, at, detail = 0, 1, nil
  local cpu = hw and hw.cpu and require "pipegoose.plan.cpu"
  for i, part in ipairs(parts) do
    local n = M.in_flight(L.schedule, L.p, L.m, i)
    local bytes, d
    if cpu then bytes, d = cpu.stage_bytes(s, L, part, n, memory.stage_params)
    else bytes, d = memory.stage_bytes(s, L, part, n) end
    if bytes > worst then worst, at, detail = bytes, i, d end
  end
  return worst, at, detail
end

--- Simulates one layout: the step time and its breakdown.
function M.evaluate(s, L, hw, o, parts, costs)
  costs = costs or cost.stage_costs(s, L, hw, o, parts)
  local stages = simulate.schedule_actions(L.schedule, L.p, L.m)
  local r = simulate.run(stages,
    function(i, a) return a[1] == "forward" and costs[i].fwd or costs[i].bwd end,
    function(i, a) return a[1] == "send_act" and costs[i].send_act or costs[i].send_grad end)
  local step, crit = 0, 1
  local ends = {}
  for i, c in ipairs(costs) do
    local exposed = c.dp
    if o.dp_overlap then exposed = math.max(0, c.dp - c.bwd) end
    c.dp_exposed = exposed
    ends[i] = r.stages[i].finish + exposed + c.optimizer
    if ends[i] > step then step, crit = ends[i], i end
  end
  local c = costs[crit]
  -- float noise below a femtosecond per second of step is no bubble
  local function clean(x) return math.abs(x) < 1e-12 * step and 0 or x end
  local cp = L.m * ((c.fwd_cp or 0) + (c.bwd_cp or 0))
  local zero3 = L.m * ((c.fwd_zero3 or 0) + (c.bwd_zero3 or 0))
  local tp = L.m * (c.fwd_tp + c.bwd_tp)
  local compute = L.m * (c.fwd + c.bwd) - tp - cp - zero3
  local stage_idle = {}
  for i, ci in ipairs(costs) do
    stage_idle[i] = clean(step - r.stages[i].busy - ci.dp_exposed - ci.optimizer)
  end
  return {
    step_s = step,
    critical_stage = crit,
    -- dp_comm_exposed: the reduction after the pipeline, or ZeRO-3's per-micro-batch gathers and
    -- reduce-scatters that compute did not hide; cp_comm: the context ring's unhidden part
    breakdown = { compute = compute, tp_comm = tp, cp_comm = cp,
      bubble = clean(step - compute - tp - cp - zero3 - c.dp_exposed - c.optimizer),
      dp_comm_exposed = c.dp_exposed + zero3, optimizer = c.optimizer },
    stage_idle = stage_idle,
    in_flight = (function()
      local t = {}
      for i, st in ipairs(r.stages) do t[i] = st.in_flight end
      return t
    end)(),
  }
end

-- A step no schedule can beat: every stage's own work with no bubble, and,
-- for stage i, the forward of the first micro-batch through stages 1..i-1
-- (before stage i can start), stage i's work, and the backward of its last
-- micro-batch back through stages i-1..1 (after stage i's last backward),
-- then the first stage's reduction and optimizer. Transfers are left out (a
-- bound). For equal stages the second is (M + P - 1)(fwd + bwd), the
-- one-chunk schedules' bubble, so few layouts are simulated past the best.
local function lower_bound(costs, Mb, o)
  local lb = 0
  local function tail(c) return (o.dp_overlap and math.max(0, c.dp - c.bwd) or c.dp) + c.optimizer end
  local before = 0 -- sum over earlier stages of one micro-batch's forward and backward
  for _, c in ipairs(costs) do
    local work = Mb * (c.fwd + c.bwd)
    lb = math.max(lb, work + tail(c), before + work + tail(costs[1]))
    before = before + c.fwd + c.bwd
  end
  return lb
end

-- what a stage's costs depend on: the layout but its schedule (m follows from d and b)
local function costs_key(L)
  return ("t%d p%d c%d d%d b%d z%d %s sp%s"):format(L.t, L.p, L.c, L.d, L.b, L.zero, L.recompute, tostring(L.sp))
end

-- a layout but its micro-batch size
local function dead_key(L)
  return ("t%d p%d c%d d%d %s z%d %s sp%s"):format(L.t, L.p, L.c, L.d, L.schedule, L.zero, L.recompute, tostring(L.sp))
end

local function key_of(L)
  return ("t%d p%d c%d d%d b%d %s z%d %s sp%s"):format(L.t, L.p, L.c, L.d, L.b, L.schedule, L.zero, L.recompute,
    tostring(L.sp))
end

--- All layouts that fit, best first.
-- q: { model = shape, hw = description, gpus, gpus_per_node, global_batch,
--      seq_len, precision, top, options = { gemm_efficiency, flash_attention,
--      dp_overlap }, fix = { t, p, c, b, schedule, zero, recompute, sp } }
-- Returns the ranked list (at most q.top) and a summary { enumerated,
-- over_memory, simulated, batch_mismatch, feasible, usable_bytes (per rank),
-- smallest (the over-memory layout that needs the least, with mem_bytes) }.
function M.run(q)
  local s, hw, o = q.model, q.hw, q.options
  local N, G = q.gpus, q.gpus_per_node
  local fix = q.fix or {}
  local top = q.top or 1
  local seq, GB = q.seq_len, q.global_batch
  local usable = hw.memory_bytes * memory.USABLE_FRACTION
  local s_seq = {}
  for k, v in pairs(s) do s_seq[k] = v end
  s_seq.seq_len = seq

  local summary = { enumerated = 0, over_memory = 0, simulated = 0, batch_mismatch = 0, usable_bytes = usable }
  local cands = {}
  local part_cache = {}
  local cost_cache = {}
  local dead = {} -- layouts but b over memory at a smaller b (dead_key)
  for _, T in ipairs(divisors(G)) do
    if N % T == 0 and not common.tensor_heads(T, s.heads, s.kv_heads) and s.ffn % T == 0
      and (fix.t == nil or fix.t == T) then
      for _, P in ipairs(divisors(N // T)) do
        for _, C in ipairs(divisors(N // (T * P))) do
          if P <= s.layers and (fix.p == nil or fix.p == P) and seq % (2 * C) == 0
            and (fix.c == nil or fix.c == C) and (C == 1 or not hw.cpu) then
            local D = N // (T * P * C)
            if GB % D ~= 0 then
              summary.batch_mismatch = summary.batch_mismatch + 1
            else
              part_cache[P] = part_cache[P] or M.partition(s_seq, P)
              local parts = part_cache[P]
              local per_replica = GB // D
              local b = 1
              while b <= per_replica do
                if per_replica % b == 0 and (fix.b == nil or fix.b == b) then
                  local Mb = per_replica // b
                  for _, sched in ipairs(SCHEDULES) do
                    -- zero = 2 only when asked for: it trades a reduce-scatter per micro-batch (plan/cost.lua)
                    -- for the gradient shard (plan/memory.lua), which the search does not weigh yet
                    local DC = D * C
                    local stages = DC == 1 and { 0 } or fix.zero == 2 and { 2 } or hw.cpu and { 0, 1 } or { 0, 1, 3 }
                    for _, zero in ipairs(stages) do
                      for _, rc in ipairs{ "none", "selective", "full" } do
                        for _, sp in ipairs(T > 1 and { false, true } or { false }) do
                          if (fix.schedule == nil or fix.schedule == sched) and (fix.zero == nil or fix.zero == zero)
                            and (fix.recompute == nil or fix.recompute == rc) and (fix.sp == nil or fix.sp == sp) then
                            summary.enumerated = summary.enumerated + 1
                            local L = { t = T, p = P, c = C, d = D, m = Mb, b = b, schedule = sched, zero = zero,
                              recompute = rc, recompute_every = rc == "full" and fix.recompute_every or nil,
                              sp = sp, seq = seq, precision = q.precision,
                              flash_attention = o.flash_attention }
                            -- a layout over memory at micro-batch size b is over at 2b (memory.lua: the
                            -- activations in flight, b x min(stages ahead, M) or b x M, and the transients
                            -- grow with b; nothing else depends on it): not priced again
                            local dk = dead_key(L)
                            local mem, at, detail = math.huge, nil, nil
                            if not dead[dk] then mem, at, detail = M.layout_memory(s, L, parts, hw) end
                            if mem > usable then
                              dead[dk] = true
                              summary.over_memory = summary.over_memory + 1
                              if not summary.smallest or mem < summary.smallest.mem_bytes then
                                L.mem_bytes = mem
                                summary.smallest = L
                              end
                            else
                              L.mem_bytes, L.mem_stage, L.mem_detail = mem, at, detail
                              L.parts = parts
                              -- the schedule changes no stage's costs: one costing per layout of the others
                              local ck = costs_key(L)
                              local costs = cost_cache[ck]
                              if not costs then
                                costs = cost.stage_costs(s, L, hw, o, parts)
                                cost_cache[ck] = costs
                              end
                              L.costs = costs
                              L.lower_bound = lower_bound(costs, Mb, o)
                              cands[#cands + 1] = L
                            end
                          end
                        end
                      end
                    end
                  end
                end
                b = b * 2
              end
            end
          end
        end
      end
    end
  end
  table.sort(cands, function(x, y)
    if x.lower_bound ~= y.lower_bound then return x.lower_bound < y.lower_bound end
    return key_of(x) < key_of(y)
  end)

  local best = {}
  local function kth() return #best >= top and best[top].step_s or math.huge end
  local tokens = GB * seq
  local model_flops, hw_flops = {}, {}
  for _, rc in ipairs{ "none", "selective", "full" } do
    model_flops[rc], hw_flops[rc] = models.step_flops(s, seq, tokens, rc, fix.recompute_every)
  end
  for _, L in ipairs(cands) do
    if L.lower_bound > kth() then break end
    summary.simulated = summary.simulated + 1
    local r = M.evaluate(s, L, hw, o, L.parts, L.costs)
    for k, v in pairs(r) do L[k] = v end
    L.tokens_per_s = tokens / L.step_s
    L.tflops_per_gpu = hw_flops[L.recompute] / L.step_s / N / 1e12
    L.mfu = model_flops[L.recompute] / L.step_s / N / hw.peak_flops[q.precision]
    L.mem_gb = L.mem_bytes / 1024 ^ 3
    L.costs = nil
    best[#best + 1] = L
    table.sort(best, function(x, y)
      if x.step_s ~= y.step_s then return x.step_s < y.step_s end
      if x.mem_bytes ~= y.mem_bytes then return x.mem_bytes < y.mem_bytes end
      return key_of(x) < key_of(y)
    end)
    if #best > top then best[#best] = nil end
  end
  summary.feasible = #cands
  return best, summary
end

return M
