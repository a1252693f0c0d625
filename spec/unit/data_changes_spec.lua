-- Token shards that change while a TokenShards has them open (truncated,
-- extended, rewritten in place, replaced by a rename, removed): the next read
-- is one error naming the file, never a SIGBUS nor tokens of another file.
-- Each case runs in a child pglua, so a crash reads as its exit status.
local pg = require "pipegoose"
local h = require "helpers"

local dir
setup(function()
  dir = h.tmpdir()
  pg.fs.mkdir_p(dir)
end)
teardown(function() h.rm(dir) end)

-- The child: opens the shard, reads batch 0, seeks to batch 500 (token 9000,
-- byte 19024: past the first pages), lets `change` (a shell command) act on
-- the file, then reads once more and prints what happened.
local CHILD = [[
local pg = require "pipegoose"
local path, change = arg[1], arg[2]
local d = pg.data.TokenShards{ path = path, batch = 2, seq_len = 8, shuffle = false }
assert(d:next_batch())
local sd = d:state_dict()
sd.batch_index = 500
d:load_state_dict(sd)
assert(os.execute(change))
local ok, e = pcall(d.next_batch, d)
io.write(ok and "NO ERROR\n" or ("ERROR " .. tostring(e) .. "\n"))
local e2, i2 = d:position()
io.write(("POSITION %d %d\n"):format(e2, i2))
]]

local function ids(n, first)
  local t = {}
  for i = 1, n do t[i] = (first + i) % 50000 end
  return t
end

local function run(name, change)
  local p = dir .. "/" .. name .. ".bin"
  pg.data.write_shard(p, ids(20000, 0), 1)
  local script = h.tmpfile(CHILD, ".lua")
  local rc, out = h.sh(h.pglua_cmd{ script, p, (change:gsub("FILE", h.quote(p))) })
  os.remove(script)
  return rc, out, p
end

local function expect_named_error(rc, out, p, what)
  assert.equal(0, rc, out)
  local msg = out:match("ERROR ([^\n]*)")
  assert(msg, "the read after the change succeeded: " .. out)
  assert(msg:find(p, 1, true), "the message does not name the file: " .. msg)
  assert(msg:find(what, 1, true), ("expected %q in: %s"):format(what, msg))
  -- the failed read did not move the loader on
  assert.truthy(out:find("POSITION 0 500", 1, true), out)
end

describe("a token shard changed while TokenShards has it open", function()
  it("truncated in place: an error naming the file, not SIGBUS", function()
    local rc, out, p = run("short", "truncate -s 4096 FILE")
    expect_named_error(rc, out, p, "changed while open: it has 4096 bytes, but had 41024")
  end)

  it("extended in place", function()
    local rc, out, p = run("long", "head -c 4000 /dev/zero >> FILE")
    expect_named_error(rc, out, p, "changed while open: it has 45024 bytes")
  end)

  it("rewritten in place at the same size", function()
    -- the bytes of the tokens read next, overwritten without truncating; the mtime is moved on
    -- (touch -d) so that a coarse file-system clock cannot hide the write
    local rc, out, p = run("same", "head -c 2000 /dev/zero | dd of=FILE bs=1 seek=19000 conv=notrunc status=none"
      .. " && touch -d '+1 min' FILE")
    expect_named_error(rc, out, p, "changed while open: it was modified after it was opened")
  end)

  it("replaced by a rename onto its path", function()
    local rc, out, p = run("renamed", "cp FILE FILE.new && mv FILE.new FILE")
    expect_named_error(rc, out, p, "changed while open: another file was put in its place")
  end)

  it("removed", function()
    local rc, out, p = run("removed", "rm FILE")
    expect_named_error(rc, out, p, "changed while open: it is gone")
  end)

  it("unchanged: the same tokens as a fresh loader (reading is not disturbed by the checks)", function()
    local rc, out = run("same_ok", "true")
    assert.equal(0, rc, out)
    assert.truthy(out:find("NO ERROR", 1, true), out)
  end)
end)

describe("a FIFO given as a shard", function()
  it("is refused as not a regular file (opening it waited for a writer for ever)", function()
    local fifo = dir .. "/fifo.bin"
    assert.equal(0, (h.sh("mkfifo " .. h.quote(fifo))))
    local rc, out = h.sh(("timeout -k 5 %d %s"):format(h.limit(60), h.pglua_cmd{ "-e",
      ("local ok, e = pcall(require('pipegoose').data.TokenShards, { path = %q, batch = 1, seq_len = 4 }) "
        .. "print(ok and 'ACCEPTED' or e)"):format(fifo) }))
    assert.equal(0, rc, out)
    assert.truthy(out:find(fifo .. ": not a regular file", 1, true), out)
  end)
end)

describe("pg.data.read_shard of a shard that shrinks later", function()
  it("reads every token by pread: a later truncation cannot reach a tensor already read", function()
    local p = dir .. "/whole.bin"
    pg.data.write_shard(p, ids(5000, 7), 1)
    local t = pg.data.read_shard(p)
    assert.equal(0, h.sh("truncate -s 1024 " .. h.quote(p)))
    local got = t:totable()
    assert.equal(5000, #got)
    assert.equal(8, got[1])
    assert.equal((7 + 5000) % 50000, got[5000])
  end)
end)

describe("a prepared corpus whose shards changed after dataset.json was written", function()
  local GPT2 = "spec/fixtures/tokenizers/gpt2/tokenizer.json"
  local out

  setup(function()
    local docs = {}
    for i = 1, 12 do docs[i] = ("Document number %d, with a few words of text.\n"):format(i) end
    local input = dir .. "/docs.txt"
    local f = assert(io.open(input, "w"))
    f:write(table.concat(docs, "%\n"))
    f:close()
    out = dir .. "/corpus"
    local rc, log = h.sh(h.pglua_cmd{ "scripts/prepare_corpus.lua", "--tokenizer=" .. GPT2,
      "--eos-token=<|endoftext|>", "--input=" .. input, "--separator=%", "--out=" .. out, "--val-fraction=0",
      "--shard-tokens=40" })
    assert.equal(0, rc, log)
  end)

  it("records every shard's token count in dataset.json", function()
    local meta = require("cjson").decode(h.read(out .. "/dataset.json"))
    assert.is_true(#meta.train.shards >= 2)
    local sum = 0
    for i, name in ipairs(meta.train.shards) do
      assert.equal(pg.data.shard_info(out .. "/" .. name).tokens, meta.train.shard_tokens[i])
      sum = sum + meta.train.shard_tokens[i]
    end
    assert.equal(meta.train.tokens, sum)
  end)

  it("refuses at open a shard whose count differs, even when the total is the same", function()
    -- one token moved from the first shard to the second: the split's total is unchanged
    local a, b = out .. "/train_000000.bin", out .. "/train_000001.bin"
    local ta, tb = pg.data.read_shard(a):totable(), pg.data.read_shard(b):totable()
    table.insert(tb, 1, table.remove(ta))
    pg.data.write_shard(a, ta, 1)
    pg.data.write_shard(b, tb, 1)
    local ok, e = pcall(pg.data.TokenShards, { corpus = out, split = "train", batch = 1, seq_len = 4 })
    assert.is_false(ok)
    e = tostring(e)
    assert(e:find("train.shards[1] train_000000.bin has " .. #ta .. " tokens but the corpus recorded "
      .. (#ta + 1), 1, true), e)
    assert(e:find(out .. "/dataset.json", 1, true), e)
  end)
end)
