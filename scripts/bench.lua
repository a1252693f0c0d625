-- Training-step benchmarks: `make bench` (./pglua scripts/bench.lua).
--
-- Every figure is set against a peer measured in the same run: MFU against
-- the OpenBLAS sgemm peak measured first, tokens/s against PyTorch CPU on the
-- same step (when /usr/bin/python3 has torch) and llm.c's CPU trainer (when
-- LLMC_DIR is set), T = 2 and D = 2 against one
-- rank with one thread, measured pipeline bubbles against (P-1)/(M+P-1).
--
-- Parts: BENCH_ONLY=peak,gpt2,... picks some (default all); `./pglua
-- scripts/bench.lua --help` lists them with what each measures (the table of
-- scripts/bench/parts.lua, where a part is added).
-- BENCH_STEPS=n overrides the timed steps of each configuration.
--
-- Output: a readable table per part, and machine-readable lines
-- "<config> <metric> <value>" (e.g. "gpt2_124m mfu 0.55"), all from this one
-- process; each configuration runs in its own pglua (or mpirun) process so
-- that peak memory (VmHWM) is its own. Timings are medians of several steps
-- after a warm-up step. Peers are measured next to what they are compared
-- with (the one-rank and multi-rank runs twice each in mirrored order, ours
-- before and after PyTorch) so that a change in the machine's load lands on
-- both sides; still,
-- on a machine shared with other jobs single figures move by 10% and more
-- from run to run (multi-rank ones most). `chrt -f 10 make bench` (root)
-- keeps other work off the cores while it runs.
--
-- Files: scripts/bench/common.lua (helpers of the driver and the workers),
-- workers.lua (one configuration per process: this script with
-- --worker=step|pp|llmc-model), parts.lua and a file per longer part.
local pg = require "pipegoose"

-- scripts/bench/*.lua as require "bench.<name>", found next to this script
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path

local common = require "bench.common"

local PARTS = require "bench.parts"

local function usage()
  local lines = {
    "Usage: pglua scripts/bench.lua [--help]",
    "",
    "Training-step benchmarks, each figure against a peer measured in the same run.",
    "",
    "Environment:",
    "  BENCH_ONLY=part,...  run these parts only (default: all), in the order below",
    "  BENCH_STEPS=n        timed steps of each configuration",
    "  LLMC_DIR=dir         a checkout of github.com/karpathy/llm.c (part llmc)",
    "",
    "Parts:",
  }
  for _, part in ipairs(PARTS) do
    -- a description's further lines start under its first: "  " .. name padded to 6 .. " "
    local text = part.description:gsub("\n", "\n" .. (" "):rep(9))
    lines[#lines + 1] = ("  %-6s %s"):format(part.name, text)
  end
  return table.concat(lines, "\n")
end

--- The parts that run: those BENCH_ONLY names (all when it is unset or
--- empty) and the parts they need. Returns the set that runs and want(name),
--- whether BENCH_ONLY selects name itself (the peers go by it).
local function select_parts()
  local known = {}
  for _, part in ipairs(PARTS) do
    for _, need in ipairs(part.needs or {}) do
      -- a part that is needed runs before the parts that need it
      assert(known[need], ("bench/parts.lua: %s needs %s, which is not an earlier part"):format(part.name, need))
    end
    known[part.name] = true
  end
  local sel = os.getenv("BENCH_ONLY")
  local only, unknown = {}, {}
  for p in (sel or ""):gmatch("[^,%s]+") do
    if known[p] then only[p] = true else unknown[#unknown + 1] = p end
  end
  if #unknown > 0 then
    local names = {}
    for _, part in ipairs(PARTS) do names[#names + 1] = part.name end
    error(("bench.lua: BENCH_ONLY: no part named %s; the parts are %s (--help says what each measures)")
      :format(table.concat(unknown, ", "), table.concat(names, ", ")), 0)
  end
  local function want(p) return sel == nil or sel == "" or only[p] == true end
  local runs = {}
  for _, part in ipairs(PARTS) do
    if want(part.name) then
      runs[part.name] = true
      for _, need in ipairs(part.needs or {}) do runs[need] = true end
    end
  end
  return runs, want
end

local function driver()
  local runs, want = select_parts()
  local steps_override = os.getenv("BENCH_STEPS")
  local ctx = {
    ncores = common.cores(),
    want = want,
    steps = function(n) return tostring(steps_override or n) end,
    results = {},
  }
  local t_start = pg.wtime()
  local machine = pg.machine()
  print(("pipegoose bench: %d cores, OpenBLAS sgemm + OpenMP, %s"):format(ctx.ncores, os.date("!%Y-%m-%d %H:%M UTC")))
  -- which kernels ran: OpenBLAS's core (pglua forces one from the CPU's features when OpenBLAS
  -- fell back to its generic kernels, src/runtime/pg_machine.h; the PyTorch peer gets the same setting)
  print(("  CPU features: %s; OpenBLAS core: %s%s"):format(machine.features, machine.blas_core,
    machine.blas_core_chosen and " (chosen by pglua from the features: OpenBLAS's own detection fell back to generic)" or ""))
  common.emit("machine", "blas_core", machine.blas_core)

  -- the finish shared by the parts that ran last: called before a part with
  -- another finish (or none) runs, or at the end
  local pending
  for _, part in ipairs(PARTS) do
    if runs[part.name] and part.run then
      if pending and pending ~= part.finish then pending(ctx) end
      pending = part.finish
      part.run(ctx)
    end
  end
  if pending then pending(ctx) end

  local failures = common.failures
  print()
  print(("bench finished in %.0f s%s"):format(pg.wtime() - t_start,
    #failures > 0 and (", FAILED: " .. table.concat(failures, ", ")) or ""))
  if #failures > 0 then os.exit(1) end
end

-- The driver takes no arguments (lua-argparse refuses any, and prints usage() for --help); the workers it
-- starts get --worker=NAME and their settings as --key=value (bench/common.lua's parse_args: the driver's
-- own protocol, not a user's command line).
if arg[1] and arg[1]:match("^%-%-worker=") then
  local o = common.parse_args(arg)
  local worker = require("bench.workers")[o.worker] or error("bench.lua: unknown worker " .. o.worker)
  worker(o)
else
  local p = require("argparse")("bench.lua")
  p:usage("Usage: pglua scripts/bench.lua [--help]")
  p:description((usage():gsub("^[^\n]*\n\n", "")))
  p:parse(arg)
  driver()
end
