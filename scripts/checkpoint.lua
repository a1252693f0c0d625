-- Checkpoint tools, on one process (no mpirun):
--
--   pglua scripts/checkpoint.lua info DIR                  the manifest in short, and the files
--   pglua scripts/checkpoint.lua verify DIR                what loading checks: the manifest's seal and fields, every
--                                                          file's name, size, crc32 and header (exit 1 naming the
--                                                          file and the field)
--   pglua scripts/checkpoint.lua seal DIR [--force]        validates, then seals the manifest (manifest_crc32): for
--                                                          checkpoints saved before manifests were sealed; --force
--                                                          re-seals a manifest edited on purpose
--   pglua scripts/checkpoint.lua consolidate DIR OUT [--optimizer]
--                                                          one safetensors file of full tensors
--                                                          (with --optimizer also m/<name>, v/<name>)
--   pglua scripts/checkpoint.lua export-llmc DIR OUT [--bf16]
--                                                          GPT-2 weights as an llm.c model file (--bf16: llm.c's
--                                                          bf16 file, version 5)
--   pglua scripts/checkpoint.lua export-hf DIR OUTDIR [--bf16|--f16] [--tokenizer=PATH] [--max-shard-size=5GB]
--                                          [--overwrite]
--                                                          a Hugging Face directory (transformers' pipeline loads
--                                                          it; --bf16 / --f16: BF16 / F16 tensors and torch_dtype;
--                                                          --tokenizer: a tokenizer.json or a directory with one,
--                                                          whose files the export holds; the whole OUTDIR replaced)
--
-- DIR is a checkpoint directory, or a directory with a `latest` file (the
-- newest checkpoint in it). docs/FORMATS.md ("Checkpoints") describes the files.
local ckpt = require "pipegoose.checkpoint"

local USAGE = "usage: pglua scripts/checkpoint.lua info|verify|seal|consolidate|export-llmc|export-hf DIR [OUT] "
  .. "[--optimizer] [--force] [--bf16] [--f16] [--tokenizer=PATH] [--max-shard-size=SIZE] [--overwrite]"

-- --help: the commands as the header above lists them
local HELP = [[
Usage: checkpoint.lua [-h] COMMAND DIR [OUT] [--optimizer] [--force] [--bf16] [--f16] [--tokenizer=PATH]
                      [--max-shard-size=SIZE] [--overwrite]

Checkpoint tools, on one process (no mpirun). DIR is a checkpoint directory, or a
directory with a `latest` file (the newest checkpoint in it).

Commands:
   info DIR                      the manifest in short, and the files
   verify DIR                    what loading checks: the manifest's seal and fields, every file's
                                 name, size, crc32 and header (exit 1 naming the file and the field)
   seal DIR [--force]            validates, then seals the manifest (manifest_crc32); --force
                                 re-seals a manifest edited on purpose
   consolidate DIR OUT [--optimizer]
                                 one safetensors file of full tensors (--optimizer: also m/<name>, v/<name>)
   export-llmc DIR OUT [--bf16]  GPT-2 weights as an llm.c model file (--bf16: llm.c's bf16 file, version 5)
   export-hf DIR OUTDIR [--bf16|--f16] [--tokenizer=PATH] [--max-shard-size=SIZE] [--overwrite]
                                 a Hugging Face directory (transformers' pipeline loads it): config.json,
                                 generation_config.json, the weights (sharded above SIZE, default 5GB),
                                 the tokenizer's files (--tokenizer: a tokenizer.json or a directory);
                                 --bf16 / --f16: BF16 / F16 tensors; OUTDIR is replaced whole (an existing
                                 one must be a Hugging Face directory, or --overwrite)

Options:
   -h, --help                    Show this help message and exit.
]]

local args, flags = {}, {}
for _, a in ipairs(arg) do
  if a == "-h" or a == "--help" then
    io.write(HELP)
    os.exit(0)
  end
  local k, v = a:match("^(%-%-[%w-]+)=(.*)$")
  if k then flags[k] = v elseif a:match("^%-%-") then flags[a] = true else args[#args + 1] = a end
end
local cmd, dir, out = args[1], args[2], args[3]

local function die(msg)
  io.stderr:write(msg, "\n")
  os.exit(1)
end

for f in pairs(flags) do
  local valued = f == "--tokenizer" or f == "--max-shard-size"
  if not valued and f ~= "--optimizer" and f ~= "--force" and f ~= "--bf16" and f ~= "--f16" and f ~= "--overwrite" then
    die(("checkpoint.lua: unknown flag %s\n%s"):format(f, USAGE))
  end
  if valued ~= (type(flags[f]) == "string") then
    die(("checkpoint.lua: %s %s\n%s"):format(f, valued and "needs a value (--flag=VALUE)" or "takes no value", USAGE))
  end
end
if not cmd or not dir then die(USAGE) end

local commands = {}

function commands.info()
  local lines = ckpt.info(dir)
  print(table.concat(lines, "\n"))
end

function commands.verify()
  local path = ckpt.resolve(dir)
  local problems, manifest = ckpt.verify(path)
  if #problems > 0 then
    for _, p in ipairs(problems) do io.stderr:write(p, "\n") end
    os.exit(1)
  end
  local n, bytes = 0, 0
  for _, f in ipairs(manifest.tensor_state.files) do
    n, bytes = n + 1, bytes + (f.bytes or 0)
  end
  print(("OK: %s (step %d): the manifest and %d files (%d bytes) verified"):format(path, manifest.step, n, bytes))
end

function commands.seal()
  local path, crc, old, matched = ckpt.seal_dir(dir, { force = flags["--force"] })
  local before = old == nil and "it had no seal" or matched and "it was sealed already"
    or ("it had %08x, which did not match its contents"):format(old)
  print(("sealed %s/manifest.json: manifest_crc32 %08x (%s)"):format(path, crc, before))
end

function commands.consolidate()
  if not out then die("checkpoint.lua consolidate: needs an output path\n" .. USAGE) end
  local n, crc, bytes = ckpt.consolidate(dir, out, { optimizer = flags["--optimizer"] })
  print(("wrote %s: %d tensors, %d bytes, crc32 %08x"):format(out, n, bytes, crc))
end

commands["export-llmc"] = function()
  if not out then die("checkpoint.lua export-llmc: needs an output path\n" .. USAGE) end
  local dtype = flags["--bf16"] and "bfloat16" or "float32"
  local crc, bytes = ckpt.export_llmc(dir, out, { dtype = dtype })
  print(("wrote %s: llm.c GPT-2 model (%s), %d bytes, crc32 %08x"):format(out, dtype, bytes, crc))
end

commands["export-hf"] = function()
  if not out then die("checkpoint.lua export-hf: needs an output directory\n" .. USAGE) end
  if flags["--bf16"] and flags["--f16"] then die("checkpoint.lua export-hf: --bf16 or --f16, not both") end
  local size = flags["--max-shard-size"]
  local dtype = flags["--bf16"] and "bfloat16" or flags["--f16"] and "float16" or "float32"
  local class = ckpt.export_hf(dir, out, { dtype = dtype,
    tokenizer = flags["--tokenizer"], max_shard_size = size and (math.tointeger(tonumber(size)) or size) or nil,
    overwrite = flags["--overwrite"] == true })
  print(("wrote %s: a Hugging Face directory (%s)"):format(out, class))
end

local fn = commands[cmd]
if not fn then die(("checkpoint.lua: unknown command '%s'\n%s"):format(cmd, USAGE)) end
local ok, err = pcall(fn)
if not ok then die(tostring(err)) end
