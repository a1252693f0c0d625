--- Prepares a byte-level training corpus as llm.c token shards.
--
--   ./pglua scripts/prepare_corpus.lua [--out=data] [--name=fortunes] [--val-fraction=0.1]
--                                      [--seed=0] [--separator=%] [files...]
--
-- Input: the given text files, in the order given; with none, the text files of
-- Debian's `fortunes` package under /usr/share/games/fortunes (sorted; .dat and
-- .u8 files and symlinks skipped).
--
-- Documents: each file is split on lines that are exactly the separator ("%",
-- the fortune format; --separator= with nothing after "=" splits on empty lines).
-- A document is the text between two separator lines, byte for byte, newlines
-- included; documents that are empty or only whitespace are dropped. A file
-- without separator lines is one document.
--
-- Split: a document goes to validation when hash(document, seed) < val-fraction
-- (pg.data.hash_unit), so the split depends on the content and seed only, and
-- two copies of a document land on the same side.
--
-- Tokens: bytes (vocabulary 256), with the end-of-text token 0 (a NUL byte,
-- which text never contains) before every document, as GPT-2 data puts
-- <|endoftext|> between documents. Writes OUT/NAME_train.bin and OUT/NAME_val.bin
-- (either may be empty) and prints the counts.
local pg = require "pipegoose"

local usage = "usage: pglua scripts/prepare_corpus.lua [--out=data] [--name=fortunes] [--val-fraction=0.1] " ..
  "[--seed=0] [--separator=%] [files...]"
local default_dir = "/usr/share/games/fortunes"

local opts = { out = "data", name = "fortunes", ["val-fraction"] = "0.1", seed = "0", separator = "%" }
local files = {}
for _, a in ipairs(arg) do
  local k, v = a:match("^%-%-([%w%-]+)=(.*)$")
  if a == "-h" or a == "--help" then
    print(usage)
    os.exit(0)
  elseif k then
    if opts[k] == nil then error(("prepare_corpus: unknown option --%s\n%s"):format(k, usage), 0) end
    opts[k] = v
  elseif a:sub(1, 2) == "--" then
    error(("prepare_corpus: options are written --name=value, got %s\n%s"):format(a, usage), 0)
  else
    files[#files + 1] = a
  end
end

local val_fraction = tonumber(opts["val-fraction"])
if not val_fraction or val_fraction < 0 or val_fraction > 1 then
  error("prepare_corpus: --val-fraction must be a number from 0 to 1, got " .. opts["val-fraction"], 0)
end
local seed = math.tointeger(tonumber(opts.seed))
if not seed then error("prepare_corpus: --seed must be an integer, got " .. opts.seed, 0) end
local C = pg.core.token_data

if #files == 0 then
  if C.file_kind(default_dir) ~= "directory" then
    error(("prepare_corpus: no input files given and %s is missing (install Debian's fortunes package, " ..
      "or name text files)"):format(default_dir), 0)
  end
  for _, p in ipairs(C.expand_paths(default_dir .. "/*")) do
    if not p:match("%.dat$") and not p:match("%.u8$") and C.file_kind(p) == "file" then files[#files + 1] = p end
  end
  table.sort(files)
end

--- The documents of one file's text (see the header).
local function documents(text, sep)
  local docs, start, pos = {}, 1, 1
  local function emit(stop)
    local d = text:sub(start, stop)
    if d:find("%S") then docs[#docs + 1] = d end
  end
  while pos <= #text do
    local nl = text:find("\n", pos, true)
    local line_end = nl and nl - 1 or #text
    if text:sub(pos, line_end) == sep then
      emit(pos - 1)
      start = (nl or #text) + 1
    end
    pos = (nl or #text) + 1
  end
  emit(#text)
  return docs
end

if pg.world_rank() ~= 0 then return end -- one writer when started under mpirun

local split = { train = { docs = {}, n = 0 }, val = { docs = {}, n = 0 } }
local ndocs = 0
for _, path in ipairs(files) do
  local f, err = io.open(path, "rb")
  if not f then error("prepare_corpus: " .. err, 0) end
  local text = f:read("a")
  f:close()
  for _, d in ipairs(documents(text, opts.separator)) do
    local side = C.hash_unit(d, seed) < val_fraction and split.val or split.train
    side.n = side.n + 1
    side.docs[side.n] = d
    ndocs = ndocs + 1
  end
end

C.mkdirs(opts.out)
local eot = string.char(pg.data.bytes.eot)
print(("prepare_corpus: %d files, %d documents, byte tokens (vocab 256), end-of-text token %d before each document")
  :format(#files, ndocs, pg.data.bytes.eot))
for _, which in ipairs{ "train", "val" } do
  local side = split[which]
  local text = side.n > 0 and eot .. table.concat(side.docs, eot) or ""
  local path = ("%s/%s_%s.bin"):format(opts.out, opts.name, which)
  pg.data.write_shard(path, pg.data.bytes.encode(text))
  print(("  %-5s %8d documents %10d tokens -> %s"):format(which, side.n, #text, path))
end
