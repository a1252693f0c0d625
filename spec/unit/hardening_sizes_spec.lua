-- Checked size arithmetic (issue 18, item 1): sizes that do not fit, and
-- numbers that are not the integers a C field needs, are errors that name
-- them, never a wrapped size, a cut integer or a crash.
--
-- Each case runs in its own pglua process: before the fix several of them
-- crashed the process (a segfault, SIGFPE), which would take busted down with
-- it. `timeout 60` is a hang guard, not a timing assertion.
local h = require "helpers"

local function run(code)
  return h.sh("timeout -k 2 60 " .. h.pglua_cmd{ "-e", "local pg = require 'pipegoose'\n" .. code })
end

-- The snippet ends with an error whose message contains `message` (plain text): exit status 1, no crash.
local function assert_error(code, message)
  local rc, out = run(code)
  assert.equal(1, rc, out)
  assert.is_truthy(out:find(message, 1, true), ("expected %q in:\n%s"):format(message, out))
end

-- The snippet runs to the end and prints `want`.
local function assert_prints(code, want)
  local rc, out = run(code)
  assert.equal(0, rc, out)
  assert.is_truthy(out:find(want, 1, true), ("expected %q in:\n%s"):format(want, out))
end

describe("tensor sizes", function()
  it("a shape whose element count overflows is an error naming the shape", function()
    -- the count wrapped to 0 and set(3000, 7, 1) wrote far past a 64-byte buffer
    assert_error("local t = pg.zeros{ 1 << 32, 1 << 32 }; t:set(3000, 7, 1)", "[4294967296, 4294967296]")
    assert_error("pg.zeros(1 << 32, 1 << 32)", "is too large")
  end)

  it("zero sizes do not hide the others", function()
    assert_error("pg.zeros{ 0, 1 << 40, 1 << 40 }", "[0, 1099511627776, 1099511627776]")
    assert_error("pg.zeros{ 0 }:reshape{ 0, 1 << 62, 4 }", "is too large")
  end)

  it("a shape that fits but not in memory is an error naming the shape", function()
    assert_error("pg.zeros{ 1 << 29, 1 << 29 }", "[536870912, 536870912] float32")
  end)

  it("narrow with a length past the end is an error, however large", function()
    assert_error("print(pg.zeros{ 4, 4 }:narrow(1, 2, math.maxinteger):get(1000000, 1))", "narrow: ")
    assert_error("print(pg.zeros{ 4, 4 }:narrow(1, math.mininteger, 2))", "narrow: start")
    assert_error("print(pg.zeros{ 4, 4 }:narrow(2, 2, math.maxinteger))", "narrow: ")
    assert_prints("print(pg.zeros{ 4, 4 }:narrow(1, 2, 3):get(3, 4))", "0.0")
  end)

  it("a dimension argument past int is refused, not cut to dimension 1", function()
    assert_error("pg.ones{ 2, 3 }:softmax((1 << 32) + 1)", "dimension 4294967297 out of range")
    assert_error("pg.ones{ 2, 3 }:sum((1 << 32) + 1)", "dimension 4294967297 out of range")
  end)

  it("arange with an endless range is an error", function()
    assert_error("pg.arange(0, math.huge)", "pg.arange")
    assert_error("pg.arange(0, 0/0, 1.0)", "pg.arange")
    assert_error("pg.arange((1 << 40), (1 << 40) + 2)", "does not fit an int32")
  end)
end)

describe("int32 elements", function()
  it("take integers that fit, and nothing else", function()
    local int = "local t = pg.zeros({ 2 }, { dtype = 'int32' }); "
    assert_error(int .. "t:set(1, 1e20)", "1e+20 does not fit an int32 element")
    assert_error(int .. "t:set(1, 2.5)", "2.5 is not an integer")
    assert_error(int .. "t:set(1, 0/0)", "is not an integer")
    assert_error(int .. "t:fill_(2^31)", "2147483648 does not fit an int32")
    assert_error(int .. "t:add(2^40)", "does not fit an int32")
    assert_error("pg.full({ 2 }, 1e20, { dtype = 'int32' })", "does not fit an int32")
    assert_error("pg.tensor({ 1, 2^31 }, { dtype = 'int32' })", "does not fit an int32")
    assert_prints(int .. "t:set(1, -2^31); t:set(2, 2^31 - 1); print(t:get(1), t:get(2))", "-2147483648\t2147483647")
  end)

  it("divide without the undefined cases (SIGFPE before)", function()
    assert_error([[
      local a = pg.tensor({ -2147483648 }, { dtype = 'int32' })
      print(a:div(pg.tensor({ -1 }, { dtype = 'int32' })))]], "integer division overflow")
    assert_error([[
      local a = pg.tensor({ { -2147483648 }, { 4 } }, { dtype = 'int32' })
      print(a:div(pg.tensor({ -1 }, { dtype = 'int32' })))]], "integer division overflow")
  end)

  it("wrap around on overflow, as torch's int32 arithmetic does", function()
    assert_prints([[
      local a = pg.tensor({ 2147483647, -2147483648, 65536 }, { dtype = 'int32' })
      local b = pg.tensor({ 1, 1, 65536 }, { dtype = 'int32' })
      local s, d, p = a:add(b), a:sub(b), a:mul(b)
      print(s:get(1), d:get(2), p:get(3))]], "-2147483648\t2147483647\t0")
  end)
end)

