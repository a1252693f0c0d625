--- pipegoose.models.common: what the family files (lua/pipegoose/models/)
-- share: the attention's shape rules, config.json's field readers and the
-- Hugging Face layout entry.
local cjson = require "cjson"
local opt = require "pipegoose.options"

local C = {}

---------------------------------------------------------------- the builders' shared parts

-- option kinds of the model schemas (as pg.nn's modules spell them)
C.POS = opt.integer{ min = 1 }
C.NEED = opt.required(C.POS)
-- pg.nn's standard deviation of initial values (GPT-2's 0.02): the one place of it (nn.lua's STD default,
-- GPT-2's scaled projections, the initializer_range the Hugging Face writers record); the runtime requires
-- init_std / std in a description (module_registry.c's desc_number_required)
C.INIT_STD = 0.02
-- LayerNorm's eps is the runtime's, fixed (kernels.h PG_LAYERNORM_EPS, no option): the Hugging Face readers
-- refuse another and the writers record it
C.LAYERNORM_EPS = 1e-5
-- RMSNorm's eps: this default (1e-5) is the one place of it (pg.nn.RMSNorm and the model schemas use
-- C.EPS); the runtime requires the value in a description (kind_norms.c)
C.EPS = opt.number{ min = 0, default = 1e-5 }
C.THETA = opt.number{ gt = 1 }
C.NAME = opt.string
C.HEAD = opt.enum({ "loss", "logits", "none" }, { default = "loss" })
-- hf_config: the text of the config.json a model was imported from (pg.nn.from_hf keeps it in the model
-- config, so that a checkpoint's manifest records it): engine:save_hf writes its fields back, over them
-- only what pipegoose computes. Text, not a table: it passes through the manifest exactly (JSON null,
-- empty lists, every digit)
C.HF_CONFIG = opt.string

--- The model's head as o.head asks ("loss": the LM head with the fused
-- cross-entropy, "logits": its logits, "none": no head); the config records
-- head only when it is not the default.
function C.add_head(nn, model, o, padded, tie)
  if o.head ~= "none" then
    model:add(nn.LMHead{ vocab = o.vocab, padded_vocab = padded, dim = o.dim, tie = tie, name = "head", output = o.head })
  end
  if o.head ~= "loss" then model.config.head = o.head end
end

---------------------------------------------------------------- the attention's shape, the one place of its rules

--- The attention's key/value heads and head width from o = {dim, heads,
-- kv_heads, head_dim}: kv_heads defaults to heads (grouped-query attention
-- when fewer), head_dim to dim / heads. Checks that heads divides dim (when
-- head_dim is not given), that kv_heads divides heads and, with rope, that
-- head_dim is even (rotary embeddings rotate pairs). A broken rule calls
-- fail(message); names (optional) words it: { dim =, heads =, kv_heads =,
-- sep = } give the fields' names and what joins a name to its value
-- (default: the pg.nn option names, "=": "dim=30 is not divisible by heads=4").
-- Every Lua reader of a shape (the builders, config.json's readers, the
-- planner) asks this function; the modules and the C runtime guard their own
-- inputs again.
function C.attention(o, fail, names, rope)
  names = names or {}
  local sep = names.sep or "="
  local function say(k, v) return (names[k] or k) .. sep .. tostring(v) end
  local kv = o.kv_heads or o.heads
  if o.head_dim == nil and o.dim % o.heads ~= 0 then
    fail(("%s is not divisible by %s"):format(say("dim", o.dim), say("heads", o.heads)))
  end
  local hd = o.head_dim or o.dim // o.heads
  if o.heads % kv ~= 0 then
    fail(("%s does not divide %s"):format(say("kv_heads", kv), say("heads", o.heads)))
  end
  if rope and hd % 2 ~= 0 then fail(("rotary embeddings need an even head_dim, got %d"):format(hd)) end
  return kv, hd
end

