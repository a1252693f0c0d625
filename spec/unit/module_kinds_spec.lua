-- core.module_kinds(): the runtime's registry of module kinds
-- (src/nn/module_registry.c) as Lua sees it. pg.nn reads whether a kind
-- handles this rank's rows under sequence parallelism from here, and
-- parallelize's tree walks ask these traits instead of kind names, so every
-- pg.nn kind must have its runtime twin and the traits must say what the
-- runtime does (the dist specs check the behaviour itself).
local core = require "pipegoose.core"
local nn = require "pipegoose.nn"

describe("core.module_kinds", function()
  local kinds = core.module_kinds()

  it("has a runtime kind for every pg.nn kind", function()
    for name in pairs(nn.kinds) do assert.is_table(kinds[name], name) end
  end)

  it("says how each kind is assembled", function()
    assert.equal("list", kinds.sequential.assembly)
    assert.equal("wrapper", kinds.residual.assembly)
    assert.equal("wrapper", kinds.recompute.assembly)
    assert.equal("lua", kinds.lua.assembly)
    assert.equal("internal", kinds.objective.assembly)
    for _, k in ipairs{ "linear", "layernorm", "rmsnorm", "gelu", "swiglu", "attention", "embedding", "lm_head", "moe",
                        "sp_gather", "sp_scatter" } do
      assert.equal("built", kinds[k].assembly, k)
    end
  end)

  it("gives the sequence-parallel roles the runtime applies", function()
    assert.same({ plain = "row_wise", column = "gathers", row = "scatters" }, kinds.linear.sequence_parallel)
    for _, k in ipairs{ "sequential", "residual", "recompute", "layernorm", "rmsnorm", "gelu", "swiglu" } do
      assert.equal("row_wise", kinds[k].sequence_parallel, k)
    end
    assert.equal("gathers", kinds.lm_head.sequence_parallel)
    assert.equal("scatters", kinds.embedding.sequence_parallel)
    for _, k in ipairs{ "attention", "moe", "lua", "objective" } do
      assert.equal("all_rows", kinds[k].sequence_parallel, k)
    end
    assert.equal("transition", kinds.sp_gather.sequence_parallel)
  end)

  it("names the host-only kinds and the flags parallelize walks by", function()
    assert.is_false(kinds.moe.host_only)
    assert.is_false(kinds.lua.host_only) -- a module written in Lua runs on any backend (pg.ops on its device)
    assert.is_false(kinds.linear.host_only)
    assert.is_true(kinds.lm_head.head)
    assert.is_true(kinds.moe.router)
    assert.is_true(kinds.lua.written_in_lua)
    assert.is_true(kinds.attention.selective)
    assert.is_true(kinds.gelu.passes_bf16 and kinds.swiglu.passes_bf16 and kinds.attention.passes_bf16)
    assert.is_false(kinds.linear.passes_bf16)
    assert.is_true(kinds.residual.bf16_branch)
    assert.is_true(kinds.recompute.recomputes)
  end)

  it("is a fresh table each call", function()
    local a, b = core.module_kinds(), core.module_kinds()
    assert.are_not.equal(a, b)
    a.linear.assembly = "changed"
    assert.equal("built", b.linear.assembly)
  end)
end)
