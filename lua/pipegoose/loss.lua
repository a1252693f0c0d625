--- pg.loss: what an objective written in Lua takes its loss with.
--
-- An objective is objective(out, batch) -> loss, dout (pg.parallelize's or
-- forward_backward's objective=): the engine's last pipeline stage calls it
-- once per micro-batch with its output `out` [rows, width] (rows = batch x
-- seq_len, sequence-major) and `batch` = {targets ([batch, seq_len] int32),
-- batch, seq_len, micro_batch, first_row, want_grad, ctx, vocab}; it returns
-- the micro-batch's loss and d loss / d out. The engine averages the
-- micro-batches' losses and scales the gradients to match.
--
-- cross_entropy and kl_div are C (src/engine/pg_loss.c): given batch.vocab and
-- batch.ctx they work on logits split by vocabulary over the tensor group.
-- The last-token helpers serve heads that read one position per sequence.
local core = require "pipegoose.core"

local M = {
  cross_entropy = core.loss.cross_entropy,
  kl_div = core.loss.kl_div,
}

local function rows_of(out, batch, where)
  if type(batch) ~= "table" or math.type(batch.batch) ~= "integer" or math.type(batch.seq_len) ~= "integer" then
    error(("%s: the second argument must be the batch table objective(out, batch) gets"):format(where), 3)
  end
  if out:dim() ~= 2 or out:size(1) ~= batch.batch * batch.seq_len then
    error(("%s: expected %d x %d rows, got a tensor of shape {%s}"):format(where, batch.batch, batch.seq_len,
      table.concat(out:shape(), ", ")), 3)
  end
  return batch.batch, batch.seq_len, out:size(2)
end

--- The last position of every sequence: out [batch * seq_len, W] -> [batch, W] (a copy).
function M.last_tokens(out, batch)
  local B, T, W = rows_of(out, batch, "loss.last_tokens")
  local last = core.zeros({ B, W }, { dtype = out:dtype() })
  for b = 1, B do last:narrow(1, b, 1):copy_(out:narrow(1, b * T, 1)) end
  return last
end

--- last_tokens' backward: d [batch, W] -> [batch * seq_len, W], zero at every other position.
function M.last_tokens_backward(d, batch)
  if type(batch) ~= "table" or math.type(batch.batch) ~= "integer" or math.type(batch.seq_len) ~= "integer" then
    error("loss.last_tokens_backward: the second argument must be the batch table objective(out, batch) gets", 2)
  end
  local B, T = batch.batch, batch.seq_len
  if d:dim() ~= 2 or d:size(1) ~= B then
    error(("loss.last_tokens_backward: expected %d rows, got a tensor of shape {%s}"):format(B,
      table.concat(d:shape(), ", ")), 2)
  end
  local full = core.zeros{ B * T, d:size(2) }
  for b = 1, B do full:narrow(1, b * T, 1):copy_(d:narrow(1, b, 1)) end
  return full
end

return M