describe("model options", function()
  local GPT = "pg.nn.GPT{ vocab = %s, seq_len = 8, dim = 8, heads = 2, layers = 1 }"

  it("a vocabulary above 2^31 is an error naming it, not 64 rows", function()
    assert_error("pg.parallelize(" .. GPT:format("(1 << 32) + 64") .. ", pg.ParallelContext{})", "4294967360")
  end)

  it("a description field that does not fit an int names the module, key and value", function()
    assert_error([[
      local d = { kind = "sequential", name = "", children = {
        { kind = "embedding", name = "embed", vocab = 8, padded_vocab = 8, width = (1 << 32) + 8, positions = 0 } } }
      pg.core.Engine(pg.ParallelContext{}, d, { vocab = 8, width = 8 })]], "embed: width = 4294967304 does not fit a C int")
  end)

  it("a non-integer where a description needs an integer is an error", function()
    assert_error([[
      local d = { kind = "sequential", name = "", children = {
        { kind = "embedding", name = "embed", vocab = 8, padded_vocab = 8.5, width = 8, positions = 0 } } }
      pg.core.Engine(pg.ParallelContext{}, d, { vocab = 8, width = 8 })]], "option 'padded_vocab' must be an integer, got 8.5")
    assert_error([[
      local d = { kind = "sequential", name = "", children = {
        { kind = "linear", name = "l", ["in"] = 8, out = 8, blocks = 1, block_sizes = { 7.5 } } } }
      pg.core.Engine(pg.ParallelContext{}, d, { vocab = 8, width = 8 })]], "block_sizes: entry 1 must be an integer, got 7.5")
  end)

  it("a description without a field whose default pg.nn owns is an error, not a default of the runtime's", function()
    assert_error([[
      local d = { kind = "sequential", name = "", children = {
        { kind = "embedding", name = "embed", vocab = 8, padded_vocab = 8, width = 8, positions = 0 } } }
      pg.core.Engine(pg.ParallelContext{}, d, { vocab = 8, width = 8 })]], "embed: init_std is required")
  end)

  it("parameters too large for memory are an error naming them", function()
    assert_error([[
      local d = { kind = "sequential", name = "", children = {
        { kind = "embedding", name = "embed", vocab = 8, padded_vocab = 2147483647, width = 2147483647, positions = 0,
          init_std = 0.02 } } }
      pg.core.Engine(pg.ParallelContext{}, d, { vocab = 8, width = 8 })]], "'embed.wte': its sizes multiply to more than 2^59")
  end)

  it("engine options past int are refused", function()
    assert_error("pg.parallelize(" .. GPT:format("61") .. ", pg.ParallelContext{}, { micro_batches = (1 << 32) + 1 })",
      "micro_batches must be a positive integer below 2^31, got 4294967297")
    -- fits an int, but the schedule of 2^31 - 1 micro-batches was built at construction (it ran for ever)
    assert_error("pg.parallelize(" .. GPT:format("61") .. ", pg.ParallelContext{}, { micro_batches = (1 << 31) - 1 })",
      "micro_batches must be from 1 to 1048576, not 2147483647")
  end)
end)

describe("other integer arguments", function()
  it("a broadcast source past int is refused, not cut to rank 0", function()
    assert_error("pg.ParallelContext{}; pg.dist.broadcast(pg.ones{ 2 }, { src = 1 << 32 })", "4294967296")
  end)

  it("file reads past the end or past 2^63 are errors before anything is allocated", function()
    local path = h.tmpfile("0123456789abcdef", ".bin")
    assert_error(("pg.core.file.read(%q, math.maxinteger, 2)"):format(path), "past 2^63")
    assert_error(("pg.core.file.read(%q, 0, 1 << 40)"):format(path), "truncated: needs 4398046511104 bytes")
    assert_prints(("print(pg.core.file.read(%q, 4, 2, 'int32'):get(2))"):format(path), "1650538808")
    os.remove(path)
  end)

  it("a shard copy whose offset and length wrap around is refused (it copied past the shard)", function()
    assert_error("pg.core.shard_copy(pg.ones{ 4 }, pg.ones{ 2 }, { full_shape = { 4 }, lo = math.maxinteger }, 'to_full')",
      "shard_copy: 2 elements from element 9223372036854775807 are outside the shard's 4 elements")
  end)

  it("an optimizer's zero option is 0, 1 or 2", function()
    assert_error([[
      local e = pg.parallelize(pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 8, heads = 2, layers = 1 }, pg.ParallelContext{})
      pg.core.AdamW(e.c, {}, (1 << 32) + 1)]], "zero")
  end)
end)
