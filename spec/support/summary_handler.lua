-- busted output handler for pipegoose's test runner. Prints one line per
-- failing or erroring test (with the rank under mpirun) and writes a JSON
-- summary to $PG_TEST_SUMMARY.<rank> for scripts/test_summary.lua to merge.
-- Without PG_TEST_SUMMARY it behaves like a terse terminal handler.
local cjson = require "cjson"

return function(options)
  local busted = require "busted"
  local handler = require "busted.outputHandlers.base"()
  local rank = tonumber(os.getenv("OMPI_COMM_WORLD_RANK") or os.getenv("PMI_RANK") or "0")
  local prefix = os.getenv("OMPI_COMM_WORLD_SIZE") and ("[rank " .. rank .. "] ") or ""
  local results = {}

  local function record(element, status, message)
    results[#results + 1] = { name = handler.getFullName(element), status = status, message = message }
  end

  handler.testEnd = function(element, parent, status)
    if status == "success" then record(element, "passed")
    elseif status == "pending" then record(element, "skipped") end
    return nil, true
  end

  handler.failureTest = function(element, parent, message, debug)
    local where = debug and debug.short_src and (debug.short_src .. ":" .. (debug.currentline or "?")) or ""
    local msg = tostring(message)
    record(element, "failed", where .. " " .. msg)
    io.stderr:write(prefix, "FAIL ", handler.getFullName(element), "\n    ", where, " ", msg:gsub("\n", "\n    "), "\n")
    return nil, true
  end

  handler.errorAny = function(element, parent, message, debug)
    if element.descriptor == "it" then return nil, true end -- reported by failureTest
    local name = handler.getFullName(element)
    record(element, "failed", "error: " .. tostring(message))
    io.stderr:write(prefix, "ERROR in ", element.descriptor or "?", " ", name, "\n    ", tostring(message), "\n")
    return nil, true
  end

  handler.suiteEnd = function()
    local path = os.getenv("PG_TEST_SUMMARY")
    local passed, failed = 0, 0
    for _, r in ipairs(results) do
      if r.status == "passed" then passed = passed + 1 elseif r.status == "failed" then failed = failed + 1 end
    end
    if path then
      local tmp = path .. "." .. rank .. ".tmp"
      local f = assert(io.open(tmp, "w"))
      f:write(cjson.encode({ rank = rank, results = results }))
      f:close()
      assert(os.rename(tmp, path .. "." .. rank))
    end
    if rank == 0 and not path then io.write(("%d passed, %d failed\n"):format(passed, failed)) end
    io.flush()
    return nil, true
  end

  busted.subscribe({ "test", "end" }, handler.testEnd, { predicate = handler.cancelOnPending })
  busted.subscribe({ "failure", "it" }, handler.failureTest)
  busted.subscribe({ "error", "it" }, handler.failureTest)
  busted.subscribe({ "error" }, handler.errorAny)
  busted.subscribe({ "failure" }, handler.errorAny)
  busted.subscribe({ "suite", "end" }, handler.suiteEnd)
  return handler
end
