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

local default_dir = "/usr/share/games/fortunes"
local argparse = require "argparse"
local p = argparse("prepare_corpus.lua", "Byte-level token shards from text files (default: the fortunes).")
p:argument("files", "Text files (default: every fortune file in " .. default_dir .. ")."):args("*")
p:option("--out", "Output directory.", "data")
p:option("--name", "Shard name prefix.", "fortunes")
p:option("--val-fraction", "Fraction of documents for validation.", "0.1"):convert(tonumber)
p:option("--seed", "Seed of the train/val split.", "0"):convert(function(s) return math.tointeger(tonumber(s)) end)
p:option("--separator", "Line that separates documents.", "%")
local args = p:parse()
local opts = { out = args.out, name = args.name, separator = args.separator }
local files = args.files
local val_fraction = args.val_fraction
if val_fraction < 0 or val_fraction > 1 then
  p:error("--val-fraction must be a number from 0 to 1, got " .. tostring(val_fraction))
end
local seed = args.seed
local C = pg.core.token_data

if #files == 0 then
  if pg.fs.kind(default_dir) ~= "directory" then
    error(("prepare_corpus: no input files given and %s is missing (install Debian's fortunes package, " ..
      "or name text files)"):format(default_dir), 0)
  end
  for _, p in ipairs(C.expand_paths(default_dir .. "/*")) do
    if not p:match("%.dat$") and not p:match("%.u8$") and pg.fs.kind(p) == "file" then files[#files + 1] = p end
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

pg.fs.mkdir_p(opts.out)
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
