-- Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/): valid
-- files of each format and the ways they go wrong that users have sent
-- (truncated, a header that lies about sizes, wrong magic, bad JSON…). Run
-- from the repository root: pglua fuzz/make_corpus.lua. Deterministic.
local pg = require "pipegoose"
local safetensors = require "pipegoose.safetensors"

local function write(target, name, bytes)
  pg.fs.mkdir_p("fuzz/corpus/" .. target)
  local f = assert(io.open(("fuzz/corpus/%s/%s"):format(target, name), "wb"))
  f:write(bytes)
  f:close()
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local tmp = os.tmpname()

---------------------------------------------------------------- safetensors
safetensors.write(tmp, { { name = "w", tensor = pg.tensor{ { 1, 2 }, { 3, 4 } } },
                         { name = "ids", tensor = pg.tensor({ 5, 6, 7 }, { dtype = "int32" }) } }, { format = "pt" })
local st = read(tmp)
write("safetensors", "valid", st)
write("safetensors", "truncated_data", st:sub(1, #st - 5))
write("safetensors", "truncated_header", st:sub(1, 20))
write("safetensors", "empty", "")
local function with_header(json)
  json = json .. string.rep(" ", (-#json) % 8)
  return string.pack("<I8", #json) .. json
end
write("safetensors", "huge_shape", with_header('{"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}'))
write("safetensors", "negative_offset", with_header('{"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}') .. string.rep("\0", 8))
write("safetensors", "overlap", with_header('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
  .. '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}') .. string.rep("\0", 12))
write("safetensors", "header_length_lies", string.pack("<I8", 1 << 62) .. "{}")
write("safetensors", "not_json", with_header("{\"w\":"))
write("safetensors", "float_shape", with_header('{"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,6]}}') .. string.rep("\0", 8))

---------------------------------------------------------------- checkpoint manifests
local dir = tmp .. ".ck"
local engine = pg.parallelize(pg.nn.GPT{ vocab = 16, seq_len = 4, dim = 8, heads = 2, layers = 1 }, nil, {})
local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
t:save_checkpoint(dir)
local manifest = read(dir .. "/manifest.json")
pg.fs.remove_tree(dir)
-- Edits are re-sealed (manifest_crc32 recomputed), so that the checks behind the seal are reached.
local ck = require "pipegoose.checkpoint"
local function resealed(text)
  local m = ck.decode(text, "manifest")
  m[ck.SEAL_KEY] = nil
  return ck.seal(m)
end
write("manifest", "valid", manifest)
write("manifest", "truncated", manifest:sub(1, #manifest // 2))
write("manifest", "unsealed_edit", (manifest:gsub('"step":%s*%d+', '"step":7')))
write("manifest", "escaping_file_name", resealed((manifest:gsub('"params%-tp0%-pp0%.safetensors"', '"../../../etc/passwd"'))))
write("manifest", "negative_step", resealed((manifest:gsub('"step":%s*%d+', '"step":-5'))))
write("manifest", "zero_parts", resealed((manifest:gsub('"parts":%s*1', '"parts":0'))))
write("manifest", "empty_object", "{}")
write("manifest", "array", "[1, 2, 3]")
write("manifest", "deep", string.rep("[", 5000) .. string.rep("]", 5000))

---------------------------------------------------------------- token shards
local function shard(version, tokens, count)
  local header = { 20240520, version, count or #tokens }
  for i = 4, 256 do header[i] = 0 end
  local fmt = version == 1 and "<I2" or "<I4"
  local parts = { string.pack("<" .. string.rep("i4", 256), table.unpack(header)) }
  for _, tk in ipairs(tokens) do parts[#parts + 1] = string.pack(fmt, tk) end
  return table.concat(parts)
end
local tokens = {}
for i = 1, 200 do tokens[i] = (i * 37) % 256 end
write("shard", "valid_v1", shard(1, tokens))
write("shard", "valid_v7", shard(7, tokens))
write("shard", "count_lies", shard(1, tokens, 0x7fffffff))
write("shard", "negative_count", shard(1, tokens, -1))
write("shard", "bad_version", shard(3, tokens))
write("shard", "truncated", shard(1, tokens):sub(1, 1100))
write("shard", "header_only", shard(1, {}, 0))
write("shard", "big_tokens_v7", shard(7, { 0, 70000, 0x7fffffff, 0xffffffff }))
write("shard", "bad_magic", "PK\3\4" .. shard(1, tokens):sub(5))

---------------------------------------------------------------- llm.c model files
local model = tmp .. ".bin"
engine:save_llmc(model)
local bin = read(model)
os.remove(model)
write("llmc", "valid", bin)
write("llmc", "truncated", bin:sub(1, #bin - 4))
local function llmc_header(seq, vocab, layers, heads, dim, padded)
  local h = { 20240326, 3, seq, vocab, layers, heads, dim, padded }
  for i = 9, 256 do h[i] = 0 end
  return string.pack("<" .. string.rep("i4", 256), table.unpack(h))
end
write("llmc", "huge_sizes", llmc_header(1 << 30, 1 << 30, 1 << 30, 1, 1 << 30, 1 << 30))
write("llmc", "negative_sizes", llmc_header(-4, 16, 1, 2, 8, 16))
write("llmc", "zero_heads", llmc_header(4, 16, 1, 0, 8, 16))
write("llmc", "padded_below_vocab", llmc_header(4, 16, 1, 2, 8, 8))
write("llmc", "header_only", llmc_header(4, 16, 1, 2, 8, 16))
os.remove(tmp)
print("wrote fuzz/corpus")