--- Whether tensor parallelism of size T can split an attention's heads:
-- nil, or the message. Query heads are split over the tensor group; so are
-- key/value heads when T divides them, and when there are fewer of them T
-- must be a multiple of kv_heads: each rank then attends with the one
-- key/value head its query heads use, gathered from the ranks holding its
-- pieces (nn.Attention's kv_heads module, kind_kv_heads.c). pg.nn's
-- attention modules and the planner's enumeration ask this; the C runtime
-- (kind_attention.c, kind_kv_heads.c) guards its own inputs again.
function C.tensor_heads(T, heads, kv_heads)
  if heads % T ~= 0 then return ("tensor=%d does not divide heads=%d"):format(T, heads) end
  if kv_heads % T ~= 0 and T % kv_heads ~= 0 then
    return ("tensor=%d neither divides kv_heads=%d nor is a multiple of it (key/value heads are split over the "
      .. "tensor group, or each replicated over tensor / kv_heads ranks)"):format(T, kv_heads)
  end
end

---------------------------------------------------------------- rotary scaling, the one place of its rules

-- The rope_scaling types pipegoose computes (transformers 4.45.2's
-- modeling_rope_utils.py; the arithmetic is kernels/cpu/rope.c's
-- pg_rope_inv_freq): the keys each needs (true) or accepts (false), as
-- transformers' _validate_* functions list them. "dynamic" rescales only
-- sequences longer than max_position_embeddings (seq_len), which pipegoose
-- never runs: at every length it trains its frequencies are the plain ones.
C.ROPE_TYPES = {
  default = {},
  linear = { factor = true },
  dynamic = { factor = true, original_max_position_embeddings = false },
  llama3 = { factor = true, low_freq_factor = true, high_freq_factor = true, original_max_position_embeddings = true },
}

--- Checks a rope_scaling table (transformers' keys: rope_type, or the older
-- type, and the type's numbers; a JSON null reads as absent): nil and a copy,
-- or the message (without the field's name).
function C.rope_scaling_problem(v)
  if type(v) ~= "table" then return ("must be a table {rope_type = ..., factor = ...}, got %s"):format(tostring(v)) end
  local rt, ty = C.value(v.rope_type), C.value(v.type)
  if rt ~= nil and ty ~= nil and rt ~= ty then
    return ("has rope_type %s and type %s (the same field, old and new names): give one"):format(tostring(rt), tostring(ty))
  end
  local name = rt or ty
  local keys = C.ROPE_TYPES[name]
  if not keys then
    return ("type %s is not supported (pipegoose computes default, dynamic, linear and llama3)"):format(tostring(name))
  end
  local copy = {}
  for k, x in pairs(v) do
    if k ~= "rope_type" and k ~= "type" and keys[k] == nil then
      return ("%s: %s is not a field of this type"):format(name, tostring(k))
    end
    copy[k] = C.value(x)
  end
  for k, needed in pairs(keys) do
    local x = C.value(v[k])
    if x == nil and needed then return ("%s needs %s"):format(name, k) end
    if x ~= nil and (type(x) ~= "number" or not (x > 0 and x < math.huge)) then
      return ("%s: %s must be a positive number, got %s"):format(name, k, tostring(x))
    end
    copy[k] = x
  end
  if name == "llama3" then
    if not (v.high_freq_factor > v.low_freq_factor) then
      return ("llama3: high_freq_factor (%s) must exceed low_freq_factor (%s)"):format(v.high_freq_factor, v.low_freq_factor)
    end
    if math.tointeger(v.original_max_position_embeddings) == nil then
      return ("llama3: original_max_position_embeddings must be an integer, got %s"):format(v.original_max_position_embeddings)
    end
  end
  return nil, copy
end

-- The option kind of rope_scaling= (pg.nn.Llama, LlamaBlock, LlamaAttention, Attention)
C.ROPE_SCALING = opt.validator("a rope_scaling table {rope_type = \"linear\" | \"dynamic\" | \"llama3\", factor = ...}",
  function(v)
    local msg, copy = C.rope_scaling_problem(v)
    if msg then return false, "a rope_scaling table: " .. msg end
    return true, copy
  end)

--- The attention descriptor's fields of a (checked) rope_scaling table: what
-- kind_attention.c reads (rope_type, rope_factor, ...); none for nil.
function C.rope_fields(rs, into)
  into = into or {}
  if rs then
    into.rope_type = rs.rope_type or rs.type
    into.rope_factor, into.rope_low_freq_factor = rs.factor, rs.low_freq_factor
    into.rope_high_freq_factor, into.rope_original_max = rs.high_freq_factor, rs.original_max_position_embeddings
  end
  return into
end

--- A fail function for C.attention that raises "where: message" at `level`
-- (as error's level, counted from the function that calls C.attention; nil:
-- no position).
function C.raiser(where, level)
  return function(msg) error(where .. ": " .. msg, level and level + 2 or 0) end
end

---------------------------------------------------------------- config.json fields

C.null = cjson.null

--- A config.json value: a JSON null reads as absent.
function C.value(v) if v == cjson.null then return nil end return v end

function C.fail(dir, fmt, ...) error(("%s: " .. fmt):format(dir, ...), 0) end

--- A config.json value as the file spells it (JSON), for messages.
function C.show(v)
  if v == nil or v == cjson.null then return "null" end
  if type(v) == "number" then
    if v ~= v then return "NaN" end
    if v == math.huge or v == -math.huge then return v > 0 and "Infinity" or "-Infinity" end
    if math.tointeger(v) then return ("%d"):format(math.tointeger(v)) end
    return ("%.17g"):format(v)
  end
  local ok, text = pcall(cjson.encode, v)
  return ok and (text:gsub("\\/", "/")) or tostring(v)
end

-- config.json's fields as transformers reads them: a JSON number where a
-- number is read (a string "16" is not one: Python would not compute with
-- it), an integral one where an int is; JSON true / false for a flag (Python
-- would take "false" and 1 as truthy, 0 as false: what the writer meant is
-- unknown, so it is refused, naming the field).
function C.positive_int(dir, cfg, key)
  local raw = C.value(cfg[key])
  local v = type(raw) == "number" and math.tointeger(raw) or nil -- cjson reads every number as a float
  if not v or v < 1 then
    C.fail(dir, "config.json: %s must be a positive integer, got %s", key, C.show(raw))
  end
  return v
end

function C.number(dir, cfg, key)
  local v = C.value(cfg[key])
  if type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge then
    C.fail(dir, "config.json: %s must be a finite number, got %s", key, C.show(v))
  end
  return v
end

--- A flag: true or false (a null or an absent field without a default: false, as Python's None).
function C.flag(dir, cfg, key)
  local v = C.value(cfg[key])
  if v == nil then return false end
  if type(v) ~= "boolean" then
    C.fail(dir, "config.json: %s must be true or false (a JSON boolean), got %s", key, C.show(v))
  end
  return v
end

--- A name (a JSON string), or nil for null / absent.
function C.name(dir, cfg, key)
  local v = C.value(cfg[key])
  if v ~= nil and type(v) ~= "string" then
    C.fail(dir, "config.json: %s must be a string, got %s", key, C.show(v))
  end
  return v
end

--- C.attention's names for config.json's fields (LLaMA's and Mixtral's).
C.HF_ATTENTION_NAMES = { dim = "hidden_size", heads = "num_attention_heads", kv_heads = "num_key_value_heads",
                         sep = " " }

---------------------------------------------------------------- Hugging Face layout entries

--- A layout entry: {pg = pipegoose's name, parts = {{hf =, shape =}, ...}
-- (the file tensors whose rows, concatenated in this order, make the
-- parameter), conv1d = stored transposed ([in, out]; one part only), top =
-- outside the model prefix (lm_head), permute = the permutation hook}.
--
-- The permutation hook, for layouts that are not concatenations of parts
-- (BLOOM's per-head interleaved q|k|v): permute = { to_pg = f, to_hf = g },
-- each a function (t, o) -> tensor, with o the pg.nn options (the model
-- config). t is the whole parameter in pipegoose's orientation ([out, in]
-- for a matrix: Conv1D already transposed; a vector for a bias) with its
-- padding rows dropped; the hook reorders its first dimension only:
-- to_pg(t, o) takes the file's order (the parts concatenated) to pipegoose's,
-- to_hf(t, o) takes pipegoose's back to the file's. They must return new
-- tensors of t's shape, be exact inverses of each other (no arithmetic:
-- every value moves, none changes) and depend on t and o alone: hf.lua calls
-- to_pg on every rank before engine:load_param keeps the rank's shard, and
-- to_hf on the rank that gathered the full tensor before cutting it into the
-- parts. BLOOM's query_key_value uses one (models/bloom.lua); spec/unit/models_spec.lua checks the contract.
function C.entry(pg, parts, conv1d, permute)
  local e = { pg = pg, parts = {}, conv1d = conv1d, permute = permute }
  for i, p in ipairs(parts) do e.parts[i] = { hf = p[1], shape = p[2] } end
  e.shape = #parts == 1 and parts[1][2] or nil
  return e
end

--- Appends one layer's entries to a layout, each named under the layer's
-- prefixes: pipegoose's `b` ("blocks.3.") and the file's `h` ("h.3.").
function C.add_layer(out, b, h, entries)
  for _, e in ipairs(entries) do
    e.pg, e.parts[1].hf = b .. e.pg, h .. e.parts[1].hf
    out[#out + 1] = e
  end
end

--- Appends the head's entry when it is not tied to the embedding: lm_head,
-- [V, C], stored outside the model prefix (transformers' convention).
function C.add_untied_head(out, o, V, dim)
  if o.tie then return end
  local head = C.entry("head.weight", { { "lm_head.weight", { V, dim } } })
  head.top = true
  out[#out + 1] = head
end

--- A copy of a table (one level).
function C.copy(t)
  local out = {}
  for k, v in pairs(t) do out[k] = v end
  return out
end

return C
