-- Two hosts on this machine (scripts/netns_hosts.sh: a network namespace,
-- a UTS namespace and an address each, Open MPI's daemons started through
-- scripts/netns_agent.sh): a tensor=2 x pipeline=2 x data=2 run with four
-- ranks on each host, over TCP between them, against the same run on one
-- host; and a host that drops off mid-run. Needs root (ip netns): elsewhere
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
  return table.concat(q, " ")
end

-- "rank R ..." lines by rank, and the loss lines, of a run's output.
local function parse(out)
  local r = { losses = {}, host = {}, node_size = {}, hosts = {}, params = {}, bytes = {} }
  for s, v in out:gmatch("\nloss (%d+) (%S+)") do r.losses[tonumber(s)] = v end
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

  -- made once for the file and removed whatever happens (up first removes what a crashed run left)
  lazy_setup(function()
    local code, out = netns("up 2")
    assert(code == 0, out)
  end)
  lazy_teardown(function() netns("down") end)

  it("are two nodes to Open MPI and pipegoose, and give the single-host 2x2x2 run's losses and parameters bit for bit",
    function()
      local code, out = h.sh(h.mpirun_cmd(8, { TRAIN, "4" }, 120))
      assert(code == 0, out)
      local one = parse(out)
      local before = link_bytes()
      code, out = h.sh(("timeout -k 5 %d scripts/mpirun.sh %s -x PG_ABORT_GRACE -np 8 %s"):format(h.limit(120),
        host_args(), h.pglua_cmd{ TRAIN, "4" }))
      assert(code == 0, out)
      local crossed = link_bytes() - before
      local two = parse(out)
      for rank = 0, 7 do
        assert.equal(1, one.hosts[rank], out)
        assert.equal(8, one.node_size[rank])
        -- pipeline stage 0 (ranks 0-3) on the first host, stage 1 on the second; each host is a node
        -- (MPI_COMM_TYPE_SHARED: no shared memory between them) and has its own name
        assert.equal(rank < 4 and HOST1 or HOST2, two.host[rank], out)
        assert.equal(4, two.node_size[rank])
        assert.equal(2, two.hosts[rank])
      end
      -- Bit for bit: the tensor and data groups stay inside a host (shared memory in both runs); what
      -- crosses the link is the pipeline's activations and gradients (copies), the tied embedding's
      -- gradient sum over 2 ranks and the loss and gradient norm sums over 2 stages (a + b either way).
      assert.equal(4, #one.losses)
      assert.same(one.losses, two.losses)
      for rank = 0, 7 do assert.equal(one.params[rank], two.params[rank], "rank " .. rank .. "'s parameters") end
      -- the second host's ranks' pipeline and embedding traffic went through its link (TCP)
      local across = 0
      for rank = 4, 7 do across = across + two.bytes[rank].pipeline + two.bytes[rank].embedding end
      assert.is_true(across > 0)
      assert.is_true(crossed >= across, ("%d bytes through %sv2, but ranks 4-7 moved %d across"):format(crossed,
        PREFIX, across))
    end)

  it("report a host whose link goes down mid-run through the watchdog, naming the host and the ranks", function()
    -- PG_COLLECTIVE_TIMEOUT=2: the watchdog's deadline (a hang guard around the job stays 60 s)
    local log = os.tmpname()
    local cmd = ([[
PG_COLLECTIVE_TIMEOUT=2 timeout -k 5 %d scripts/mpirun.sh %s -x PG_COLLECTIVE_TIMEOUT -x PG_ABORT_GRACE -np 8 %s > %s 2>&1 &
job=$!
until grep -q '^loss 3 ' %s || ! kill -0 $job 2> /dev/null; do sleep 0.1; done
ip link set %sv2 down
wait $job
echo "job exit $?"
cat %s]]):format(h.limit(60), host_args(), h.pglua_cmd{ TRAIN, "100000" }, log, log, PREFIX, log)
    local _, out = h.sh(cmd)
    os.remove(log)
    netns("down") -- the second host's processes are stranded behind its link
    local code = tonumber(out:match("job exit (%d+)"))
    -- ended by the failing ranks and scripts/mpirun.sh (mpirun cannot reach the lost host's daemon), not the
    -- hang guard (124)
    assert.is_true(code ~= nil and code ~= 0 and code ~= 124, out)
    assert.matches("loss 3 ", out, 1, true)
    -- every rank of the first host waited on one of the second's, and says which and where
    local named = out:match("waited 2 s %(PG_COLLECTIVE_TIMEOUT%) but rank ([4-7] on " .. HOST2 .. ") never")
    assert.is_truthy(named, out)
    netns("up 2")
  end)
end)
