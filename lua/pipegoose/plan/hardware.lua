--- pipegoose.plan.hardware: what one accelerator and its links can do.
--
-- A hardware description is the only thing the cost model asks about the
-- machine, so a measured profile (scripts/calibrate.lua)
-- can replace a datasheet entry without touching the cost model:
--
--   {
--     name             = "a100-80gb",
--     peak_flops       = { fp32 = , tf32 = , bf16 = },  -- dense FLOP/s per precision
--     gemm_efficiency  = nil | fraction,  -- nil: the planner's stated constant
--                                         -- (cost.DEFAULTS.gemm_efficiency);
--                                         -- 1 for a profile (its FLOP/s are measured)
--     memory_bandwidth = bytes/s,          -- HBM (or DRAM for a CPU profile)
--     memory_efficiency= fraction,         -- share of memory_bandwidth an elementwise kernel reaches
--     memory_bytes     = bytes,            -- capacity of one accelerator
--     gpus_per_node    = 8,
--     intra = { bandwidth = bytes/s, latency = s },  -- one direction, per GPU (NVLink)
--     inter = { bandwidth = bytes/s, latency = s },  -- one direction, per GPU (InfiniBand)
--     link_efficiency  = fraction,         -- share of link bandwidth a collective reaches
--     kernel_overhead  = seconds,          -- fixed time per kernel (launch, ramp-up, tail)
--   }
--
-- Datasheet figures (dense, i.e. without the 2:4 sparsity factor NVIDIA
-- quotes first):
--   A100 SXM: NVIDIA A100 Tensor Core GPU datasheet (2021): FP32 19.5 TF,
--     TF32 156 TF, BF16 312 TF; HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s
--     (80GB); NVLink 600 GB/s per GPU (both directions together).
--     DGX A100: 8 x 200 Gb/s HDR InfiniBand for compute, one per GPU
--     (DGX A100 system architecture whitepaper) = 25 GB/s per GPU.
--   H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: FP32 67 TF, TF32 494.5 TF
--     (989 with sparsity), BF16 989.5 TF (1,979 with sparsity); HBM3 3.35 TB/s;
--     80 GB; NVLink 900 GB/s. DGX H100: 8 x 400 Gb/s NDR ConnectX-7 = 50 GB/s
--     per GPU.
--   H200 SXM: NVIDIA H200 datasheet: same tensor cores as H100 SXM (BF16
--     989.5 TF dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; HGX H200
--     nodes ship with 400 Gb/s NDR per GPU.
-- Latencies are not on datasheets: ~5 us per hop inside a node and ~10 us
-- across nodes are the small-message times nccl-tests reports on DGX
-- systems; they matter only for small transfers. The kernel overhead (5 us)
-- is the usual launch-plus-tail cost of a CUDA kernel on these parts; it
-- matters only when a layer's work is small (GPT-2-sized models, b = 1).
local cjson = require("cjson").new()

local M = {}

local GB, GiB = 1e9, 1024 ^ 3

-- Collectives do not run at link speed: nccl-tests on DGX A100 / H100 report
-- all-reduce bus bandwidths of roughly 75-85% of the NVLink and IB figures.
-- One stated constant for every link, not fitted to any result here.
M.LINK_EFFICIENCY = 0.8
-- Elementwise kernels reach ~80-90% of HBM bandwidth (STREAM-like copies on
-- A100/H100); the lower end, because real kernels mix reads and writes.
M.MEMORY_EFFICIENCY = 0.8
M.KERNEL_OVERHEAD = 5e-6

local function gpu(t)
  t.gpus_per_node = t.gpus_per_node or 8
  t.link_efficiency = t.link_efficiency or M.LINK_EFFICIENCY
  t.memory_efficiency = t.memory_efficiency or M.MEMORY_EFFICIENCY
  t.kernel_overhead = t.kernel_overhead or M.KERNEL_OVERHEAD
  return t
end

M.BUILTIN = {
  ["a100-40gb"] = gpu{
    name = "a100-40gb",
    peak_flops = { fp32 = 19.5e12, tf32 = 156e12, bf16 = 312e12 },
    memory_bandwidth = 1555 * GB,
    memory_bytes = 40 * GiB,
    intra = { bandwidth = 300 * GB, latency = 5e-6 }, -- 600 GB/s NVLink3, both directions
    inter = { bandwidth = 25 * GB, latency = 10e-6 }, -- HDR 200 Gb/s per GPU
  },
  ["a100-80gb"] = gpu{
    name = "a100-80gb",
    peak_flops = { fp32 = 19.5e12, tf32 = 156e12, bf16 = 312e12 },
    memory_bandwidth = 2039 * GB,
    memory_bytes = 80 * GiB,
    intra = { bandwidth = 300 * GB, latency = 5e-6 },
    inter = { bandwidth = 25 * GB, latency = 10e-6 },
  },
  ["h100-80gb"] = gpu{
    name = "h100-80gb",
    peak_flops = { fp32 = 67e12, tf32 = 494.5e12, bf16 = 989.5e12 },
    memory_bandwidth = 3350 * GB,
    memory_bytes = 80 * GiB,
    intra = { bandwidth = 450 * GB, latency = 5e-6 }, -- 900 GB/s NVLink4, both directions
    inter = { bandwidth = 50 * GB, latency = 10e-6 }, -- NDR 400 Gb/s per GPU
  },
  ["h200"] = gpu{
    name = "h200",
    peak_flops = { fp32 = 67e12, tf32 = 494.5e12, bf16 = 989.5e12 },
    memory_bandwidth = 4800 * GB,
    memory_bytes = 141 * GB, -- the datasheet's 141 GB are decimal
    intra = { bandwidth = 450 * GB, latency = 5e-6 },
    inter = { bandwidth = 50 * GB, latency = 10e-6 },
  },
}

M.NAMES = {}
for name in pairs(M.BUILTIN) do M.NAMES[#M.NAMES + 1] = name end
table.sort(M.NAMES)

local function copy(t)
  if type(t) ~= "table" then return t end
  local c = {}
  for k, v in pairs(t) do c[k] = copy(v) end
  return c
end

---------------------------------------------------------------- profiles
--
-- A measured profile is a JSON object (what scripts/calibrate.lua writes):
--
--   {
--     "format": "pipegoose-hardware-profile",  required, exactly this
--     "version": 1,                            required, exactly 1
--     "name": "my-box",                        required string
--     "gemm_flops": {"fp32": 1.1e12, "bf16": ...},   required: ACHIEVED FLOP/s
--                   of large GEMMs per precision (at least one precision);
--                   used as-is (gemm_efficiency = 1)
--     "memory_bandwidth": 2.0e10,              required: achieved bytes/s of
--                   an elementwise kernel (memory_efficiency = 1)
--     "memory_bytes": 6.8e10,                  required: usable bytes per rank
--     "gpus_per_node": 2,                      required: ranks per node
--     "intra": {"bandwidth": 5e9, "latency": 2e-6},  required: ranks in one node,
--     "inter": {"bandwidth": 1e9, "latency": 2e-5},  required: across nodes;
--                   bandwidth is the achieved bus bandwidth of a ring
--                   collective (link_efficiency = 1), latency per hop
--     "kernel_overhead": 2e-6,                 optional: seconds per kernel
--                   (dispatch of one operation), default 0
--     "notes": "..."                           optional string
--     "cpu": {...}                             optional: what scripts/calibrate.lua
--                   measures of pipegoose's CPU engine; with it the cost model
--                   prices each operation of a layer from these tables instead
--                   of one FLOP/s figure (cpu.lua):
--       "cores": 2,                            cores of a node (pipegoose gives each
--                   of R ranks on a node max(1, cores // R) threads)
--       "gemm": [{"m","k","n","threads","flops"}, ...]   achieved FLOP/s of
--                   pg.ops.linear ([m, k] x [k, n]) by shape and threads
--       "attention": [{"batch","seq","heads","head_dim","threads","flops",
--                   "backward_flops"}, ...]   causal attention core, FLOPs
--                   counted as 4*b*s*s*heads*head_dim forward (the full square)
--       "elementwise": {"gelu" | "layernorm" | "rmsnorm" | "residual" |
--                   "swiglu" | "rope": [{"bytes","threads","bandwidth",
--                   "backward_bandwidth"}, ...]}   memory-bound kernels by
--                   size: bytes the forward reads and writes, over the
--                   forward's time and over the backward's time
--       "adamw": {"<threads>": bytes/s}        the AdamW update (28 bytes
--                   moved per fp32 parameter)
--       "step_overhead": s                     fixed cost of one engine step
--       "collectives": {"all_reduce" | "all_gather" | "reduce_scatter" |
--                   "shm_all_reduce": {"<ranks>": {"latency", "bandwidth"}}}
--                   time = latency + buffer bytes / bandwidth, measured with
--                   that many ranks on this node (shm_all_reduce: the engine's
--                   shared-memory data-parallel gradient reduction)
--       "p2p": {"latency", "bandwidth"}        pg.dist.send/recv between 2 ranks
--     }
--   }
--
-- Every number must be positive and finite; an unknown field is an error (a
-- misspelt field would otherwise silently fall back to nothing). Errors name
-- the file and the field.

local PRECISIONS = { fp32 = true, tf32 = true, bf16 = true }

local function fail(path, fmt, ...)
  error(("cpu-profile %s: " .. fmt):format(path, ...), 0)
end

local function positive(path, field, v)
  if type(v) ~= "number" or v ~= v or v <= 0 or v == math.huge then
    fail(path, "%s must be a positive finite number, got %s", field, cjson.encode(v))
  end
  return v
end

local function only(path, where, t, known)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  for _, k in ipairs(keys) do
    if not known[k] then fail(path, "unknown field %s%s", where, k) end
  end
end

local function link(path, field, v)
  if type(v) ~= "table" then fail(path, "%s is required (an object with bandwidth and latency)", field) end
  only(path, field .. ".", v, { bandwidth = true, latency = true })
  return { bandwidth = positive(path, field .. ".bandwidth", v.bandwidth),
           latency = positive(path, field .. ".latency", v.latency) }
end

local function positive_int(path, field, v)
  positive(path, field, v)
  if v ~= math.floor(v) then fail(path, "%s must be an integer, got %s", field, v) end
  return math.tointeger(v)
end

-- {"<n>": value} with positive integer keys: a table keyed by integers
local function by_count(path, field, t, each)
  if type(t) ~= "table" or next(t) == nil then fail(path, "%s is required (an object keyed by a count)", field) end
  local out = {}
  for k, v in pairs(t) do
    local n = math.tointeger(tonumber(k))
    if not n or n < 1 or tostring(n) ~= tostring(k) then fail(path, "%s: key %s is not a positive integer", field, k) end
    out[n] = each(field .. "." .. k, v)
  end
  return out
end

-- A list of measured rows, each with exactly the given numeric fields.
local function rows(path, field, list, fields)
  if type(list) ~= "table" or #list == 0 then fail(path, "%s is required (a non-empty list)", field) end
  local known = {}
  for _, f in ipairs(fields) do known[f] = true end
  local out = {}
  for i, r in ipairs(list) do
    local where = ("%s[%d]"):format(field, i)
    if type(r) ~= "table" then fail(path, "%s is not an object", where) end
    only(path, where .. ".", r, known)
    local row = {}
    for _, f in ipairs(fields) do row[f] = positive(path, where .. "." .. f, r[f]) end
    out[i] = row
  end
  return out
end

local ELEMENTWISE = { gelu = true, layernorm = true, rmsnorm = true, residual = true, swiglu = true, rope = true }
local COLLECTIVES = { all_reduce = true, all_gather = true, reduce_scatter = true, shm_all_reduce = true }

local function cpu_section(path, c)
  if type(c) ~= "table" then fail(path, "cpu must be an object") end
  only(path, "cpu.", c, { cores = true, gemm = true, attention = true, elementwise = true, adamw = true,
    step_overhead = true, collectives = true, p2p = true })
  if type(c.elementwise) ~= "table" then fail(path, "cpu.elementwise is required (rows per operation)") end
  only(path, "cpu.elementwise.", c.elementwise, ELEMENTWISE)
  local elementwise = {}
  for op in pairs(ELEMENTWISE) do
    elementwise[op] = rows(path, "cpu.elementwise." .. op, c.elementwise[op],
      { "bytes", "threads", "bandwidth", "backward_bandwidth" })
  end
  if type(c.collectives) ~= "table" then fail(path, "cpu.collectives is required") end
  only(path, "cpu.collectives.", c.collectives, COLLECTIVES)
  local colls = {}
  for name in pairs(COLLECTIVES) do
    colls[name] = by_count(path, "cpu.collectives." .. name, c.collectives[name], function(f, v)
      return link(path, f, v)
    end)
  end
  return {
    cores = positive_int(path, "cpu.cores", c.cores),
    gemm = rows(path, "cpu.gemm", c.gemm, { "m", "k", "n", "threads", "flops" }),
    attention = rows(path, "cpu.attention", c.attention,
      { "batch", "seq", "heads", "head_dim", "threads", "flops", "backward_flops" }),
    elementwise = elementwise,
    adamw = by_count(path, "cpu.adamw", c.adamw, function(f, v) return positive(path, f, v) end),
    step_overhead = positive(path, "cpu.step_overhead", c.step_overhead),
    collectives = colls,
    p2p = link(path, "cpu.p2p", c.p2p),
  }
end

--- A hardware description from a decoded profile table (`path` names it in errors).
function M.from_profile(p, path)
  path = path or "(table)"
  if type(p) ~= "table" then fail(path, "is not a JSON object") end
  only(path, "", p, { format = true, version = true, name = true, gemm_flops = true, memory_bandwidth = true,
    memory_bytes = true, gpus_per_node = true, intra = true, inter = true, notes = true,
    kernel_overhead = true, cpu = true })
  if p.format ~= "pipegoose-hardware-profile" then
    fail(path, "format must be \"pipegoose-hardware-profile\", got %s", cjson.encode(p.format))
  end
  if p.version ~= 1 then fail(path, "version must be 1, got %s", cjson.encode(p.version)) end
  if type(p.name) ~= "string" or p.name == "" then fail(path, "name must be a non-empty string") end
  if p.notes ~= nil and type(p.notes) ~= "string" then fail(path, "notes must be a string") end
  if type(p.gemm_flops) ~= "table" or next(p.gemm_flops) == nil then
    fail(path, "gemm_flops is required (an object of FLOP/s per precision: fp32, tf32, bf16)")
  end
  only(path, "gemm_flops.", p.gemm_flops, PRECISIONS)
  local flops = {}
  for prec in pairs(p.gemm_flops) do flops[prec] = positive(path, "gemm_flops." .. prec, p.gemm_flops[prec]) end
  local g = positive(path, "gpus_per_node", p.gpus_per_node)
  if math.type(g) ~= "integer" and g ~= math.floor(g) then fail(path, "gpus_per_node must be an integer, got %s", g) end
  return {
    name = "cpu-profile:" .. p.name,
    profile = path,
    peak_flops = flops,
    gemm_efficiency = 1,
    memory_bandwidth = positive(path, "memory_bandwidth", p.memory_bandwidth),
    memory_efficiency = 1,
    memory_bytes = positive(path, "memory_bytes", p.memory_bytes),
    gpus_per_node = math.tointeger(g),
    intra = link(path, "intra", p.intra),
    inter = link(path, "inter", p.inter),
    link_efficiency = 1,
    kernel_overhead = p.kernel_overhead == nil and 0 or positive(path, "kernel_overhead", p.kernel_overhead),
    cpu = p.cpu ~= nil and cpu_section(path, p.cpu) or nil,
  }
end

--- The precision a plan uses when none is given: bf16 (mixed precision, what
-- large runs train in) where the hardware has bf16 FLOP/s, as every
-- datasheet entry does; else the one a measured profile has figures for
-- (scripts/calibrate.lua measures fp32 only), tf32 before fp32.
function M.default_precision(hw)
  for _, p in ipairs{ "bf16", "tf32", "fp32" } do
    if hw.peak_flops[p] then return p end
  end
  error(("plan: %s has no FLOP/s for any precision"):format(hw.name or "hardware"), 0)
end

--- Reads a profile file.
function M.load_profile(path)
  local f, err = io.open(path, "r")
  if not f then fail(path, "cannot read it (%s)", err) end
  local text = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, text)
  if not ok then fail(path, "is not JSON (%s)", tostring(v)) end
  return M.from_profile(v, path)
end

--- A hardware description by name ("a100-80gb", ..., "cpu-profile=FILE") or
-- a table (returned as given, after a check that it has what the cost model reads).
function M.get(spec)
  if type(spec) == "table" then
    for _, k in ipairs{ "peak_flops", "memory_bandwidth", "memory_bytes", "intra", "inter" } do
      if spec[k] == nil then error(("plan: hardware table has no %s"):format(k), 0) end
    end
    return gpu(copy(spec))
  end
  if type(spec) ~= "string" then error("plan: gpu must be a name or a hardware table", 0) end
  local file = spec:match("^cpu%-profile=(.+)$")
  if file then return M.load_profile(file) end
  local hw = M.BUILTIN[spec]
  if not hw then
    error(("plan: unknown gpu '%s' (known: %s, cpu-profile=FILE)"):format(spec, table.concat(M.NAMES, ", ")), 0)
  end
  return copy(hw)
end

return M
