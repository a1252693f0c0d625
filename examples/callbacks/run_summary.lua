--- RunSummary: a custom callback with a rank-0 side effect.
--
-- Tracks the best validation loss (every rank, so the state is the same
-- everywhere and survives a resume), and at the end of training writes a
-- JSON summary to `path` (default <out_dir>/summary.json) on global rank 0
-- only, through pg.rank_zero_only.
--
--   local RunSummary = require "callbacks.run_summary"
--   pg.Trainer{ ..., callbacks = { RunSummary{} } }
local pg = require "pipegoose"
local cjson = require "cjson"

return function(opts)
  opts = opts or {}
  local cb = { name = "RunSummary", state_key = "RunSummary", best = nil, best_step = nil }

  function cb:on_validation_end(trainer)
    local v = trainer.state.metrics.val_loss
    if trainer.state.stage == "fit" and v and (self.best == nil or v < self.best) then
      self.best, self.best_step = v, trainer.state.step
    end
  end

  cb.on_train_end = pg.rank_zero_only(function(self, trainer)
    local st = trainer.state
    local path = opts.path or (trainer.out_dir .. "/summary.json")
    os.execute("mkdir -p '" .. path:match("^(.*)/[^/]*$") .. "'")
    local f = assert(io.open(path, "w"))
    f:write(cjson.encode{
      steps = st.step, epochs = st.epoch, tokens_seen = st.tokens_seen, stop_reason = st.stop_reason,
      final_loss = st.metrics.loss, best_val_loss = self.best, best_val_step = self.best_step,
    }, "\n")
    f:close()
    trainer:print("RunSummary: wrote " .. path)
  end)

  function cb:state_dict() return { best = self.best, best_step = self.best_step } end
  function cb:load_state_dict(sd) self.best, self.best_step = sd.best, sd.best_step end

  return pg.Callback(cb)
end
