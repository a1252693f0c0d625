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
-- nil, or the message (query and key/value heads are both split over the
-- tensor group; key/value heads are not replicated). pg.nn's attention
-- modules and the planner's enumeration ask this; the C runtime
-- (kind_attention.c) guards its own inputs again.
function C.tensor_heads(T, heads, kv_heads)
  if heads % T ~= 0 then return ("tensor=%d does not divide heads=%d"):format(T, heads) end
  if kv_heads % T ~= 0 then
    return ("tensor=%d does not divide kv_heads=%d (key/value heads are split over the tensor group, not replicated)")
      :format(T, kv_heads)
  end
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

function C.positive_int(dir, cfg, key)
  local v = math.tointeger(C.value(cfg[key])) -- cjson reads every number as a float
  if not v or v < 1 then
    C.fail(dir, "config.json: %s must be a positive integer, got %s", key, tostring(C.value(cfg[key])))
  end
  return v
end

function C.number(dir, cfg, key)
  local v = C.value(cfg[key])
  if type(v) ~= "number" then C.fail(dir, "config.json: %s must be a number, got %s", key, tostring(v)) end
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
