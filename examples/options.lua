-- What the examples' command lines share (lua-argparse): integer and number
-- options, and the parallel layout every example takes. An example loads it
-- from its own directory:
--   local o = dofile((arg[0]:match("^(.*/)") or "./") .. "options.lua")(parser)
--   o.int("--steps", 300, "Optimizer steps.")
--   o.layout()   -- --tensor, --pipeline, --data, --micro-batches
-- Run by itself (pglua examples/options.lua --help) it says what it is and how it is used.
require "pipegoose.library_file"("local o = dofile(here .. \"options.lua\")(parser)",
  "options.lua is not a script: the examples load it to add the options they share (integers, numbers, "
  .. "the parallel layout) to their lua-argparse parser.")
return function(p)
  local o = {}
  function o.to_int(s) return math.tointeger(tonumber(s)) end
  function o.int(name, default, help) p:option(name, help, default and tostring(default)):convert(o.to_int) end
  function o.num(name, default, help) p:option(name, help, default and tostring(default)):convert(tonumber) end
  function o.layout()
    o.int("--tensor", 1, "Tensor-parallel size.")
    o.int("--pipeline", 1, "Pipeline stages.")
    o.int("--data", nil, "Data-parallel size (default: world size / (tensor x pipeline)).")
    o.int("--micro-batches", 1, "Micro-batches per step.")
  end
  return o
end
