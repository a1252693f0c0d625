-- The pipeline schedule generators (src/pg_schedule.c), checked as data, no MPI:
-- core.schedule(name, P, M, stage) -> { {action, micro-batch}, ... }, stage
-- 0-based (a pipeline rank), micro-batches 1-based.
local core = require "pipegoose.core"

-- Short names for writing the expectations out by hand.
local short = { RA = "recv_act", F = "forward", SA = "send_act", RG = "recv_grad", B = "backward", SG = "send_grad" }

local function parse(text)
  local out = {}
  for a, mb in text:gmatch("(%u+)(%d+)") do
    out[#out + 1] = { assert(short[a], a), tonumber(mb) }
  end
  return out
end

local function show(list)
  local inv = {}
  for k, v in pairs(short) do inv[v] = k end
  local parts = {}
  for _, a in ipairs(list) do parts[#parts + 1] = inv[a[1]] .. a[2] end
  return table.concat(parts, " ")
end

-- Hand-written: what each stage runs in one step.
local expected = {
  gpipe = {
    ["2,4"] = {
      "F1 SA1 F2 SA2 F3 SA3 F4 SA4 RG1 B1 RG2 B2 RG3 B3 RG4 B4",
      "RA1 F1 RA2 F2 RA3 F3 RA4 F4 B1 SG1 B2 SG2 B3 SG3 B4 SG4",
    },
    ["3,5"] = {
      "F1 SA1 F2 SA2 F3 SA3 F4 SA4 F5 SA5 RG1 B1 RG2 B2 RG3 B3 RG4 B4 RG5 B5",
      "RA1 F1 SA1 RA2 F2 SA2 RA3 F3 SA3 RA4 F4 SA4 RA5 F5 SA5 RG1 B1 SG1 RG2 B2 SG2 RG3 B3 SG3 RG4 B4 SG4 RG5 B5 SG5",
      "RA1 F1 RA2 F2 RA3 F3 RA4 F4 RA5 F5 B1 SG1 B2 SG2 B3 SG3 B4 SG4 B5 SG5",
    },
    ["4,4"] = {
      "F1 SA1 F2 SA2 F3 SA3 F4 SA4 RG1 B1 RG2 B2 RG3 B3 RG4 B4",
      "RA1 F1 SA1 RA2 F2 SA2 RA3 F3 SA3 RA4 F4 SA4 RG1 B1 SG1 RG2 B2 SG2 RG3 B3 SG3 RG4 B4 SG4",
      "RA1 F1 SA1 RA2 F2 SA2 RA3 F3 SA3 RA4 F4 SA4 RG1 B1 SG1 RG2 B2 SG2 RG3 B3 SG3 RG4 B4 SG4",
      "RA1 F1 RA2 F2 RA3 F3 RA4 F4 B1 SG1 B2 SG2 B3 SG3 B4 SG4",
    },
  },
  ["1f1b"] = {
    ["2,4"] = {
      -- warm-up 1 forward, then forward/backward pairs, then the last backward
      "F1 SA1  F2 SA2 RG1 B1  F3 SA3 RG2 B2  F4 SA4 RG3 B3  RG4 B4",
      -- the last stage has no warm-up: forward, backward, forward, backward ...
      "RA1 F1 B1 SG1  RA2 F2 B2 SG2  RA3 F3 B3 SG3  RA4 F4 B4 SG4",
    },
    ["3,5"] = {
      "F1 SA1 F2 SA2  F3 SA3 RG1 B1  F4 SA4 RG2 B2  F5 SA5 RG3 B3  RG4 B4 RG5 B5",
      "RA1 F1 SA1  RA2 F2 SA2 RG1 B1 SG1  RA3 F3 SA3 RG2 B2 SG2  RA4 F4 SA4 RG3 B3 SG3  RA5 F5 SA5 RG4 B4 SG4  RG5 B5 SG5",
      "RA1 F1 B1 SG1  RA2 F2 B2 SG2  RA3 F3 B3 SG3  RA4 F4 B4 SG4  RA5 F5 B5 SG5",
    },
    ["4,4"] = {
      "F1 SA1 F2 SA2 F3 SA3  F4 SA4 RG1 B1  RG2 B2 RG3 B3 RG4 B4",
      "RA1 F1 SA1 RA2 F2 SA2  RA3 F3 SA3 RG1 B1 SG1  RA4 F4 SA4 RG2 B2 SG2  RG3 B3 SG3 RG4 B4 SG4",
      "RA1 F1 SA1  RA2 F2 SA2 RG1 B1 SG1  RA3 F3 SA3 RG2 B2 SG2  RA4 F4 SA4 RG3 B3 SG3  RG4 B4 SG4",
      "RA1 F1 B1 SG1  RA2 F2 B2 SG2  RA3 F3 B3 SG3  RA4 F4 B4 SG4",
    },
  },
}

-- The textbook rules, written here independently of the C generator.
-- A forward step receives (unless first), computes, sends on (unless last);
-- a backward step receives the output gradient (unless last), computes,
-- sends the input gradient back (unless first).
local function textbook(name, P, M, s)
  local out = {}
  local function add(a, mb) out[#out + 1] = { a, mb } end
  local function fwd(i)
    if s > 0 then add("recv_act", i) end
    add("forward", i)
    if s < P - 1 then add("send_act", i) end
  end
  local function bwd(i)
    if s < P - 1 then add("recv_grad", i) end
    add("backward", i)
    if s > 0 then add("send_grad", i) end
  end
  if name == "gpipe" then -- all forwards, then all backwards
    for i = 1, M do fwd(i) end
    for i = 1, M do bwd(i) end
  else -- 1F1B: warm-up of P - stage - 1 forwards, one forward one backward, cool-down
    local warm = math.min(P - s - 1, M)
    for i = 1, warm do fwd(i) end
    for i = 1, M - warm do
      fwd(warm + i)
      bwd(i)
    end
    for i = M - warm + 1, M do bwd(i) end
  end
  return out
end

local function stages(name, P, M)
  local st = {}
  for s = 0, P - 1 do st[s + 1] = core.schedule(name, P, M, s) end
  return st
end

-- Micro-batches held between their forward and their backward, at the worst moment.
local function max_in_flight(list)
  local live, peak = 0, 0
  for _, a in ipairs(list) do
    if a[1] == "forward" then live = live + 1; peak = math.max(peak, live) end
    if a[1] == "backward" then live = live - 1 end
  end
  return peak
end

local function of_kind(list, kind)
  local out = {}
  for _, a in ipairs(list) do if a[1] == kind then out[#out + 1] = a[2] end end
  return out
end

-- An independent run of the lists: sends never block, a receive blocks until
-- its send is posted and consumes it. Returns true, or false and where it stuck.
local function simulate(st, M)
  local P = #st
  local pos, posted, consumed = {}, {}, {}
  for s = 1, P do pos[s] = 1 end
  local function key(kind, from, mb) return kind .. ":" .. from .. ":" .. mb end
  while true do
    local progress, done = false, true
    for s = 1, P do
      while pos[s] <= #st[s] do
        local a, mb = st[s][pos[s]][1], st[s][pos[s]][2]
        local k
        if a == "recv_act" then k = key("act", s - 1, mb)
        elseif a == "recv_grad" then k = key("grad", s + 1, mb) end
        if k then
          if not posted[k] or consumed[k] then break end
          consumed[k] = true
        elseif a == "send_act" then posted[key("act", s, mb)] = true
        elseif a == "send_grad" then posted[key("grad", s, mb)] = true end
        pos[s] = pos[s] + 1
        progress = true
      end
      if pos[s] <= #st[s] then done = false end
    end
    if done then break end
    if not progress then return false, "stuck at " .. table.concat(pos, ",") end
  end
  for k in pairs(posted) do
    if not consumed[k] then return false, "never received: " .. k end
  end
  return true
end

local cases = { { 2, 4 }, { 4, 4 }, { 4, 8 }, { 3, 5 } }

describe("pipeline schedules", function()
  for _, name in ipairs{ "gpipe", "1f1b" } do
    describe(name, function()
      for _, pm in ipairs(cases) do
        local P, M = pm[1], pm[2]
        local key = P .. "," .. M

        it(("(P=%d, M=%d): every stage's actions equal the expectation"):format(P, M), function()
          local hand = expected[name][key]
          for s = 0, P - 1 do
            local got = core.schedule(name, P, M, s)
            local want = textbook(name, P, M, s)
            assert.same(want, got, ("stage %d: got %s"):format(s, show(got)))
            if hand then -- the hand-written lists also pin the helper above
              assert.same(parse(hand[s + 1]), got, ("stage %d: got %s"):format(s, show(got)))
            end
            -- every micro-batch forwarded and backwarded exactly once, forward first
            local f, b = of_kind(got, "forward"), of_kind(got, "backward")
            assert.equal(M, #f)
            assert.equal(M, #b)
            local seen = {}
            for i, a in ipairs(got) do
              if a[1] == "forward" then seen[a[2]] = i end
              if a[1] == "backward" then assert.truthy(seen[a[2]], "backward before forward of " .. a[2]) end
            end
          end
        end)

        it(("(P=%d, M=%d): every send has its matching receive on the neighbour"):format(P, M), function()
          local st = stages(name, P, M)
          for s = 1, P do
            if s < P then
              assert.same(of_kind(st[s], "send_act"), of_kind(st[s + 1], "recv_act"), "activations " .. s - 1 .. " -> " .. s)
              assert.equal(M, #of_kind(st[s], "send_act"))
            else
              assert.same({}, of_kind(st[s], "send_act"))
              assert.same({}, of_kind(st[s], "recv_grad"))
            end
            if s > 1 then
              assert.same(of_kind(st[s], "send_grad"), of_kind(st[s - 1], "recv_grad"), "gradients " .. s - 1 .. " -> " .. s - 2)
              assert.equal(M, #of_kind(st[s], "send_grad"))
            else
              assert.same({}, of_kind(st[s], "send_grad"))
              assert.same({}, of_kind(st[s], "recv_act"))
            end
          end
          assert.is_true(simulate(st, M))
          assert.is_true(core.schedule_validate(name, P, M))
        end)

        it(("(P=%d, M=%d): in flight never exceeds the bound"):format(P, M), function()
          for s = 0, P - 1 do
            local peak = max_in_flight(core.schedule(name, P, M, s))
            if name == "gpipe" then
              assert.equal(M, peak) -- GPipe holds every micro-batch
            else
              assert.is_true(peak <= P, ("stage %d holds %d > P=%d"):format(s, peak, P))
              assert.equal(math.min(P - s, M), peak) -- stage s: its warm-up plus one
            end
          end
        end)
      end

      it("validates and stays in bounds for every P <= 6, M <= 9 (M < P included)", function()
        for P = 1, 6 do
          for M = 1, 9 do
            local ok, msg = core.schedule_validate(name, P, M)
            assert.is_true(ok, ("P=%d M=%d: %s"):format(P, M, tostring(msg)))
            local st = stages(name, P, M)
            assert.is_true(simulate(st, M), ("P=%d M=%d"):format(P, M))
            for s = 0, P - 1 do
              assert.same(textbook(name, P, M, s), st[s + 1], ("P=%d M=%d stage %d"):format(P, M, s))
              local bound = name == "gpipe" and M or math.min(P, M)
              assert.is_true(max_in_flight(st[s + 1]) <= bound)
            end
          end
        end
      end)
    end)
  end

  it("are the same for both names with one micro-batch", function()
    -- (gpt2_check_spec runs M = 1 once for this reason)
    for P = 1, 4 do
      for s = 0, P - 1 do assert.same(core.schedule("gpipe", P, 1, s), core.schedule("1f1b", P, 1, s)) end
    end
  end)

  it("reject an unknown name, naming it and the known ones", function()
    for _, f in ipairs{
      function() return core.schedule("interleaved", 2, 4, 0) end,
      function() return core.schedule_validate("interleaved", 2, 4) end,
    } do
      local ok, err = pcall(f)
      assert.is_false(ok)
      assert.matches("unknown schedule 'interleaved' %(expected gpipe or 1f1b%)", err)
    end
  end)

  it("reject sizes out of range, naming them", function()
    local ok, err = pcall(core.schedule, "gpipe", 2, 4, 2)
    assert.is_false(ok)
    assert.matches("bad sizes %(P=2, M=4, stage 2%)", err)
    ok, err = pcall(core.schedule, "1f1b", 2, 0, 0)
    assert.is_false(ok)
    assert.matches("bad sizes %(P=2, M=0, stage 0%)", err)
    ok, err = pcall(core.schedule_validate, "gpipe", 0, 4)
    assert.is_false(ok)
    assert.matches("bad sizes P=0 M=4", err)
  end)

  describe("the checker (core.schedule_validate on given lists)", function()
    local good = { parse(expected["1f1b"]["2,4"][1]), parse(expected["1f1b"]["2,4"][2]) }

    it("accepts a correct schedule", function()
      assert.is_true(core.schedule_validate(good, 4))
      assert.is_true(simulate(good, 4))
    end)

    local broken = {
      { "a receive before the send it waits for", {
          "F1 RG1 SA1 B1", "RA1 F1 B1 SG1" }, 1, "schedule deadlocks: stage 0 waits at action 2 of 4 %(recv_grad 1%)" },
      { "a send with no receive", {
          "F1 SA1 SA1 RG1 B1", "RA1 F1 B1 SG1" }, 1, "stage 0 sends activation 1 twice" },
      { "a receive with no send", {
          "F1 SA1 RG1 B1", "RA1 RA1 F1 B1 SG1" }, 1, "stage 1 receives activation 1 twice" },
      { "a micro-batch never run backward", {
          "F1 SA1 F2 SA2 RG1 B1", "RA1 F1 B1 SG1 RA2 F2" }, 2, "stage 0 never runs micro%-batch 2 both ways" },
      { "a backward before its forward", {
          "F1 SA1 RG1 B1", "RA1 B1 F1 SG1" }, 1, "stage 1: backward of micro%-batch 1 out of order" },
      { "the first stage receiving an activation", {
          "RA1 F1 SA1 RG1 B1", "RA1 F1 B1 SG1" }, 1, "stage 0 receives an activation" },
    }
    for _, c in ipairs(broken) do
      it("rejects " .. c[1] .. ", saying where", function()
        local st = { parse(c[2][1]), parse(c[2][2]) }
        local ok, msg = core.schedule_validate(st, c[3])
        assert.is_false(ok)
        assert.matches(c[4], msg)
      end)
    end
  end)
end)
