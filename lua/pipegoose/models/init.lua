--- pipegoose.models: the model families, one file each
-- (lua/pipegoose/models/<family>.lua), and their registry.
--
-- A family is a table:
--   name          its name, the model config's `arch` ("gpt2"; a model
--                 config without arch is DEFAULT's)
--   label         the pg.nn constructor's name in messages ("GPT")
--   aliases       other names for it (optional: the planner's shapes say "gpt")
--   schema        the constructor's option schema (pipegoose.options)
--   build(o)      the pg.nn spec of options o
--   install(nn)   defines its pg.nn constructors (pg.nn.GPT, its blocks ...);
--                 nn.lua calls models.install(nn) as it loads
--   config_keys   the integer fields a model config must have for the exports
--   hf            its Hugging Face mapping: class, model_type, prefix,
--                 defaults (the config class's, of the fields options reads),
--                 options(dir, cfg) -> pg.nn options (config.json's one
--                 reader: the importer and the planner use it; cfg answers an
--                 absent field with its default; refuses what pipegoose does
--                 not compute, naming the field), layout(o) -> entries
--                 (models/common.lua's C.entry: parts, Conv1D, the
--                 permutation hook), config(cfg) -> the config.json fields
--                 pipegoose computes (written over an imported file's) and
--                 the defaults of a model built in pipegoose, dropout: the
--                 config's dropout fields -> transformers' defaults (the
--                 import refuses non-zero ones unless dropout = "ignore")
--   llmc          llm.c's model file mapping (GPT-2 only): refusal(cfg), layout(cfg)
--   plan          the planner's: features (norm, gated_mlp, activation,
--                 learned_positions, rope, dropout, biases, tied: the fields
--                 plan/ tests, never a family's name), shape(o) -> a planner
--                 shape of pg.nn options or a model config, presets (name -> sizes)
-- generic machinery stays outside: hf.lua (safetensors, the sharded index,
-- loading and writing), llmc.lua (the file's header and offsets), plan/.
local M = {}

--- The families, in the order messages list them.
M.NAMES = { "gpt2", "llama", "mixtral", "bloom" }
M.DEFAULT = "gpt2" -- the family of a model config without arch

local by_name, by_model_type, list = {}, {}, {}
for i, name in ipairs(M.NAMES) do
  local f = require("pipegoose.models." .. name)
  list[i] = f
  by_name[name] = f
  for _, a in ipairs(f.aliases or {}) do by_name[a] = f end
  if f.hf then by_model_type[f.hf.model_type] = f end
end

--- The families (tables), in M.NAMES's order.
function M.list() return list end

local function known() return table.concat(M.NAMES, ", ") end

--- The family of a name (or alias); an unknown one is an error naming the
-- known ones, prefixed with `where` (default "pipegoose").
function M.get(name, where)
  local f = by_name[name]
  if not f then
    error(("%s: unknown model family '%s' (known: %s)"):format(where or "pipegoose", tostring(name), known()), 0)
  end
  return f
end

--- The family of a model config (an engine's config, a checkpoint's model record, pg.nn options).
function M.of_config(cfg, where)
  return M.get(cfg.arch == nil and M.DEFAULT or cfg.arch, where)
end

--- The family of a Hugging Face model_type, or nil and the list of what is
-- known ('GPT2LMHeadModel ("gpt2"), ...') for the caller's message.
function M.of_hf_model_type(mt)
  local f = type(mt) == "string" and by_model_type[mt] or nil
  if f then return f end
  local names = {}
  for i, fam in ipairs(list) do names[i] = ("%s (\"%s\")"):format(fam.hf.class, fam.hf.model_type) end
  return nil, table.concat(names, ", ", 1, #names - 1) .. " and " .. names[#names]
end

--- Defines every family's pg.nn constructors, and pg.nn.from_hf and
-- pg.nn.from_config (nn.lua calls it once).
function M.install(nn)
  for _, f in ipairs(list) do f.install(nn) end
  local opt = require "pipegoose.options"

  --- pg.nn.from_hf(dir): the model of a Hugging Face `transformers` directory
  -- (config.json + model.safetensors, or the sharded index) with its weights,
  -- loaded by pg.parallelize (each rank its shards): GPT2LMHeadModel (a
  -- pg.nn.GPT), LlamaForCausalLM (a pg.nn.Llama), MixtralForCausalLM (a
  -- pg.nn.Mixtral) or BloomForCausalLM (a pg.nn.Bloom); lua/pipegoose/hf.lua has the machinery, each family's
  -- file its conventions.
  -- opts.dropout: "refuse" (default: a config.json with non-zero dropout is refused, naming the fields,
  -- pipegoose having none) or "ignore" (train without it; the export writes the fields back as read).
  -- The model carries the directory's tokenizer (model.tokenizer, pg.tokenizer.load(dir)) when it has
  -- tokenizer.json, and config.json's text (its config's hf_config), which engine:save_hf writes back.
  -- opts.unused: "refuse" (default: tensors in the weights that the model does not use are refused, listing
  -- them, but for the buffers transformers drops on load) or "ignore" (load the model's and leave the rest).
  local FROM_HF = { dropout = opt.enum({ "refuse", "ignore" }, { default = "refuse" }),
                    unused = opt.enum({ "refuse", "ignore" }, { default = "refuse" }) }
  function nn.from_hf(dir, opts)
    opt.value("from_hf", "dir", dir, opt.required(opt.string))
    opts = opt.check("from_hf", opts, FROM_HF)
    local hf = require "pipegoose.hf"
    local o, model_type, text, cfg = hf.read_config(dir)
    if opts.dropout == "refuse" then
      local why = hf.dropout_refusal(cfg, dir)
      if why then error(why, 2) end
    end
    o.hf_config = text
    local m = M.of_hf_model_type(model_type).build(o)
    hf.check_weights(dir, o, model_type, opts.unused)
    m.weights = { format = "hf", path = dir }
    local core = require "pipegoose.core"
    if core.fs.exists(dir .. "/tokenizer.json") then m.tokenizer = require("pipegoose.tokenizer").load(dir) end
    return m
  end
  nn.GPT.from_hf = nn.from_hf

  --- pg.nn.from_config(cfg): the model a config table describes (an engine's
  -- `config`, a checkpoint's `model` record): the family its arch names
  -- (pg.nn.Llama for "llama", pg.nn.Mixtral for "mixtral"; GPT-2's config has no arch).
  function nn.from_config(cfg)
    if type(cfg) ~= "table" then error("from_config: needs a model config table", 2) end
    local f = by_name[cfg.arch == nil and M.DEFAULT or cfg.arch]
    if not f or f.name ~= (cfg.arch or M.DEFAULT) then
      error(("from_config: unknown architecture '%s' (%s)"):format(tostring(cfg.arch), known()), 2)
    end
    local o = {}
    for k, v in pairs(cfg) do if k ~= "arch" then o[k] = v end end
    return f.build(o)
  end
end

return M
