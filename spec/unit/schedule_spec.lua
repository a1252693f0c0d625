-- The pipeline schedule generators (src/engine/pg_schedule.c), checked as data, no MPI:
-- core.schedule(name, P, M, stage [, V]) -> { {action, micro-batch [, chunk]}, ... },
-- stage 0-based (a pipeline rank), micro-batches and chunks 1-based (the
-- chunk is given when ranks hold V > 1 chunks: the interleaved schedule).
local core = require "pipegoose.core"

-- Short names for writing the expectations out by hand.
local short = { RA = "recv_act", F = "forward", SA = "send_act", RG = "recv_grad", B = "backward", SG = "send_grad" }

-- "F1" is {"forward", 1}; "F1.2" is {"forward", 1, 2}: micro-batch 1 of chunk 2.
local function parse(text)
  local out = {}
  for a, mb, chunk in text:gmatch("(%u+)(%d+)%.?(%d*)") do
    out[#out + 1] = { assert(short[a], a), tonumber(mb), tonumber(chunk) }
  end
  return out
end

local function show(list)
  local inv = {}
  for k, v in pairs(short) do inv[v] = k end
  local parts = {}
  for _, a in ipairs(list) do parts[#parts + 1] = inv[a[1]] .. a[2] .. (a[3] and "." .. a[3] or "") end
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
-- Messages are named by the model piece that sends them: chunk c of stage s
-- (1-based here) is piece (c - 1) * P + s, activations go to the next piece,
-- gradients to the previous one.
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
        local g = ((st[s][pos[s]][3] or 1) - 1) * P + s
        local k
        if a == "recv_act" then k = key("act", g - 1, mb)
        elseif a == "recv_grad" then k = key("grad", g + 1, mb) end
        if k then
          if not posted[k] or consumed[k] then break end
          consumed[k] = true
        elseif a == "send_act" then posted[key("act", g, mb)] = true
        elseif a == "send_grad" then posted[key("grad", g, mb)] = true end
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
      function() return core.schedule("zigzag", 2, 4, 0) end,
      function() return core.schedule_validate("zigzag", 2, 4) end,
    } do
      local ok, err = pcall(f)
      assert.is_false(ok)
      assert.matches("unknown schedule 'zigzag' %(expected gpipe, 1f1b, interleaved or forward%)", err)
    end
  end)

  it("reject sizes out of range, naming them", function()
    local ok, err = pcall(core.schedule, "gpipe", 2, 4, 2)
    assert.is_false(ok)
    assert.matches("bad sizes %(P=2, V=1, M=4, stage 2%)", err)
    ok, err = pcall(core.schedule, "1f1b", 2, 0, 0)
    assert.is_false(ok)
    assert.matches("bad sizes %(P=2, V=1, M=0, stage 0%)", err)
    ok, err = pcall(core.schedule, "interleaved", 2, 4, 0, 0)
    assert.is_false(ok)
    assert.matches("bad sizes %(P=2, V=0, M=4, stage 0%)", err)
    ok, err = pcall(core.schedule_validate, "gpipe", 0, 4)
    assert.is_false(ok)
    assert.matches("bad sizes P=0 M=4 V=1", err)
    ok, err = pcall(core.schedule, "interleaved", 2, 1 << 19, 0, 4)
    assert.is_false(ok)
    assert.matches("524288 micro%-batches x 4 chunks are more than a schedule holds", err)
  end)

  describe("interleaved (V chunks per stage)", function()
    -- Hand-written from Megatron-LM's rules: micro-batches go in groups of P
    -- through chunk 1, then chunk 2, ... (backwards: the chunks in reverse);
    -- stage s warms up with 2 (P - s - 1) + (V - 1) P forwards, then one
    -- forward one backward, then the remaining backwards. Chunk 1 of stage 0
    -- is the model's first piece (no receive), chunk V of stage P - 1 its last.
    local hand = {
      ["2,2,4"] = {
        "F1.1 SA1.1 F2.1 SA2.1 RA1.2 F1.2 SA1.2 RA2.2 F2.2 SA2.2 " -- warm-up: 4
          .. "F3.1 SA3.1 RG1.2 B1.2 SG1.2  F4.1 SA4.1 RG2.2 B2.2 SG2.2  RA3.2 F3.2 SA3.2 RG1.1 B1.1  "
          .. "RA4.2 F4.2 SA4.2 RG2.1 B2.1  RG3.2 B3.2 SG3.2 RG4.2 B4.2 SG4.2 RG3.1 B3.1 RG4.1 B4.1",
        "RA1.1 F1.1 SA1.1 RA2.1 F2.1 SA2.1 " -- warm-up: 2
          .. "RA1.2 F1.2 B1.2 SG1.2  RA2.2 F2.2 B2.2 SG2.2  RA3.1 F3.1 SA3.1 RG1.1 B1.1 SG1.1  "
          .. "RA4.1 F4.1 SA4.1 RG2.1 B2.1 SG2.1  RA3.2 F3.2 B3.2 SG3.2  RA4.2 F4.2 B4.2 SG4.2  "
          .. "RG3.1 B3.1 SG3.1 RG4.1 B4.1 SG4.1",
      },
      ["2,2,2"] = { -- stage 0's warm-up is every forward
        "F1.1 SA1.1 F2.1 SA2.1 RA1.2 F1.2 SA1.2 RA2.2 F2.2 SA2.2  RG1.2 B1.2 SG1.2 RG2.2 B2.2 SG2.2 RG1.1 B1.1 RG2.1 B2.1",
        "RA1.1 F1.1 SA1.1 RA2.1 F2.1 SA2.1  RA1.2 F1.2 B1.2 SG1.2 RA2.2 F2.2 B2.2 SG2.2  RG1.1 B1.1 SG1.1 RG2.1 B2.1 SG2.1",
      },
    }
    -- evaluation: forwards only, groups of P (the last one smaller)
    local hand_forward = {
      ["2,2,3"] = {
        "F1.1 SA1.1 F2.1 SA2.1 RA1.2 F1.2 SA1.2 RA2.2 F2.2 SA2.2 F3.1 SA3.1 RA3.2 F3.2 SA3.2",
        "RA1.1 F1.1 SA1.1 RA2.1 F2.1 SA2.1 RA1.2 F1.2 RA2.2 F2.2 RA3.1 F3.1 SA3.1 RA3.2 F3.2",
      },
    }

    -- The rule, written here independently of the C generator.
    local function textbook_interleaved(P, V, M, s, forward_only)
      local out, G = {}, P * V
      local function add(a, mb, c) out[#out + 1] = { a, mb, V > 1 and c or nil } end
      local function item(k, backward) -- the k-th (0-based) chunk and micro-batch
        local first = k // (P * V) * P
        local size = math.min(P, M - first)
        local within = k - first * V
        local c = within // size + 1
        if backward then c = V + 1 - c end
        return c, first + within % size + 1
      end
      local function fwd(k)
        local c, i = item(k, false)
        local g = (c - 1) * P + s
        if g > 0 then add("recv_act", i, c) end
        add("forward", i, c)
        if g < G - 1 then add("send_act", i, c) end
      end
      local function bwd(k)
        local c, i = item(k, true)
        local g = (c - 1) * P + s
        if g < G - 1 then add("recv_grad", i, c) end
        add("backward", i, c)
        if g > 0 then add("send_grad", i, c) end
      end
      local total = M * V
      if forward_only then
        for k = 0, total - 1 do fwd(k) end
        return out
      end
      local warm = math.min(2 * (P - s - 1) + (V - 1) * P, total)
      for k = 0, warm - 1 do fwd(k) end
      for j = 0, total - warm - 1 do
        fwd(warm + j)
        bwd(j)
      end
      for j = total - warm, total - 1 do bwd(j) end
      return out
    end

    local function all(name, P, M, V)
      local st = {}
      for s = 0, P - 1 do st[s + 1] = core.schedule(name, P, M, s, V) end
      return st
    end

    for key, lists in pairs(hand) do
      local P, V, M = key:match("(%d+),(%d+),(%d+)")
      P, V, M = tonumber(P), tonumber(V), tonumber(M)
      it(("(P=%d, V=%d, M=%d): every stage's actions equal the hand-written lists"):format(P, V, M), function()
        for s = 0, P - 1 do
          local got = core.schedule("interleaved", P, M, s, V)
          assert.same(parse(lists[s + 1]), got, ("stage %d: got %s"):format(s, show(got)))
          assert.same(textbook_interleaved(P, V, M, s), got)
        end
        assert.is_true(core.schedule_validate("interleaved", P, M, V))
      end)
    end

    for key, lists in pairs(hand_forward) do
      local P, V, M = key:match("(%d+),(%d+),(%d+)")
      P, V, M = tonumber(P), tonumber(V), tonumber(M)
      it(("forward only (P=%d, V=%d, M=%d): the hand-written lists"):format(P, V, M), function()
        for s = 0, P - 1 do
          local got = core.schedule("forward", P, M, s, V)
          assert.same(parse(lists[s + 1]), got, ("stage %d: got %s"):format(s, show(got)))
        end
        assert.is_true(core.schedule_validate("forward", P, M, V))
      end)
    end

    it("match the rule, validate, and hold what the warm-up says, for P <= 6, V <= 4, M = P, 2P, 3P", function()
      for P = 1, 6 do
        for V = 1, 4 do
          for M = P, 3 * P, P do
            local where = ("P=%d V=%d M=%d"):format(P, V, M)
            local ok, msg = core.schedule_validate("interleaved", P, M, V)
            assert.is_true(ok, where .. ": " .. tostring(msg))
            local st = all("interleaved", P, M, V)
            assert.is_true(simulate(st, M), where)
            for s = 0, P - 1 do
              assert.same(textbook_interleaved(P, V, M, s), st[s + 1], where .. " stage " .. s)
              -- every chunk runs every micro-batch both ways
              for c = 1, V do
                local f, b = {}, {}
                for _, a in ipairs(st[s + 1]) do
                  if (a[3] or 1) == c and a[1] == "forward" then f[#f + 1] = a[2] end
                  if (a[3] or 1) == c and a[1] == "backward" then b[#b + 1] = a[2] end
                end
                table.sort(f)
                table.sort(b)
                assert.equal(M, #f, where)
                assert.same(f, b, where)
              end
              local warm = math.min(2 * (P - s - 1) + (V - 1) * P, M * V)
              assert.equal(math.min(warm + 1, M * V), max_in_flight(st[s + 1]), where .. " stage " .. s)
            end
          end
        end
      end
    end)

    it("forward only: validates for P <= 5, V <= 3, any M <= 7; with V = 1 it is GPipe's forward half", function()
      for P = 1, 5 do
        for V = 1, 3 do
          for M = 1, 7 do
            local where = ("P=%d V=%d M=%d"):format(P, V, M)
            local ok, msg = core.schedule_validate("forward", P, M, V)
            assert.is_true(ok, where .. ": " .. tostring(msg))
            local st = all("forward", P, M, V)
            assert.is_true(simulate(st, M), where)
            for s = 0, P - 1 do
              assert.same(textbook_interleaved(P, V, M, s, true), st[s + 1], where .. " stage " .. s)
              if V == 1 then
                local fwd_half = {}
                for _, a in ipairs(core.schedule("gpipe", P, M, s)) do
                  if a[1] == "recv_act" or a[1] == "forward" or a[1] == "send_act" then fwd_half[#fwd_half + 1] = a end
                end
                assert.same(fwd_half, st[s + 1], where)
              end
            end
          end
        end
      end
    end)

    it("refuse micro-batches that are not a multiple of P, and more chunks for gpipe or 1f1b, saying why", function()
      local ok, err = pcall(core.schedule, "interleaved", 2, 3, 0, 2)
      assert.is_false(ok)
      assert.matches("interleaved with 2 chunks per stage needs micro%-batches %(3%) to be a multiple of the "
        .. "pipeline size %(2%)", err)
      for _, name in ipairs{ "gpipe", "1f1b" } do
        ok, err = pcall(core.schedule, name, 2, 4, 0, 2)
        assert.is_false(ok)
        assert.matches(name .. " runs one chunk per stage, not 2 %(more chunks need the interleaved schedule%)", err)
      end
      assert.is_true(core.schedule_validate("interleaved", 3, 5, 1)) -- one chunk: any M
    end)

    it("the checker follows chunks across the wrap-around and rejects a receive on the wrong chunk", function()
      local good = { parse(hand["2,2,2"][1]), parse(hand["2,2,2"][2]) }
      assert.is_true(core.schedule_validate(good, 2, 2))
      -- stage 1 receives for chunk 1 where chunk 2's activation (from stage 0's chunk 2) belongs
      local bad = { parse(hand["2,2,2"][1]), parse(hand["2,2,2"][2]) }
      bad[2][7] = { "recv_act", 1, 1 } -- the second receive of chunk 1's activation 1
      local ok, msg = core.schedule_validate(bad, 2, 2)
      assert.is_false(ok)
      assert.matches("stage 1 chunk 1 receives activation 1 twice", msg)
      ok, msg = core.schedule_validate({ parse("F1.3 SA1.3"), parse("RA1.1 F1.1") }, 1, 2)
      assert.is_false(ok)
      assert.matches("stage 0: chunk 3 out of range 1..2", msg)
    end)
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
      -- tags would sort it out under MPI, a device link (NCCL) matches in order
      { "receives in another order than the sends", {
          "F1 SA1 F2 SA2 RG2 B2 RG1 B1", "RA2 F2 B2 SG2 RA1 F1 B1 SG1" }, 2,
        "stage 1 receives activation 2 out of the order stage 0 sent it" },
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

  -- pg_schedule owns the names, the count in flight and the placement; the
  -- frontend (parallelize, the planner) asks these instead of restating them
  describe("exports", function()
    it("core.schedules() lists the one-chunk training schedules, the default first, and what runs with more chunks", function()
      local s = core.schedules()
      assert.same({ "1f1b", "gpipe" }, s.offered)
      assert.equal("1f1b", s.default)
      assert.same({ "gpipe", "1f1b", "interleaved", "forward" }, s.names)
      assert.same({ ["1f1b"] = "interleaved", interleaved = "interleaved", forward = "forward" }, s.chunked)
      for _, name in ipairs(s.names) do assert.is_table(core.schedule(name, 2, 2, 0)) end
    end)

    it("core.schedule_in_flight is the most each chunk holds on its action list", function()
      local function peak(list, chunk)
        local live, most = 0, 0
        for _, a in ipairs(list) do
          if (a[3] or 1) == chunk then
            if a[1] == "forward" then live = live + 1; most = math.max(most, live) end
            if a[1] == "backward" then live = live - 1 end
          end
        end
        return most
      end
      for P = 1, 6 do
        for M = 1, 12 do
          for _, name in ipairs{ "gpipe", "1f1b", "forward" } do
            for st = 0, P - 1 do
              assert.equal(peak(core.schedule(name, P, M, st), 1), core.schedule_in_flight(name, P, M, st),
                ("%s P=%d M=%d stage %d"):format(name, P, M, st))
            end
          end
          for V = 2, 3 do
            if P > 1 and M % P == 0 then
              for st = 0, P - 1 do
                local list = core.schedule("interleaved", P, M, st, V)
                for v = 1, V do
                  assert.equal(peak(list, v), core.schedule_in_flight("interleaved", P, M, st, V, v),
                    ("interleaved P=%d M=%d V=%d stage %d chunk %d"):format(P, M, V, st, v))
                end
              end
            end
          end
        end
      end
      -- no list is built for the two the planner searches: any M
      assert.equal(1 << 30, core.schedule_in_flight("gpipe", 8, 1 << 30, 7))
      assert.equal(8, core.schedule_in_flight("1f1b", 8, 1 << 30, 0))
      local ok, err = pcall(core.schedule_in_flight, "gpipe", 2, 4, 0, 2)
      assert.is_false(ok)
      assert.matches("gpipe runs one chunk per stage, not 2", err)
      ok, err = pcall(core.schedule_in_flight, "1f1b", 2, 4, 2)
      assert.is_false(ok)
      assert.matches("bad sizes %(P=2, V=1, M=4, stage 2, chunk 1%)", err)
    end)

    it("core.schedule_place puts piece g on rank (g - 1) % P as chunk (g - 1) // P + 1, as the actions' transfers do", function()
      for P = 1, 5 do
        for g = 1, 3 * P do
          local rank, chunk = core.schedule_place(g, P)
          assert.equal((g - 1) % P, rank)
          assert.equal((g - 1) // P + 1, chunk)
        end
      end
      -- piece g hands its activations to piece g + 1: the receiving chunk is where place says
      local P, M, V = 3, 3, 2
      for st = 0, P - 1 do
        for _, a in ipairs(core.schedule("interleaved", P, M, st, V)) do
          if a[1] == "send_act" then
            local rank, chunk = core.schedule_place((a[3] - 1) * P + st + 2, P)
            assert.equal((st + 1) % P, rank)
            assert.is_true(chunk == a[3] or chunk == a[3] + 1)
          end
        end
      end
      local ok, err = pcall(core.schedule_place, 0, 2)
      assert.is_false(ok)
      assert.matches("piece", err)
    end)
  end)
end)
