-- worlds: 1 2 4
-- Objectives written in Lua (pg.parallelize{objective=}, pg.loss) against
-- PyTorch (spec/fixtures/objectives.json, scripts/make_objective_reference.py)
-- in every layout this world allows: serial on 1 rank; T=2, P=2 and D=2 on
-- 2; T=2 x P=2 and T=2 x D=2 on 4. Each runs the fixture's 5 AdamW steps on
-- the fixture's batch (the tiny GPT-2 of gpt2_tiny_model.bin, B = 4, T = 16,
-- 2 micro-batches where the layout allows) and compares the loss before every
-- step and the gradient norm:
--   smooth_z  cross-entropy with label smoothing 0.1 and ignored targets,
--             plus z-loss 1e-3, on logits split by vocabulary (LMHead
--             output = "logits")
--   classify  no LM head; Linear(32, 3) on the last token's hidden state
--   distill   0.5 cross-entropy + 0.5 tau^2 KL to a frozen teacher (tau = 2)
--
-- Tolerance: relative 2e-5. The reference runs in float64, pipegoose in
-- float32; over 5 AdamW steps float32 rounding moves these losses by a few
-- 1e-7 relative (the GPT-2 fixtures, float32 against float32, agree to
-- ~2e-7), and a wrong gradient scale or a missing term moves them by 1e-3
-- or more.
local pg = require "pipegoose"
local cjson = require "cjson"

local W = pg.world_size()
local RTOL = 2e-5
local MODEL, STATE = "spec/fixtures/gpt2_tiny_model.bin", "spec/fixtures/gpt2_tiny_state.bin"
local TEACHER = "spec/fixtures/gpt2_tiny_teacher.bin"
local f = assert(io.open("spec/fixtures/objectives.json"))
local REF = cjson.decode(f:read("a"))
f:close()

local cfg = require("pipegoose.llmc").read_header(MODEL)
local B, T = 4, cfg.seq_len
local x = pg.file.read(STATE, 1024, B * T, "int32"):reshape{ B, T }
local y = pg.file.read(STATE, 1024 + 4 * B * T, B * T, "int32"):reshape{ B, T }

local LAYOUTS = ({
  [1] = { { name = "serial" } },
  [2] = { { name = "T=2", tensor = 2 }, { name = "P=2", pipeline = 2 }, { name = "D=2", data = 2 } },
  [4] = { { name = "T=2 x P=2", tensor = 2, pipeline = 2 }, { name = "T=2 x D=2", tensor = 2, data = 2 } },
})[W]

-- This data rank's rows of a [B, ...] tensor.
local function my_rows(ctx, t)
  local D, d = ctx:world_size("data"), ctx:local_rank("data")
  local n = t:size(1) // D
  return t:narrow(1, d * n + 1, n):clone()
end

