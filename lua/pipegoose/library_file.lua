--- pipegoose.library_file: for the Lua files that recipes and scripts load
-- (dofile) rather than run. Called at the top of such a file, it does nothing
-- when the file is loaded; when the file is run by itself (pglua FILE
-- [--help]) it says what the file is and how it is used, then exits: 0 with
-- --help, 1 otherwise (a file run by mistake must not look like a success).
--   require "pipegoose.library_file"(usage, what)
return function(usage, what)
  local caller = debug.getinfo(2, "S").source
  if not (arg and caller == "@" .. tostring(arg[0])) then return end
  local help = arg[1] == "-h" or arg[1] == "--help"
  local out = help and io.stdout or io.stderr
  out:write("Usage: ", usage, "\n\n", what, "\n")
  os.exit(help and 0 or 1)
end
