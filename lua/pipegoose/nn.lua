--- pg.nn: model specs, composed like Lua Torch's nn.
-- A spec is a plain description (sizes, names, options); pg.parallelize turns
-- the specs of this rank's pipeline stage into runtime modules in C. Specs
-- know their parameter count and forward FLOPs per token (for stage
-- balancing) and check that widths fit together, with or without tensor
-- parallelism.
local opt = require "pipegoose.options"
-- the attention's shape rules (common.attention, common.tensor_heads) live there, once
local common = require "pipegoose.models.common"

local nn = {}

local Spec = {}
Spec.__index = Spec

local function spec(kind, fields)
  fields.kind = kind
  return setmetatable(fields, Spec)
end

local function is_spec(x) return getmetatable(x) == Spec end
nn.is_spec = is_spec

-- The validators the constructors' schemas share (pipegoose.options).
local POS = opt.integer{ min = 1 }             -- widths, heads, sizes
local NEED = opt.required(POS)
-- standard deviations of the initial values; the default is common.INIT_STD (0.02, GPT-2's), the one place of it
local STD = opt.number{ min = 0, default = common.INIT_STD }
local NAME = opt.string

-- The options of a constructor that also takes leading arguments, C(a [, b], opts):
-- the arguments (`fields`) joined with the options table.
local function with_args(where, fields, opts)
  if opts ~= nil and type(opts) ~= "table" then
    error(("%s: expects a table of options, got %s"):format(where, opt.show(opts)), 3)
  end
  local t = {}
  for k, v in pairs(opts or {}) do t[k] = v end
  for k, v in pairs(fields) do
    if t[k] ~= nil then error(("%s: %s is given twice, as an argument and as an option"):format(where, k), 3) end
    t[k] = v
  end
  return t
end

local function module_kind_name(s)
  return s.label or s.kind
end

-- A Lua table with forward/backward (a module written in Lua) used as a spec.
local function is_lua_module(x)
  return type(x) == "table" and not is_spec(x) and type(x.forward) == "function" and type(x.backward) == "function"
end
nn.is_lua_module = is_lua_module

-- level: error's, counted from as_spec (default 3: the caller of the function that called it).
local function as_spec(x, where, level)
  if is_spec(x) then return x end
  if is_lua_module(x) then return spec("lua", { module = x, name = x.name, label = "Lua module" }) end
  error(("%s: expected a pg.nn module or a Lua table with forward and backward, got %s"):format(where, type(x)),
    level or 3)
end


local function round_up(x, m) return (x + m - 1) // m * m end
nn.round_up = round_up

-- Module kinds: one class per kind of runtime module, defined next to its
-- constructor below (its C twin, a descriptor of the same name, is in the
-- runtime's registry: src/nn/module_registry.c, whose traits
-- core.module_kinds() returns). A class has
--   describe(s, c) -> the runtime description (for core.Engine) and the output flow,
--                     c = {me = its full name, flow = the input flow, T = tensor size,
--                          sp = sequence parallelism is on (and T > 1),
--                          fail(fmt, ...), need_full(width)}
--   mode(s)        -> for a kind whose runtime traits differ by the description's
--                     mode (linear): the spec's mode
--   params(s)      -> its parameters in the full model (padding excluded; default 0)
--   flops(s, T)    -> forward FLOPs per token at sequence length T (default 0)
--   input_flow(s, T) -> the flow it takes standing alone (default: s.width, not split)
-- Whether describe handles a flow of this rank's rows (flow.seq) itself is
-- the runtime's trait (sequence_parallel: the kind takes this rank's rows,
-- "row_wise" or "gathers"); otherwise such a flow is gathered first
-- (sp_gather) and, when the kind hands back a replicated activation, cut to
-- this rank's rows again (sp_scatter).
-- Adding a kind: a constructor and its class here, a descriptor in the runtime's registry.
local KINDS = {}
nn.kinds = KINDS

-- The runtime's traits of every kind (core.module_kinds()), read once, when
-- the first spec is described (pipegoose.core is the runtime: nn.lua itself
-- loads without it).
local runtime_kinds
local function kind_traits(kind)
  runtime_kinds = runtime_kinds or require("pipegoose.core").module_kinds()
  return runtime_kinds[kind]
end

-- Whether a spec's describe handles a flow of this rank's rows itself: its
-- runtime kind takes this rank's rows (pg_module_sequence_parallel's roles).
local function takes_own_rows(self, class)
  local t = kind_traits(self.kind)
  local role = t and t.sequence_parallel
  if type(role) == "table" then role = role[class.mode(self)] end
  return role == "row_wise" or role == "gathers"
end

