-- Plots a run's metrics with gnuplot (installed by scripts/install-deps.sh):
-- training and validation loss, the learning rate and tokens/s against the
-- optimizer step, one panel each, into a PNG (or an SVG, by the extension).
--
--   pglua scripts/plot.lua runs/train_gpt/metrics.jsonl -o loss.png [--title=TEXT] [--width=900] [--height=900]
--
-- METRICS is what pg.callbacks.MetricsLogger writes (JSON lines: records of
-- kind "train" with step, loss, lr, tokens_per_s; of kind "val" with val_loss).
-- A panel whose metric never appears is left out (no LearningRateMonitor: no
-- learning-rate panel).
local argparse = require "argparse"
local cjson = require("cjson").new()
local pg = require "pipegoose"

local parser = argparse("plot.lua", "Plot a run's metrics.jsonl with gnuplot.")
parser:argument("metrics", "A MetricsLogger JSON-lines file.")
parser:option("-o --output", "The image to write (.png or .svg)."):count(1)
parser:option("--title", "A title over the panels.")
parser:option("--width", "Image width in pixels.", "900"):convert(math.tointeger)
parser:option("--height", "Image height in pixels.", "900"):convert(math.tointeger)
local args = parser:parse()

local f, err = io.open(args.metrics, "r")
if not f then error(("plot.lua: cannot read %s: %s"):format(args.metrics, tostring(err)), 0) end
-- series name -> list of {step, value}
local series = { loss = {}, val_loss = {}, lr = {}, tokens_per_s = {} }
local lineno, records = 0, 0
for line in f:lines() do
  lineno = lineno + 1
  if line:match("%S") then
    local ok, rec = pcall(cjson.decode, line)
    if not ok or type(rec) ~= "table" then
      error(("plot.lua: %s:%d is not a JSON object (%s)"):format(args.metrics, lineno, tostring(rec)), 0)
    end
    records = records + 1
    local step = rec.step
    if type(step) == "number" then
      for name, list in pairs(series) do
        local v = rec[name]
        if type(v) == "number" and v == v then list[#list + 1] = { step, v } end
      end
    end
  end
end
f:close()
if #series.loss == 0 and #series.val_loss == 0 then
  error(("plot.lua: %s has no loss or val_loss records (%d records read)"):format(args.metrics, records), 0)
end

local format = args.output:match("%.svg$") and "svg" or "png"
if format == "png" and not args.output:match("%.png$") then
  error("plot.lua: -o must name a .png or .svg file, got " .. args.output, 0)
end

-- The data, one file per series, in a fresh directory removed at the end.
local tmp = os.tmpname()
os.remove(tmp)
pg.fs.mkdir_p(tmp)
local function data_file(name)
  local path = tmp .. "/" .. name .. ".dat"
  local out = assert(io.open(path, "w"))
  for _, p in ipairs(series[name]) do out:write(("%d %.10g\n"):format(p[1], p[2])) end
  out:close()
  return path
end

local function q(s) return '"' .. tostring(s):gsub('\\', '\\\\'):gsub('"', '\\"') .. '"' end
local panels = {}
if #series.loss + #series.val_loss > 0 then
  local plots = {}
  if #series.loss > 0 then plots[#plots + 1] = q(data_file("loss")) .. " using 1:2 with lines title 'train loss'" end
  if #series.val_loss > 0 then
    plots[#plots + 1] = q(data_file("val_loss")) .. " using 1:2 with linespoints pt 7 title 'val loss'"
  end
  panels[#panels + 1] = { ylabel = "loss", plot = table.concat(plots, ", ") }
end
if #series.lr > 0 then
  panels[#panels + 1] = { ylabel = "learning rate", plot = q(data_file("lr")) .. " using 1:2 with lines notitle" }
end
if #series.tokens_per_s > 0 then
  panels[#panels + 1] = { ylabel = "tokens/s", plot = q(data_file("tokens_per_s")) .. " using 1:2 with lines notitle" }
end

local script = {
  ("set terminal %s size %d,%d"):format(format == "svg" and "svg" or "pngcairo", args.width, args.height),
  "set output " .. q(args.output),
  ("set multiplot layout %d,1%s"):format(#panels, args.title and (" title " .. q(args.title)) or ""),
  "set grid", "set key top right", "set xlabel 'step'",
}
for _, p in ipairs(panels) do
  script[#script + 1] = "set ylabel " .. q(p.ylabel)
  script[#script + 1] = "plot " .. p.plot
end
script[#script + 1] = "unset multiplot"
local gp = tmp .. "/plot.gp"
local g = assert(io.open(gp, "w"))
g:write(table.concat(script, "\n"), "\n")
g:close()
-- The user's paths are inside the script file; the shell sees only the
-- temporary directory's name, which os.tmpname makes of plain characters.
local ok = os.execute("gnuplot " .. gp .. " 2> " .. tmp .. "/err")
local errs = io.open(tmp .. "/err"):read("a")
pg.fs.remove_tree(tmp)
if not ok then error("plot.lua: gnuplot failed: " .. errs, 0) end
print(("wrote %s: %d panels from %d records"):format(args.output, #panels, records))
