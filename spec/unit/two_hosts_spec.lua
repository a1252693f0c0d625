-- Two hosts on this machine (scripts/netns_hosts.sh: a network namespace,
-- a UTS namespace and an address each, Open MPI's daemons started through
-- scripts/netns_agent.sh): a tensor=2 x pipeline=2 x data=2 run with four
-- ranks on each host, and a DiLoCo run with one island on each host, over
-- TCP between them, against the same runs on one host; and a host that
-- drops off mid-run. Needs root (ip netns): elsewhere
-- every test here is skipped with the reason.
local h = require "helpers"

local PREFIX, NET = "pgtest", "10.231.8" -- not the script's defaults: a user's own hosts stay untouched
local ENV = ("PG_NETNS_PREFIX=%s PG_NETNS_NET=%s "):format(PREFIX, NET)
local HOST1, HOST2 = PREFIX .. "1", PREFIX .. "2"
local TRAIN = "spec/support/two_hosts_train.lua"

local function netns(args) return h.sh(ENV .. "scripts/netns_hosts.sh " .. args) end

local rc, why = netns("check")
local unavailable = rc ~= 0 and ("ip netns is not permitted here: " .. why:gsub("%s+$", "")) or nil

-- The mpirun options for the two hosts, four ranks each, as one quoted string.
local function host_args()
  local code, out = netns("mpirun-args 4")
  assert(code == 0, out)
  local q = {}
  for line in out:gmatch("[^\n]+") do q[#q + 1] = h.quote(line) end
  -- a host's daemon starts with a clean environment (as over ssh): the sanitizers' settings (make asan)
  -- go to its ranks by name
  for _, v in ipairs{ "ASAN_OPTIONS", "LSAN_OPTIONS", "UBSAN_OPTIONS" } do
    if os.getenv(v) then q[#q + 1] = "-x " .. v end
  end
  return table.concat(q, " ")
end

-- "rank R ..." lines by rank, and the loss lines, of a run's output.
local function parse(out)
  local r = { losses = {}, host = {}, node_size = {}, hosts = {}, params = {}, bytes = {} }
  for line in out:gmatch("[^\n]+") do
    local s, v = line:match("^loss (%d+) (.+)$")
    if s then r.losses[#r.losses + 1] = s .. " " .. v end
  end
  table.sort(r.losses)
  for rank, host, size, hosts in out:gmatch("rank (%d+) host (%S+) node_size (%d+) hosts (%d+)") do
    rank = tonumber(rank)
    r.host[rank], r.node_size[rank], r.hosts[rank] = host, tonumber(size), tonumber(hosts)
  end
  for rank, d in out:gmatch("rank (%d+) params (%x+)") do r.params[tonumber(rank)] = d end
  for rank, mode, b in out:gmatch("rank (%d+) bytes (%S+) (%d+)") do
    rank = tonumber(rank)
    r.bytes[rank] = r.bytes[rank] or {}
    r.bytes[rank][mode] = tonumber(b)
  end
  return r
end

-- Bytes through host 2's link (the root namespace's end of its veth pair), both ways.
local function link_bytes()
  local total = 0
  for _, f in ipairs{ "rx_bytes", "tx_bytes" } do
    local fh = assert(io.open(("/sys/class/net/%sv2/statistics/%s"):format(PREFIX, f)))
    total = total + assert(tonumber(fh:read("l")))
    fh:close()
  end
  return total
end

describe("two hosts (network namespaces, Open MPI over TCP)", function()
  if unavailable then
    it("are skipped", function() pending(unavailable) end)
    return
  end

  -- The hosts have fixed names and addresses, so two runs of this file at once (a sanitizer run beside a CI
  -- run) would tear down each other's hosts: a run holds an exclusive lock for its whole length, taken by a
  -- background flock that keeps it while the token file exists and this process lives, and waits up to 15
  -- minutes for another run to finish.
  local token = os.tmpname()
  local function hold_lock()
    local fh = assert(io.open("/proc/self/stat"))
    local pid = assert(fh:read("l"):match("^(%d+)"))
    fh:close()
    local code, out = h.sh(("flock -w 900 -x /run/lock/pipegoose-two-hosts-spec.lock sh -c "
      .. "'echo held > \"$0\"; while [ -e \"$0\" ] && kill -0 \"$1\" 2> /dev/null; do sleep 0.2; done' %s %s "
      .. "> /dev/null 2>&1 &"):format(h.quote(token), pid))
    assert(code == 0, out)
    for _ = 1, 9100 do -- 910 s of 0.1 s polls: flock's own wait is 900 s
      local f = io.open(token)
      local held = f and f:read("l") == "held"
      if f then f:close() end
      if held then return end
      h.sh("sleep 0.1")
    end
    error("two hosts: another run of this spec held /run/lock/pipegoose-two-hosts-spec.lock for 15 minutes")
  end

  -- made once for the file and removed whatever happens (up first removes what a crashed run left)
  lazy_setup(function()
    hold_lock()
    local code, out = netns("up 2")
    assert(code == 0, out)
  end)
  lazy_teardown(function()
    netns("down")
    os.remove(token) -- the lock's holder sees it gone and exits
  end)

  -- The run on one host and across the two; the bytes through host 2's link during the second.
  local function both(args)
    local code, out = h.sh(h.mpirun_cmd(8, args, 120))
    assert(code == 0, out)
    local one = parse(out)
    local before = link_bytes()
    code, out = h.sh(("timeout -k 5 %d scripts/mpirun.sh %s -x PG_ABORT_GRACE -np 8 %s"):format(h.limit(120),
      host_args(), h.pglua_cmd(args)))
    assert(code == 0, out)
    return one, parse(out), link_bytes() - before, out
  end

  local function assert_places(one, two, out)
    for rank = 0, 7 do
      assert.equal(1, one.hosts[rank], out)
      assert.equal(8, one.node_size[rank])
      -- ranks 0-3 on the first host, 4-7 on the second; each host is a node (MPI_COMM_TYPE_SHARED: no
      -- shared memory between them) and has its own name
      assert.equal(rank < 4 and HOST1 or HOST2, two.host[rank], out)
      assert.equal(4, two.node_size[rank])
      assert.equal(2, two.hosts[rank])
    end
  end

  -- the second host's ranks' traffic in these groups went through its link (TCP)
  local function assert_through_link(two, crossed, modes)
    local across = 0
    for rank = 4, 7 do
      for _, mode in ipairs(modes) do across = across + two.bytes[rank][mode] end
    end
    assert.is_true(across > 0)
    assert.is_true(crossed >= across, ("%d bytes through %sv2, but ranks 4-7 moved %d across"):format(crossed,
      PREFIX, across))
  end

  it("are two nodes to Open MPI and pipegoose, and give the single-host 2x2x2 run's losses and parameters bit for bit",
    function()
      local one, two, crossed, out = both{ TRAIN, "4" }
      assert_places(one, two, out)
      -- Bit for bit: the tensor and data groups stay inside a host (shared memory in both runs); what
      -- crosses the link is the pipeline's activations and gradients (copies), the tied embedding's
      -- gradient sum over 2 ranks and the loss and gradient norm sums over 2 stages (a + b either way).
      assert.equal(4, #one.losses)
      assert.same(one.losses, two.losses)
      for rank = 0, 7 do assert.equal(one.params[rank], two.params[rank], "rank " .. rank .. "'s parameters") end
      assert_through_link(two, crossed, { "pipeline", "embedding" })
    end)

  it("give the single-host run of 2 DiLoCo islands (one a host, tensor=2 x pipeline=2 each) bit for bit", function()
    local one, two, crossed, out = both{ TRAIN, "4", "diloco" }
    assert_places(one, two, out)
    -- Bit for bit: inside an island nothing crosses a host; the outer step's reduce-scatter (avg) over the
    -- 2 islands is (a + b) / 2 in either order, its all-gather a copy.
    assert.equal(8, #one.losses) -- 4 steps of each island
    assert.same(one.losses, two.losses)
    for rank = 0, 7 do assert.equal(one.params[rank], two.params[rank], "rank " .. rank .. "'s parameters") end
    -- step 4 was an outer step: the islands hold the same parameters (rank r and r + 4 the same shard)
    for rank = 0, 3 do assert.equal(two.params[rank], two.params[rank + 4]) end
    assert.is_true(one.losses[1] ~= one.losses[2], "the islands trained on the same rows")
    assert_through_link(two, crossed, { "islands" })
  end)

  -- The crash test's course (c: the layouts, the checkpoints' spacing, what the resumed run says): examples/
  -- train_gpt.lua across the hosts, a checkpoint every c.ckpt_every steps; once the first is out the second
  -- host's processes are killed (a crash: Open MPI ends the job). The run then resumes on the first host with
  -- the four ranks left, and, from a copy of the same checkpoint, on this machine without namespaces: the two
  -- continuations' losses and gradient norms agree to every printed digit (the same ranks, layout and
  -- arithmetic; nothing crosses a host). Returns the crashed job's log.
  local function crash_and_resume(c)
    local dir = os.tmpname()
    os.remove(dir)
    assert.equal(0, (h.sh("mkdir -p " .. h.quote(dir .. "/ref/checkpoints"))))
    local ids, x = {}, 7
    for i = 1, 20000 do
      x = (x * 1103515245 + 12345) % 2147483648
      ids[i] = (x >> 8) % 256
    end
    require("pipegoose").data.write_shard(dir .. "/train.bin", ids)
    require("pipegoose").data.write_shard(dir .. "/val.bin", { table.unpack(ids, 1, 2000) })
    local function train(layout, out, extra)
      local args = { "examples/train_gpt.lua", "--train=" .. dir .. "/train.bin", "--val=" .. dir .. "/val.bin",
        "--dim=32", "--layers=2", "--heads=4", "--seq-len=16", "--batch=8", "--steps=60", "--eval-every=1000",
        "--val-batches=1", "--log-every=1", "--sample=4", "--ckpt-every=" .. c.ckpt_every, "--zero=1", "--out=" .. out }
      for _, a in ipairs(layout) do args[#args + 1] = a end
      for _, a in ipairs(extra or {}) do args[#args + 1] = a end
      return h.pglua_cmd(args)
    end
    local TPD, TP1 = c.crashed, c.resumed
    -- every rank waits after the first checkpoint's step until the gate file exists (PG_TEST_GATE), which the
    -- spec makes once the second host is gone: the kill comes at that step however fast the steps are
    local cmd = ([[
PG_PROGRESS=plain PG_TEST_GATE=%d:%s/gate timeout -k 5 %d scripts/mpirun.sh %s -x PG_PROGRESS -x PG_TEST_GATE -np 8 %s \
  > %s/job.log 2>&1 &
job=$!
until [ -s %s/run/checkpoints/latest ] || ! kill -0 $job 2> /dev/null; do sleep 0.05; done
%sscripts/netns_hosts.sh kill %s
( sleep %d; touch %s/hung; kill $job ) > /dev/null 2>&1 &
guard=$!
touch %s/gate
wait $job
echo "job exit $?"
kill $guard 2> /dev/null]]):format(c.ckpt_every, dir, h.limit(120), host_args(), train(TPD, dir .. "/run"), dir, dir,
      ENV, HOST2, h.limit(10), dir, dir)
    local _, out = h.sh(cmd)
    local code = tonumber(out:match("job exit (%d+)"))
    local _, log = h.sh("cat " .. h.quote(dir .. "/job.log"))
    assert.is_true(code ~= nil and code ~= 0 and code ~= 124, out .. log)
    assert.matches("on node " .. HOST2, log, 1, true) -- Open MPI's notice of the lost daemon names the host
    -- and scripts/mpirun.sh names its ranks from the map rank 0 wrote (PG_HOST_MAP_FILE)
    assert.matches("\npipegoose: host " .. HOST2 .. " lost (ranks 4-7)\n", log, 1, true)
    -- a hang guard (h.limit(10) s after the kill), not a timing assertion
    assert.is_false(h.sh("test -e " .. h.quote(dir .. "/hung")) == 0, "the job outlived the host by 10 s: " .. log)
    local f = assert(io.open(dir .. "/run/checkpoints/latest"))
    local latest = f:read("l")
    f:close()
    local saved = tonumber(latest:match("^step%-0*(%d+)$"))
    assert.equal(c.ckpt_every, saved, "the checkpoint before the crash: " .. latest)
    assert.equal(0, (h.sh(("cp -r %s %s && printf %%s %s > %s"):format(h.quote(dir .. "/run/checkpoints/" .. latest),
      h.quote(dir .. "/ref/checkpoints/"), latest, h.quote(dir .. "/ref/checkpoints/latest")))))
    -- the first host alone (its four slots), then the same on this machine
    local one_host = host_args():gsub("'%-%-host' '[^']*'", "'--host' '" .. HOST1 .. ":4'")
    local rc1, out1 = h.sh(("PG_PROGRESS=plain timeout -k 5 %d scripts/mpirun.sh %s -x PG_PROGRESS -np 4 %s"):format(
      h.limit(120), one_host, train(TP1, dir .. "/run")))
    assert.equal(0, rc1, out1)
    assert.matches("resumed from " .. dir .. "/run/checkpoints/" .. latest .. " at step " .. saved, out1, 1, true)
    assert.matches(c.resumed_as, out1, 1, true)
    local rc2, out2 = h.sh(("PG_PROGRESS=plain timeout -k 5 %d scripts/mpirun.sh -x PG_PROGRESS -np 4 %s"):format(
      h.limit(120), train(TP1, dir .. "/ref")))
    assert.equal(0, rc2, out2)
    -- each step's loss and gradient norm as printed (the resumed run's records come after the lost run's)
    local function records(path)
      local by_step = {}
      for line in io.lines(path) do
        local step = line:match('^{"kind":"train","step":(%d+),')
        if step then by_step[tonumber(step)] = line:match('"grad_norm":[^,]+,"loss":[^,]+') end
      end
      return by_step
    end
    local got, want = records(dir .. "/run/metrics.jsonl"), records(dir .. "/ref/metrics.jsonl")
    for step = saved + 1, 60 do
      assert.is_truthy(want[step], "step " .. step .. " missing from the reference")
      assert.equal(want[step], got[step], "step " .. step)
    end
    h.sh("rm -rf " .. h.quote(dir))
    netns("up 2")
    return log
  end

  it("resume a 2x2x2 run whose second host crashed from its last checkpoint on the first host alone (2x2x1), as on "
    .. "one machine", function()
    -- data 2 -> 1: the checkpoint is resliced
    crash_and_resume{ ckpt_every = 20,
      crashed = { "--tensor=2", "--pipeline=2", "--data=2" },
      resumed = { "--tensor=2", "--pipeline=2", "--data=1", "--resume=last" },
      resumed_as = "resliced into tensor=2 pipeline=2 data=1" }
  end)

  it("resume a run of 2 DiLoCo islands (one a host) whose second host crashed from its last checkpoint with the "
    .. "island that remains, as on one machine", function()
    -- a checkpoint every outer step (every 10 steps, just after it): island 0's checkpoint holds the whole outer
    -- state (all-gathered over the islands at the save), so the first host resumes it as 1 island (new island 0
    -- takes old island 0's inner state; its outer state is the whole saved buffers)
    crash_and_resume{ ckpt_every = 10,
      crashed = { "--tensor=2", "--pipeline=2", "--data=1", "--islands=2", "--outer-every=10" },
      resumed = { "--tensor=2", "--pipeline=2", "--data=1", "--islands=1", "--outer-every=10", "--resume=last" },
      resumed_as = "resumed from" }
  end)

  it("end a DiLoCo run whose second host's link goes down with the watchdog's report naming the ranks and host",
    function()
    -- Islands talk only at outer steps (every 20 steps here): the link goes down after step 3 (every rank waits
    -- there for a gate file the spec makes once the link is down), so at step 20
    -- every rank of the first island waits for its partner on the second host in the outer step's agreement,
    -- and the watchdog (PG_COLLECTIVE_TIMEOUT=3, 12 under the sanitizers) names it. The run ends then: the
    -- failing ranks abort and scripts/mpirun.sh ends a mpirun that waits for the lost host's daemon (a hang
    -- guard stays at 120 s).
    -- (A host lost while a transfer it had agreed to is in flight leaves its partner blocked in that
    -- transfer, where no watchdog looks: the islands' long quiet stretches make that window small.)
    local log, gate = os.tmpname(), os.tmpname()
    os.remove(gate) -- the training waits after step 3 until it exists again
    local watchdog = h.limit(3)
    local cmd = ([[
PG_COLLECTIVE_TIMEOUT=%d timeout -k 5 %d scripts/mpirun.sh %s -x PG_COLLECTIVE_TIMEOUT -np 8 %s > %s 2>&1 &
job=$!
until grep -q '^loss 3 .* island 0' %s || ! kill -0 $job 2> /dev/null; do sleep 0.05; done
ip link set %sv2 down
touch %s
wait $job
echo "job exit $?"
cat %s]]):format(watchdog, h.limit(120), host_args(), h.pglua_cmd{ TRAIN, "100000", "diloco", "20", gate }, log, log,
      PREFIX, h.quote(gate), log)
    local _, out = h.sh(cmd)
    os.remove(log)
    os.remove(gate)
    netns("down") -- the second host's processes are stranded behind its link
    local code = tonumber(out:match("job exit (%d+)"))
    -- ended by the failing ranks and scripts/mpirun.sh, not the hang guard (124)
    assert.is_true(code ~= nil and code ~= 0 and code ~= 124, out)
    assert.matches("loss 3 ", out, 1, true)
    assert.is_nil(out:find("loss 21 ", 1, true), out)
    -- each rank of the first host names its partner on the second (world rank r + 4: the islands group's)
    for rank = 0, 3 do
      local line = out:match("%[rank " .. rank .. "%] [^\n]*never arrived")
      assert.is_truthy(line, out)
      assert.matches(" over the islands group: waited " .. watchdog .. " s (PG_COLLECTIVE_TIMEOUT) but rank "
        .. rank + 4 .. " on " .. HOST2 .. " never arrived", line, 1, true)
    end
    netns("up 2")
  end)
end)