-- Sequence parallelism: a description that needs every row of the
-- micro-batch, put between the transitions: sp_gather before it, and
-- sp_scatter after it when it hands back a replicated activation (`out`
-- neither split over the tensor group nor already this rank's rows).
local function sp_wrap(me, in_width, d, out)
  local kids = { { kind = "sp_gather", name = me, width = in_width }, d }
  local seq = out.seq or false
  if not seq and not out.split and out.width > 0 then
    kids[3], seq = { kind = "sp_scatter", name = me, width = out.width }, true
  end
  return { kind = "sequential", name = me, children = kids, sp_wrap = true },
         { width = out.width, split = out.split, blocks = out.blocks, seq = seq }
end

-- A flow's rows turned into this rank's (want_seq) or all of them, by a
-- transition after d; a split flow is left alone (its callers refuse it).
local function sp_rows_to(me, d, out, want_seq)
  if out.split or (out.seq or false) == (want_seq or false) or out.width <= 0 then return d, out end
  local kid = { kind = want_seq and "sp_scatter" or "sp_gather", name = me, width = out.width }
  return { kind = "sequential", name = me, children = { d, kid }, sp_wrap = true },
         { width = out.width, split = false, seq = want_seq or false }
end

--- Resolves the spec against a tensor-parallel size T and an input flow
-- {width=, split=, blocks=, seq=} (split: the activation is cut over the tensor
-- group, blocks: sub-blocks each cut separately, as a fused q|k|v; seq:
-- sequence parallelism, each tensor rank holds its share of the rows).
-- `sp`: sequence parallelism is on (ignored when T = 1). Returns the runtime
-- description and the output flow. `path` is the name prefix; errors name
-- the module and the numbers.
function Spec:describe(path, flow, T, sp)
  local me = path
  if self.name ~= nil and self.name ~= "" then me = path == "" and self.name or (path .. "." .. self.name) end
  local where = ("%s%s"):format(module_kind_name(self), me ~= "" and (" '" .. me .. "'") or "")
  sp = (sp and T > 1) or false
  local class = KINDS[self.kind]
  if not class then error("unknown spec kind " .. tostring(self.kind), 0) end
  if sp and flow.seq and not takes_own_rows(self, class) then
    local d, out = self:describe(path, { width = flow.width, split = flow.split, blocks = flow.blocks }, T, sp)
    return sp_wrap(me, flow.width, d, out)
  end
  local c = { me = me, flow = flow, T = T, sp = sp }
  function c.fail(fmt, ...) error(where .. ": " .. fmt:format(...), 0) end
  function c.need_full(width)
    if flow.split and T > 1 then c.fail("needs the full activation of width %d, but receives a tensor split over tensor=%d (add gather_output to the column-parallel Linear before it)", width, T) end
    if flow.width ~= width then c.fail("expects width %d, receives width %s", width, tostring(flow.width)) end
  end
  if self.tensor_rule then
    local msg = self.tensor_rule(T)
    if msg then c.fail("%s", msg) end
  end
  return class.describe(self, c)
end

--- Parameters of the full model under this spec (padding excluded).
function Spec:num_params()
  local f = KINDS[self.kind].params
  return f and f(self) or 0
end

--- Forward FLOPs per token (multiply-adds count 2), for stage balancing.
-- `T` is the sequence length (attention's cost grows with it).
function Spec:flops(T)
  local f = KINDS[self.kind].flops
  return f and f(self, T) or 0
end

--- The flow a spec takes as input when it stands alone (see nn.Layer).
function Spec:input_flow(T)
  local f = KINDS[self.kind].input_flow
  if f then return f(self, T) end
  return { width = self.width, split = false }
end

---------------------------------------------------------------- modules written in Lua

local TP_SCHEMA = {
  input = opt.enum({ "replicated", "copy", "split" }, { default = "replicated" }),
  output = opt.enum({ "replicated", "reduce", "split" }, { default = "replicated" }),
  output_blocks = opt.integer{ min = 1, default = 1 },
}
-- m:parameters() entries. init names are parsed by the runtime (pg_init_from_name), the one list of them.
local PARAM_SCHEMA = {
  name = NAME, shape = opt.required(opt.list(POS, { min_len = 1, what = "a list of positive sizes" })),
  init = opt.string{ default = "normal" }, std = STD, split = "table",
}
local SPLIT_SCHEMA = { dim = opt.required(POS), blocks = POS, sizes = opt.list(POS) }

-- A module written in Lua: its widths, its tensor-parallel regions and its
-- parameters' shards (the README's "Modules written in Lua"):
--   m.in_width, m.out_width      full widths (default: the incoming width, then in_width)
--   m.tensor_parallel = {input = "replicated" | "copy" | "split",
--                        output = "replicated" | "reduce" | "split", output_blocks = k}
--   m:parameters() -> { {name=, shape= (full), init=, std=, split = {dim=, blocks=, sizes=}}, ... }
--   m.flops                      forward FLOPs per token (pipeline balancing; default 10 x width)
--   m.position_wise = true       each output row depends on its input row alone (required under context > 1,
--                                where the rows are two chunks of each sequence)
KINDS.lua = {}
function KINDS.lua.describe(self, c)
  local me, flow, T, fail, need_full = c.me, c.flow, c.T, c.fail, c.need_full
  local m = self.module
  local where = "Lua module" .. (me ~= "" and (" '" .. me .. "'") or "")
  local tp = opt.check(where, m.tensor_parallel, TP_SCHEMA, { level = 0, prefix = "tensor_parallel." })
  local input, output = tp.input, tp.output
  for k, v in pairs{ in_width = m.in_width, out_width = m.out_width } do opt.value(where, k, v, POS, 0) end
  local inw = m.in_width or flow.width
  if flow.width == 0 then fail("needs activations, receives token ids") end
  local local_in = inw
  if input == "split" then
    if flow.width ~= inw then fail("expects width %d, receives width %s", inw, tostring(flow.width)) end
    if T > 1 and not flow.split then fail("takes a split input (tensor_parallel.input = \"split\") but receives the full activation") end
    if inw % T ~= 0 then fail("tensor=%d does not divide its input width %d", T, inw) end
    if T > 1 then local_in = inw // T end
  else
    if flow.split and T > 1 then
      fail("needs the full activation, not one split over tensor=%d (or declare tensor_parallel.input = \"split\")", T)
    end
    need_full(inw)
  end
  local outw = m.out_width or inw
  local local_out = outw
  if output == "split" and T > 1 then
    if outw % T ~= 0 then fail("tensor=%d does not divide its output width %d", T, outw) end
    local_out = outw // T
  end
  local params = {}
  if m.parameters then
    for i, p in ipairs(m:parameters()) do
      p = opt.check(("%s: parameter %d"):format(where, i), p, PARAM_SCHEMA, { level = 0 })
      local d = { name = p.name or ("p" .. i), shape = p.shape, init = p.init, std = p.std }
      if p.split then
        p.split = opt.check(("%s: parameter %s"):format(where, d.name), p.split, SPLIT_SCHEMA,
          { level = 0, prefix = "split." })
        local dim, shape = p.split.dim, p.shape
        if dim > #shape then
          fail("parameter %s: split.dim must be one of its %d dimensions, got %s", d.name, #shape, tostring(dim))
        end
        local sizes = p.split.sizes
        local blocks = sizes and #sizes or p.split.blocks or 1
        local rows = sizes or {}
        if not sizes then for b = 1, blocks do rows[b] = shape[dim] // blocks end end
        local total = 0
        for b, n in ipairs(rows) do
          if n % T ~= 0 then
            fail("parameter %s: tensor=%d does not divide block %d (%d rows) of dimension %d", d.name, T, b, n, dim)
          end
          total = total + n
        end
        if total ~= shape[dim] then fail("parameter %s: its blocks add up to %d, not the %d of dimension %d", d.name, total, shape[dim], dim) end
        d.split = { dim = dim, blocks = blocks, sizes = sizes }
      end
      params[i] = d
    end
  end
  self.path = me
  return { kind = "lua", name = me, in_width = local_in, out_width = local_out, input = input, output = output,
           params = params, module = m, position_wise = m.position_wise == true },
         { width = outw, split = output == "split" and T > 1,
           blocks = output == "split" and T > 1 and tp.output_blocks or nil }
end


function KINDS.lua.params(s)
  local n = 0
  if s.module.parameters then
    for _, p in ipairs(s.module:parameters()) do
      local count = 1
      for _, d in ipairs(p.shape) do count = count * d end
      n = n + count
    end
  end
  return n
end

function KINDS.lua.flops(s, T)
  local f = s.module.flops
  if type(f) == "function" then return f(T) end
  return f or 10 * (s.module.in_width or 1)
end

function KINDS.lua.input_flow(s) return { width = s.module.in_width, split = false } end

---------------------------------------------------------------- containers

--- nn.Sequential{ m1, m2, ..., name = } (or nn.Sequential() then :add(m)).
function nn.Sequential(list)
  list = opt.check("Sequential", list, { name = NAME }, { positional = true })
  local s = spec("sequential", { children = {}, label = "Sequential", name = list.name })
  for i, m in ipairs(list) do s.children[i] = as_spec(m, "Sequential child " .. i, 3) end
  return s
end

KINDS.sequential = { -- row-wise under sequence parallelism: its children say what their rows are
  describe = function(s, c)
    local kids, flow, me = {}, c.flow, c.me
    for i, child in ipairs(s.children) do
      if child.name == nil and not child.transparent then -- unnamed: named by position, as torch's Sequential does
        kids[i], flow = child:describe(me == "" and tostring(i) or (me .. "." .. i), flow, c.T, c.sp)
      else
        kids[i], flow = child:describe(me, flow, c.T, c.sp)
      end
    end
    if #kids == 0 then c.fail("is empty") end
    return { kind = "sequential", name = me, children = kids }, flow
  end,
  params = function(s)
    local n = 0
    for _, child in ipairs(s.children) do n = n + child:num_params() end
    return n
  end,
  flops = function(s, T)
    local f = 0
    for _, child in ipairs(s.children) do f = f + child:flops(T) end
    return f
  end,
  input_flow = function(s, T) return s.children[1]:input_flow(T) end,
}

function Spec:add(m, where)
  assert(self.kind == "sequential", "add: only a Sequential takes children")
  self.children[#self.children + 1] = as_spec(m, where or "Sequential:add")
  return self
end

--- nn.Residual(inner): x + inner(x).
function nn.Residual(inner, opts)
  opts = opt.check("Residual", opts, { name = NAME })
  return spec("residual", { inner = as_spec(inner, "Residual"), name = opts.name, label = "Residual" })
end

KINDS.residual = { -- the add is row-wise; the inner module's rows end as they began
  describe = function(s, c)
    local d, out = s.inner:describe(c.me, c.flow, c.T, c.sp)
    if out.width ~= c.flow.width or out.split ~= c.flow.split then
      c.fail("its inner module maps width %s to %s: a residual needs the same width", tostring(c.flow.width),
        tostring(out.width))
    end
    if c.sp then d = sp_rows_to(c.me, d, out, c.flow.seq) end
    return { kind = "residual", name = c.me, inner = d, sequence_parallel = c.flow.seq or nil }, c.flow
  end,
  params = function(s) return s.inner:num_params() end,
  flops = function(s, T) return s.inner:flops(T) + 1 end,
  input_flow = function(s, T) return s.inner:input_flow(T) end,
}

---------------------------------------------------------------- layers

-- The tensor-parallel sizes an attention's heads allow (common.tensor_heads),
-- checked before its layers so that the message names heads, not a Linear's width.
local function heads_rule(heads, kv_heads)
  return function(T) return common.tensor_heads(T, heads, kv_heads) end
end


--- nn.Linear(in, out [, opts]) or nn.Linear{ ["in"] =, out =, bias =, parallel = "column"|"row",
-- gather_output =, blocks =, block_sizes =, init_std =, name = }. A column-parallel
-- Linear with blocks = k splits each of its k output blocks (q|k|v, gate|up)
-- over the tensor group separately; block_sizes gives unequal blocks' widths.
local LINEAR = {
  ["in"] = NEED, out = NEED, bias = opt.boolean{ default = true }, parallel = opt.enum{ "column", "row" },
  gather_output = opt.boolean, blocks = opt.integer{ min = 1, default = 1 }, block_sizes = opt.list(POS),
  init_std = STD, name = NAME,
}

function nn.Linear(a, b, opts)
  if type(a) ~= "table" then a = with_args("Linear", { ["in"] = a, out = b }, opts)
  elseif b ~= nil or opts ~= nil then error("Linear: give Linear(in, out [, opts]) or Linear{in=, out=, ...}", 2) end
  local o = opt.check("Linear", a, LINEAR)
  local s = spec("linear", {
    ["in"] = o["in"], out = o.out, bias = o.bias, parallel = o.parallel, gather_output = o.gather_output,
    blocks = o.blocks, block_sizes = o.block_sizes, init_std = o.init_std, name = o.name, label = "Linear",
  })
  if s.block_sizes then
    local sum = 0
    for _, w in ipairs(s.block_sizes) do sum = sum + w end
    if #s.block_sizes ~= s.blocks or sum ~= s.out then
      error(("Linear: block_sizes must list %d widths adding up to out=%d"):format(s.blocks, s.out), 2)
    end
  elseif s.out % s.blocks ~= 0 then
    error(("Linear: blocks=%d does not divide out=%d (give block_sizes for unequal blocks)"):format(s.blocks, s.out), 2)
  end
  return s
end

KINDS.linear = {
  -- the description's mode, which says its sequence-parallel role: column-parallel
  -- gathers this rank's rows; plain is row-wise; row-parallel needs every row of
  -- its input (and gives this rank's rows of its output)
  mode = function(s) return s.parallel or "plain" end,
  describe = function(s, c)
    local inw, outw, flow, T, fail = s["in"], s.out, c.flow, c.T, c.fail
    local d = { kind = "linear", name = c.me, ["in"] = inw, out = outw, bias = s.bias, blocks = s.blocks,
                block_sizes = s.block_sizes, init_std = s.init_std, mode = "plain",
                sequence_parallel = (s.parallel == "row" and c.sp) or flow.seq or nil }
    if s.parallel == "column" then
      c.need_full(inw)
      local sizes, ok = s.block_sizes, outw % (s.blocks * T) == 0
      if sizes then
        ok = true
        for _, w in ipairs(sizes) do ok = ok and w % T == 0 end
      end
      if not ok then
        -- with blocks (q|k|v), name the block widths too: they are the model's channels
        fail("tensor=%d does not divide the output width %d%s", T, outw, s.blocks > 1
          and (" in %d blocks of %s"):format(s.blocks, sizes and table.concat(sizes, ", ") or tostring(outw // s.blocks))
          or "")
      end
      d.mode, d.gather_output = "column", s.gather_output or false
      local split = T > 1 and not s.gather_output
      return d, { width = outw, split = split, blocks = split and s.blocks or nil, seq = false }
    elseif s.parallel == "row" then
      if inw % T ~= 0 then fail("tensor=%d does not divide the input width %d", T, inw) end
      if flow.width ~= inw then
        if flow.split and T > 1 then
          fail("row-parallel with in=%d receives a split tensor of width %d/%d", inw, flow.width, T)
        end
        if T == 1 then fail("row-parallel with in=%d receives width %d", inw, flow.width) end
        fail("row-parallel with in=%d receives an unsplit tensor of width %d (expected %d, or its split %d/%d = %d from a column-parallel layer)",
          inw, flow.width, inw, inw, T, inw // T)
      end
      d.mode, d.input_is_parallel = "row", (flow.split and T > 1) or false
      return d, { width = outw, split = false, seq = c.sp }
    end
    c.need_full(inw)
    return d, { width = outw, split = false, seq = flow.seq }
  end,
  params = function(s) return s["in"] * s.out + (s.bias and s.out or 0) end,
  flops = function(s) return 2 * s["in"] * s.out end,
  input_flow = function(s, T) return { width = s["in"], split = s.parallel == "row" and T > 1 } end,
}

--- nn.LayerNorm(dim [, {name=}]) or nn.LayerNorm{dim=, name=}.
function nn.LayerNorm(a, opts)
  if type(a) ~= "table" then a = with_args("LayerNorm", { dim = a }, opts) end
  local o = opt.check("LayerNorm", a, { dim = NEED, name = NAME })
  return spec("layernorm", { width = o.dim, name = o.name, label = "LayerNorm" })
end

KINDS.layernorm = { -- row-wise (its parameters' gradients are then summed over the tensor group)
  describe = function(s, c)
    c.need_full(s.width)
    return { kind = "layernorm", name = c.me, width = s.width, sequence_parallel = c.flow.seq or nil }, c.flow
  end,
  params = function(s) return 2 * s.width end,
  flops = function(s) return 8 * s.width end,
}

--- nn.RMSNorm(dim [, {eps=, name=}]) or nn.RMSNorm{dim=, eps=1e-5, name=}:
-- x / sqrt(mean(x^2) + eps) * weight (LLaMA's norm; no bias, no centring).
local EPS = common.EPS -- its default (1e-5) lives there, shared with the model schemas

function nn.RMSNorm(a, opts)
  if type(a) ~= "table" then a = with_args("RMSNorm", { dim = a }, opts) end
  local o = opt.check("RMSNorm", a, { dim = NEED, eps = EPS, name = NAME })
  return spec("rmsnorm", { width = o.dim, eps = o.eps, name = o.name, label = "RMSNorm" })
end

KINDS.rmsnorm = { -- row-wise (its weight's gradient is then summed over the tensor group)
  describe = function(s, c)
    c.need_full(s.width)
    return { kind = "rmsnorm", name = c.me, width = s.width, eps = s.eps, sequence_parallel = c.flow.seq or nil },
           c.flow
  end,
  params = function(s) return s.width end,
  flops = function(s) return 4 * s.width end,
}

--- The SwiGLU gate: silu(gate) * up on a [gate | up] input (split over the
-- tensor group when it comes from a column-parallel Linear with blocks = 2).
function nn.GatedSiLU(opts)
  opts = opt.check("GatedSiLU", opts, { name = NAME })
  return spec("swiglu", { name = opts.name, label = "GatedSiLU" })
end

KINDS.swiglu = { -- elementwise (row-wise): its FLOPs are priced with the Linear before it
  describe = function(s, c)
    local flow, T = c.flow, c.T
    if flow.width == 0 then c.fail("needs activations, receives token ids") end
    local split = flow.split and T > 1
    if flow.width % (split and 2 * T or 2) ~= 0 then c.fail("needs an even gate|up width, receives %d", flow.width) end
    if split and flow.blocks ~= 2 then
      c.fail("needs gate|up split block by block over tensor=%d (from a column-parallel Linear with blocks = 2)", T)
    end
    local local_w = split and flow.width // T or flow.width
    return { kind = "swiglu", name = c.me, width = local_w // 2, sequence_parallel = flow.seq or nil },
           { width = flow.width // 2, split = flow.split, seq = flow.seq }
  end,
}

function nn.GELU(opts)
  opts = opt.check("GELU", opts, { name = NAME, width = POS })
  return spec("gelu", { name = opts.name, width = opts.width, label = "GELU" })
end

KINDS.gelu = { -- elementwise (row-wise): its FLOPs are priced with the Linear before it
  describe = function(s, c)
    local flow, T = c.flow, c.T
    if flow.width == 0 then c.fail("needs activations, receives token ids") end
    local local_w = (flow.split and T > 1) and flow.width // T or flow.width
    return { kind = "gelu", name = c.me, width = local_w, sequence_parallel = flow.seq or nil }, flow
  end,
}

--- The attention core: causal softmax(QK^T/sqrt(hd))V over a fused q|k|v
-- input of (heads + 2 kv_heads) * head_dim columns. nn.Attention{dim=,
-- heads=, seq_len=, kv_heads= (default heads: grouped-query when fewer),
-- head_dim= (default dim/heads), rope_theta= (rotary embeddings on q and k,
-- transformers' rotate_half convention; default none), rope_scaling= (their
-- frequencies scaled: {rope_type = "linear" | "dynamic" | "llama3", factor =, ...},
-- transformers' keys, models/common.lua's ROPE_TYPES), alibi= (true: ALiBi's
-- per-head linear biases on the scores, BLOOM's; slopes pg.ops.alibi_slopes(heads),
-- each tensor rank its heads' slice; excludes rope_theta), name=}. Under tensor
-- parallelism query and key/value heads are both split over the group:
-- tensor must divide heads, and divide kv_heads or be a multiple of it (then
-- each rank attends with the one key/value head its query heads use, gathered
-- by a kv_heads module before the core: kind_kv_heads.c).
local THETA = opt.number{ gt = 1 }

local ATTENTION = { dim = POS, heads = NEED, seq_len = NEED, kv_heads = POS, head_dim = POS, rope_theta = THETA,
                    rope_scaling = common.ROPE_SCALING, alibi = opt.boolean, name = NAME }

function nn.Attention(o)
  o = opt.check("Attention", o, ATTENTION)
  if o.head_dim == nil and o.dim == nil then error("Attention: give dim= or head_dim=", 2) end
  local kv, hd = common.attention(o, common.raiser("Attention", 2), nil, o.rope_theta ~= nil)
  if o.alibi and o.rope_theta ~= nil then
    error(("Attention: alibi = true and rope_theta=%g exclude each other (ALiBi or rotary embeddings)"):format(
      o.rope_theta), 2)
  end
  if o.rope_scaling and o.rope_theta == nil then
    error("Attention: rope_scaling scales rotary embeddings: give rope_theta= too", 2)
  end
  return spec("attention", { width = o.heads * hd, heads = o.heads, kv_heads = kv, head_dim = hd, max_seq = o.seq_len,
                             rope_theta = o.rope_theta, rope_scaling = o.rope_scaling, alibi = o.alibi or nil,
                             name = o.name, label = "Attention" })
end

KINDS.attention = {
  describe = function(s, c)
    local flow, T = c.flow, c.T
    local rule = heads_rule(s.heads, s.kv_heads)(T)
    if rule then c.fail("%s", rule) end
    local qkv_w = (s.heads + 2 * s.kv_heads) * s.head_dim
    if flow.width ~= qkv_w then
      c.fail("expects the fused q|k|v of width %d, receives width %s", qkv_w, tostring(flow.width))
    end
    if T > 1 and not (flow.split and flow.blocks == 3) then
      c.fail("needs q|k|v split over tensor=%d block by block (from a column-parallel Linear with blocks = 3)", T)
    end
    local d = common.rope_fields(s.rope_scaling, { kind = "attention", name = c.me, heads = s.heads,
      kv_heads = s.kv_heads, head_dim = s.head_dim, max_seq = s.max_seq, rope_theta = s.rope_theta, alibi = s.alibi })
    local out = { width = s.width, split = T > 1 }
    if T <= s.kv_heads then return d, out end
    -- fewer key/value heads than ranks: each rank's one gathered whole first (kind_kv_heads.c)
    d.kv_gathered = true
    return { kind = "sequential", name = c.me, children = {
      { kind = "kv_heads", name = c.me, heads = s.heads, kv_heads = s.kv_heads, head_dim = s.head_dim }, d } }, out
  end,
  flops = function(s, T) return 2 * T * s.width end, -- QK^T and PV over the causal half
  input_flow = function(s, T)
    return { width = (s.heads + 2 * s.kv_heads) * s.head_dim, split = T > 1, blocks = 3 }
  end,
}

--- Token (+ position) embedding; vocab-parallel under tensor parallelism.
-- padded_vocab: rows of the table (>= vocab; tensor parallelism pads further to a multiple of T).
local function padded_of(where, o)
  local padded = o.padded_vocab or o.vocab
  if padded < o.vocab then error(("%s: padded_vocab=%d is smaller than vocab=%d"):format(where, padded, o.vocab), 3) end
  return padded
end

local EMBEDDING = { vocab = NEED, padded_vocab = POS, dim = NEED, positions = opt.integer{ min = 0, default = 0 },
                    init_std = STD, name = NAME }

function nn.Embedding(o)
  o = opt.check("Embedding", o, EMBEDDING)
  return spec("embedding", {
    vocab = o.vocab, padded_vocab = padded_of("Embedding", o), width = o.dim, positions = o.positions,
    init_std = o.init_std, name = o.name, label = "Embedding",
  })
end

KINDS.embedding = { -- reduce-scatters its output to this rank's rows
  describe = function(s, c)
    if c.flow.width ~= 0 then c.fail("takes token ids, but receives activations of width %d", c.flow.width) end
    return { kind = "embedding", name = c.me, vocab = s.vocab, padded_vocab = round_up(s.padded_vocab, c.T),
             width = s.width, positions = s.positions, init_std = s.init_std, sequence_parallel = c.sp or nil },
           { width = s.width, split = false, seq = c.sp }
  end,
  params = function(s) return s.vocab * s.width + s.positions * s.width end,
  flops = function(s) return 2 * s.width end,
  input_flow = function() return { width = 0, split = false } end,
}

--- LM head with the fused softmax cross-entropy. tie = true: the weight is the
-- embedding's (`tie_name`, default "embed.wte"). output = "logits": no loss;
-- it outputs the logits, split over the tensor group by vocabulary (each
-- rank its padded_vocab/T columns), for an objective written in Lua
-- (pg.parallelize's objective=).
local LMHEAD = { vocab = NEED, padded_vocab = POS, dim = NEED, tie = opt.boolean{ default = true },
                 tie_name = opt.string{ default = "embed.wte" }, init_std = STD, name = NAME,
                 output = opt.enum({ "loss", "logits" }, { default = "loss" }) }

function nn.LMHead(o)
  o = opt.check("LMHead", o, LMHEAD)
  return spec("lm_head", {
    vocab = o.vocab, padded_vocab = padded_of("LMHead", o), width = o.dim, output = o.output,
    tie = o.tie and o.tie_name or nil, init_std = o.init_std, name = o.name, label = "LMHead",
  })
end

KINDS.lm_head = { -- gathers this rank's rows
  describe = function(s, c)
    c.need_full(s.width)
    local padded = round_up(s.padded_vocab, c.T)
    local out = s.output == "logits" and { width = padded, split = true } or { width = -1, split = false }
    return { kind = "lm_head", name = c.me, vocab = s.vocab, padded_vocab = padded, output = s.output,
             width = s.width, tie = s.tie, init_std = s.init_std, sequence_parallel = c.flow.seq or nil }, out
  end,
  params = function(s) return s.tie and 0 or s.vocab * s.width end,
  flops = function(s) return 2 * s.width * s.padded_vocab + 6 * s.padded_vocab end,
}

---------------------------------------------------------------- composites

-- alibi = true: ALiBi in the core (nn.Attention's alibi=).
function nn.CausalSelfAttention(o)
  o = opt.check("CausalSelfAttention", o, { dim = NEED, heads = NEED, seq_len = NEED, proj_std = STD,
                                            alibi = opt.boolean, name = NAME })
  local proj_std = o.proj_std
  common.attention(o, common.raiser("CausalSelfAttention", 2))
  local s = nn.Sequential{
    nn.Linear{ ["in"] = o.dim, out = 3 * o.dim, parallel = "column", blocks = 3, name = "qkv" },
    nn.Attention{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, alibi = o.alibi, name = "core" },
    nn.Linear{ ["in"] = o.dim, out = o.dim, parallel = "row", init_std = proj_std, name = "proj" },
    name = o.name,
  }
  s.label = "CausalSelfAttention"
  s.tensor_rule = heads_rule(o.heads, o.heads)
  return s
end

--- LLaMA's attention: bias-free fused q|k|v (unequal blocks when kv_heads <
-- heads), rotary embeddings, grouped-query attention, bias-free output.
-- nn.LlamaAttention{dim=, heads=, kv_heads=, head_dim=, seq_len=, rope_theta=10000, rope_scaling=, init_std=, name=}
-- (rope_scaling: transformers' config.json table, models/common.lua's ROPE_TYPES)
local LLAMA_ATTENTION = { dim = NEED, heads = NEED, kv_heads = POS, head_dim = POS, seq_len = NEED, rope_theta = THETA,
                          rope_scaling = common.ROPE_SCALING, init_std = STD, name = NAME }

function nn.LlamaAttention(o)
  o = opt.check("LlamaAttention", o, LLAMA_ATTENTION)
  local kv, hd = common.attention(o, common.raiser("LlamaAttention", 2), nil, true) -- rotary always (rope_theta 10000)
  local q_w, kv_w = o.heads * hd, kv * hd
  local s = nn.Sequential{
    nn.Linear{ ["in"] = o.dim, out = q_w + 2 * kv_w, bias = false, parallel = "column", blocks = 3,
               block_sizes = { q_w, kv_w, kv_w }, init_std = o.init_std, name = "qkv" },
    nn.Attention{ heads = o.heads, kv_heads = kv, head_dim = hd, seq_len = o.seq_len,
                  rope_theta = o.rope_theta or 10000, rope_scaling = o.rope_scaling, name = "core" },
    nn.Linear{ ["in"] = q_w, out = o.dim, bias = false, parallel = "row", init_std = o.init_std, name = "proj" },
    name = o.name,
  }
  s.label = "LlamaAttention"
  s.tensor_rule = heads_rule(o.heads, kv)
  return s
end

--- The SwiGLU MLP: down(silu(gate(x)) * up(x)), gate|up fused into one
-- bias-free column-parallel Linear ("fc", blocks = 2), down row-parallel ("proj").
function nn.SwiGLU(o)
  o = opt.check("SwiGLU", o, { dim = NEED, hidden = NEED, init_std = STD, name = NAME })
  local s = nn.Sequential{
    nn.Linear{ ["in"] = o.dim, out = 2 * o.hidden, bias = false, parallel = "column", blocks = 2,
               init_std = o.init_std, name = "fc" },
    nn.GatedSiLU{ name = "act" },
    nn.Linear{ ["in"] = o.hidden, out = o.dim, bias = false, parallel = "row", init_std = o.init_std, name = "proj" },
    name = o.name,
  }
  s.label = "SwiGLU"
  return s
end

--- Mixtral's sparse feed-forward block (mixture of experts): a router
-- Linear(dim -> experts, no bias) named "gate", softmax, each token's top_k
-- experts with their probabilities renormalised, and the weighted sum of
-- those experts' SwiGLU MLPs ("experts.<e>.w1" gate, "w3" up, "w2" down;
-- transformers' names). nn.MoE{dim=, hidden= (each expert's), experts=,
-- top_k=2, aux_loss_coef=0.001 (transformers' router_aux_loss_coef default),
-- z_loss_coef=0, init_std=, name=}. The auxiliary losses join the training
-- objective (engine:losses() reports them apart): aux_loss_coef x
-- transformers' load_balancing_loss_func over all the model's MoE layers,
-- z_loss_coef x the mean over tokens and layers of logsumexp(router logits)^2.
-- Under tensor parallelism each expert's w1/w3 are column-parallel and w2
-- row-parallel (tensor must divide hidden), the router replicated. Under
-- expert parallelism (ParallelContext{expert = E}) each rank of an expert
-- group holds experts / E experts (E must divide experts) and tokens reach
-- them by all-to-all; results equal the serial model's to rounding.
-- capacity_factor = c (default nil: no token dropped): each expert takes at
-- most ceil(c x seq_len x top_k / experts) choices of each sequence, first
-- choices before second ones and earlier tokens first; the others add 0 (the
-- residual carries the token). Per sequence, so every layout drops the same.
-- jitter = j (default 0): in training the router's input (not the experts')
-- is multiplied by uniform noise in [1 - j, 1 + j] (Switch Transformer's),
-- a function of (seed, layer, step, token's row in the global batch,
-- feature): every layout and a recomputation draw the same. Runs on the cpu
-- backend only for now.
-- top_k's default (2) is the one place of it: the Mixtral schemas and planner shape read MOE.top_k, the
-- runtime requires the value (kind_moe.c)
local MOE = { dim = NEED, hidden = NEED, experts = NEED, top_k = opt.integer{ min = 1, default = 2 },
              aux_loss_coef = opt.number{ min = 0, default = 0.001 }, z_loss_coef = opt.number{ min = 0, default = 0 },
              capacity_factor = opt.number{ gt = 0 }, jitter = opt.number{ min = 0, default = 0 },
              init_std = STD, name = NAME }

local function check_moe(where, o)
  if o.top_k > o.experts then
    error(("%s: top_k=%d exceeds experts=%d"):format(where, o.top_k, o.experts), 3)
  end
  if o.jitter >= 1 then
    error(("%s: jitter=%s must be below 1 (the router's input is multiplied by noise in [1 - jitter, 1 + jitter])")
      :format(where, tostring(o.jitter)), 3)
  end
end

function nn.MoE(o)
  o = opt.check("MoE", o, MOE)
  check_moe("MoE", o)
  return spec("moe", { width = o.dim, hidden = o.hidden, experts = o.experts, top_k = o.top_k,
                       aux_loss_coef = o.aux_loss_coef, z_loss_coef = o.z_loss_coef, init_std = o.init_std,
                       capacity_factor = o.capacity_factor, jitter = o.jitter, name = o.name, label = "MoE" })
end

KINDS.moe = {
  describe = function(s, c)
    c.need_full(s.width)
    if s.hidden % c.T ~= 0 then c.fail("tensor=%d does not divide the experts' hidden width %d", c.T, s.hidden) end
    -- layer / layers: which of the model's MoE layers this is (pg.parallelize numbers them)
    return { kind = "moe", name = c.me, dim = s.width, hidden = s.hidden, experts = s.experts, top_k = s.top_k,
             aux_loss_coef = s.aux_loss_coef, z_loss_coef = s.z_loss_coef, init_std = s.init_std,
             capacity_factor = s.capacity_factor or 0, jitter = s.jitter, layer = 0, layers = 1 },
           { width = s.width, split = false }
  end,
  params = function(s) return s.experts * (s.width + 3 * s.width * s.hidden) end,
  -- per token: the router, and top_k experts' three matrices
  flops = function(s) return 2 * s.width * s.experts + s.top_k * 6 * s.width * s.hidden end,
}

function nn.MLP(o)
  o = opt.check("MLP", o, { dim = NEED, hidden = POS, proj_std = STD, name = NAME })
  local hidden = o.hidden or 4 * o.dim
  local s = nn.Sequential{
    nn.Linear{ ["in"] = o.dim, out = hidden, parallel = "column", name = "fc" },
    nn.GELU{ name = "gelu" },
    nn.Linear{ ["in"] = hidden, out = o.dim, parallel = "row", init_std = o.proj_std, name = "proj" },
    name = o.name,
  }
  s.label = "MLP"
  return s
end

--- nn.PreNorm(norm, inner): the pre-norm residual branch x + inner(norm(x)).
-- Its wrappers are transparent: parameter names read blocks.3.ln1.weight and
-- blocks.3.attn.qkv.weight, not blocks.3.1.2.attn...
function nn.PreNorm(norm, inner)
  local seq = nn.Sequential{ as_spec(norm, "PreNorm: the norm"), as_spec(inner, "PreNorm: the inner module") }
  seq.transparent = true
  local r = nn.Residual(seq)
  r.transparent = true
  r.label = "PreNorm"
  return r
end

---------------------------------------------------------------- model families

-- pg.nn.GPT, pg.nn.Llama, pg.nn.Mixtral and their blocks (TransformerBlock,
-- LlamaBlock, MixtralBlock), pg.nn.GPT.load_llmc, pg.nn.from_hf and
-- pg.nn.from_config are defined by lua/pipegoose/models/: one file a family,
-- models/init.lua the registry. These are the parts of this file they build with.
nn.parts = { STD = STD, MOE = MOE, check_moe = check_moe, padded_of = padded_of }
require("pipegoose.models").install(nn)

---------------------------------------------------------------- standalone layers

--- nn.Layer(spec, ctx [, {seed=, input={width=, split=}}]): one module on its own
-- (this rank's shard under tensor parallelism), with flat parameters like an
-- engine's: layer:forward(x [, targets]), layer:backward([dy]), layer:params(),
-- layer:gather_param(name [, grad]), layer:zero_grad().
local LAYER = { seed = opt.integer{ min = math.mininteger, max = math.maxinteger },
                input = opt.check_with("a flow {width=, split=, blocks=}", function(v) return type(v) == "table" end) }

function nn.Layer(s, ctx, opts)
  local core = require "pipegoose.core"
  opts = opt.check("Layer", opts, LAYER)
  s = as_spec(s, "Layer")
  ctx = opt.value("Layer", "ctx", ctx, opt.context) or core.ParallelContext{}
  local T = ctx:world_size("tensor")
  local flow = opts.input or s:input_flow(T)
  if flow.width == nil then error("Layer: give the input width: opts.input = {width = ...}", 2) end
  local ok, desc = pcall(s.describe, s, "", flow, T)
  if not ok then error("Layer: " .. tostring(desc), 2) end
  local layer = core.Layer(ctx, desc, { seed = opts.seed })
  if (kind_traits(desc.kind) or {}).written_in_lua then -- a module written in Lua: its parameter views
    local m = s.module
    m.params, m.grads = {}, {}
    for _, p in ipairs(layer:params()) do
      local short = desc.name == "" and p.name or p.name:sub(#desc.name + 2)
      m.params[short], m.grads[short] = p.tensor, p.grad
    end
  end
  return layer
end

--- The top-level modules a pipeline cuts between.
function Spec:top_level()
  if self.kind == "sequential" then return self.children end
  return { self }
end

return nn