-- Runs the fixture's steps; returns the losses and gradient norms.
local function train(layout, model, objective, setup)
  local ctx = pg.ParallelContext{ tensor = layout.tensor, pipeline = layout.pipeline, data = layout.data, seed = 1 }
  local micro = (layout.data or 1) == 1 and 2 or 1
  local engine = pg.parallelize(model, ctx, { micro_batches = micro, objective = objective and objective(ctx) })
  if setup then setup(engine, ctx) end
  local opt = pg.optim.AdamW(engine, { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
  local losses, norms = {}, {}
  for step = 1, REF.steps do
    opt:zero_grad()
    losses[step] = engine:forward_backward(my_rows(ctx, layout.x), my_rows(ctx, layout.y))
    norms[step] = opt:grad_norm()
    opt:step()
  end
  return losses, norms
end

local function assert_matches(ref, losses, norms, what)
  for i = 1, REF.steps do
    local l, n = ref.losses[i], ref.grad_norms[i]
    assert.is_true(math.abs(losses[i] - l) <= RTOL * math.abs(l),
      ("%s: step %d loss %.9g, PyTorch %.9g"):format(what, i, losses[i], l))
    assert.is_true(math.abs(norms[i] - n) <= RTOL * math.abs(n),
      ("%s: step %d grad norm %.9g, PyTorch %.9g"):format(what, i, norms[i], n))
  end
end

describe("objectives written in Lua match PyTorch (" .. W .. " ranks)", function()
  for _, layout in ipairs(LAYOUTS) do
    it(layout.name .. ": label smoothing, ignored targets and z-loss on vocabulary-split logits", function()
      local ref = REF.smooth_z
      local yi = y:clone()
      for b = 1, B do for s = 1, ref.ignored_positions do yi:set(b, s, -100) end end
      layout.x, layout.y = x, yi
      local function objective()
        return function(out, batch)
          local rows = out:size(1)
          local loss, d = pg.loss.cross_entropy(out, batch.targets:reshape{ rows }, { vocab = batch.vocab,
            ctx = batch.ctx, label_smoothing = ref.label_smoothing, z_loss = ref.z_loss })
          return loss, d
        end
      end
      local losses, norms = train(layout, pg.nn.GPT.load_llmc(MODEL, { head = "logits" }), objective)
      assert_matches(ref, losses, norms, layout.name)
    end)

    it(layout.name .. ": a classification head on the last token", function()
      local ref = REF.classify
      -- every position of a sequence carries its label; the objective reads the last
      local labels = pg.zeros({ B, T }, { dtype = "int32" })
      for b = 1, B do for s = 1, T do labels:set(b, s, ref.labels[b]) end end
      layout.x, layout.y = x, labels
      local function model()
        local m = pg.nn.GPT.load_llmc(MODEL, { head = "none" })
        m:add(pg.nn.Linear(cfg.dim, ref.classes, { name = "classifier" }))
        return m
      end
      local function objective()
        return function(out, batch)
          local last = pg.loss.last_tokens(out, batch)
          local labels_of = pg.loss.last_tokens(batch.targets:reshape{ out:size(1), 1 }, batch)
          local loss, d = pg.loss.cross_entropy(last, labels_of)
          return loss, pg.loss.last_tokens_backward(d, batch)
        end
      end
      local function setup(engine)
        local last_stage = engine.stage == engine.stages - 1
        if last_stage then
          engine:load_param("classifier.weight", pg.tensor(ref.head.weight))
          engine:load_param("classifier.bias", pg.tensor(ref.head.bias))
        end
      end
      local losses, norms = train(layout, model(), objective, setup)
      assert_matches(ref, losses, norms, layout.name)
    end)

    it(layout.name .. ": distillation from a frozen teacher (cross-entropy + KL)", function()
      local ref = REF.distill
      layout.x, layout.y = x, y
      local teacher_logits -- [B/D * T, vocab]: the teacher's logits of this data rank's rows
      local function objective(ctx)
        local teacher = pg.parallelize(pg.nn.GPT.load_llmc(TEACHER), ctx)
        local xs = my_rows(ctx, x)
        teacher_logits = teacher:forward(xs):reshape{ xs:numel(), cfg.vocab }
        return function(out, batch)
          local rows = out:size(1)
          local t = teacher_logits:narrow(1, batch.first_row, rows)
          local ce, dce = pg.loss.cross_entropy(out, batch.targets:reshape{ rows }, { vocab = batch.vocab,
            ctx = batch.ctx })
          local kl, dkl = pg.loss.kl_div(out, t, { vocab = batch.vocab, ctx = batch.ctx,
            temperature = ref.temperature })
          local a = ref.alpha
          return a * ce + (1 - a) * kl, dce:scale(a):add(dkl:scale(1 - a))
        end
      end
      local losses, norms = train(layout, pg.nn.GPT.load_llmc(MODEL, { head = "logits" }), objective)
      assert_matches(ref, losses, norms, layout.name)
    end)
  end
end)
