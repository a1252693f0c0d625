#!/usr/bin/env python3
"""transformers' defaults of the config.json fields pipegoose's importer reads.

    python3 scripts/hf_defaults.py [OUT]     (default spec/fixtures/hf_config_defaults.json)

For each family lua/pipegoose/hf.lua imports (gpt2: GPT2Config, llama:
LlamaConfig, mixtral: MixtralConfig, bloom: BloomConfig) and each config.json field its
options() reads, writes the value transformers gives that field when
config.json does not have it: the config class built from the family's
fixture (spec/fixtures/hf_<family>_tiny/config.json) with the field removed,
as from_pretrained builds it. A value that depends on the other fields is
written as the rule ({"derived": "hidden_size // num_attention_heads"}),
found by building the class twice (the fixture's shape and the class's own)
and checked on both. Where the config class keeps None and the model derives
the value (GPT-2's n_inner, Mixtral's head_dim in 4.45.2), the rule is
checked against the modeling file's text, so another transformers version
fails here loudly rather than writing a wrong table. A field the class does
not have is written as null (transformers reads it as absent: no bias, no
scaling). spec/unit/hf_defaults_spec.lua imports each fixture with each field
removed and compares pipegoose's value with this table, and checks that the
importer reads exactly these fields.

Needs transformers only (no torch: the config classes and the modeling
files' text). Written with transformers 4.45.2, the fixtures' version (a
venv: python3 -m venv build/hfvenv && build/hfvenv/bin/pip install
transformers==4.45.2). Never run by CI: the table is committed.
"""
import importlib.util
import json
import os
import sys

import transformers
from transformers import BloomConfig, GPT2Config, LlamaConfig, MixtralConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA_FIELDS = [
    "vocab_size", "max_position_embeddings", "hidden_size", "num_attention_heads", "num_hidden_layers",
    "intermediate_size", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
    "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "rope_scaling",
]

# family -> (config class, fixture, the fields hf.lua's options() read)
FAMILIES = {
    "gpt2": (GPT2Config, "spec/fixtures/hf_gpt2_tiny", [
        "vocab_size", "n_positions", "n_embd", "n_head", "n_layer", "n_inner", "tie_word_embeddings",
        "activation_function", "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
    ]),
    "llama": (LlamaConfig, "spec/fixtures/hf_llama_tiny", LLAMA_FIELDS),
    "mixtral": (MixtralConfig, "spec/fixtures/hf_mixtral_tiny", LLAMA_FIELDS + [
        "num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
        "router_jitter_noise", "sliding_window",
    ]),
    "bloom": (BloomConfig, "spec/fixtures/hf_bloom_tiny", [
        "vocab_size", "hidden_size", "n_layer", "n_head", "layer_norm_epsilon",
        "apply_residual_connection_post_layernorm", "tie_word_embeddings", "seq_length",
        "n_embed", "num_attention_heads", "num_hidden_layers",
    ]),
}

# Rules a value absent from config.json may follow (hf_defaults_spec.lua evaluates them:
# field names of the same config, integers, * and //).
CANDIDATES = ["num_attention_heads", "hidden_size // num_attention_heads", "4 * n_embd"]

# Values the config class leaves None (or lacks) and the model derives: the
# rule and the modeling file's line that applies it.
MODELING = {
    ("gpt2", "n_inner"): ("4 * n_embd", "transformers.models.gpt2.modeling_gpt2",
                          "inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size"),
    ("mixtral", "head_dim"): ("hidden_size // num_attention_heads", "transformers.models.mixtral.modeling_mixtral",
                              "self.head_dim = self.hidden_size // self.num_heads"),
}

# Other spellings of a field the config class accepts (BloomConfig pops n_embed
# into hidden_size; its attribute_map sends the others to n_head / n_layer):
# checked to win over the field when both are given.
ALIASES = {
    ("bloom", "n_embed"): "hidden_size",
    ("bloom", "num_attention_heads"): "n_head",
    ("bloom", "num_hidden_layers"): "n_layer",
}

MISSING = object()


def evaluate(rule, config):
    return eval(rule, {"__builtins__": {}}, {k: getattr(config, k) for k in dir(config) if not k.startswith("_")})


def source_has(module, text):
    spec = importlib.util.find_spec(module)
    with open(spec.origin) as f:
        return text in f.read()


def entry(family, cls, fixture, field):
    if (family, field) in ALIASES:
        target = ALIASES[(family, field)]
        value = 2 * fixture[target]
        if getattr(cls.from_dict({**fixture, field: value}), target) != value:
            sys.exit(f"{family}.{field}: {cls.__name__} no longer reads it as {target}")
        return {"alias_of": target, "note": f"given with {target}, {field} wins"}
    without = {k: v for k, v in fixture.items() if k != field}
    config = cls.from_dict(without)
    bare = cls()
    got, own = getattr(config, field, MISSING), getattr(bare, field, MISSING)
    if (family, field) in MODELING:
        rule, module, line = MODELING[(family, field)]
        if got not in (None, MISSING) or own not in (None, MISSING):
            sys.exit(f"{family}.{field}: {cls.__name__} now has {got!r} (expected None: the model derives it)")
        if not source_has(module, line):
            sys.exit(f"{family}.{field}: {module} no longer has {line!r}; check the rule {rule!r} by hand")
        return {"derived": rule, "by": f"{module.rsplit('.', 1)[1]}.py: {line}"}
    if got is MISSING:
        if own is not MISSING:
            sys.exit(f"{family}.{field}: {cls.__name__}() has it but the fixture's build does not")
        return {"default": None, "note": f"not a {cls.__name__} attribute: absent, as transformers reads it"}
    if got == own:
        return {"default": got}
    for rule in CANDIDATES:
        try:
            if evaluate(rule, config) == got and evaluate(rule, bare) == own:
                return {"derived": rule}
        except (NameError, TypeError):
            pass
    sys.exit(f"{family}.{field}: {got!r} with the fixture, {own!r} by default, and no rule of {CANDIDATES} gives both")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "spec/fixtures/hf_config_defaults.json")
    table = {
        "transformers_version": transformers.__version__,
        "made_by": "scripts/hf_defaults.py: the value of each config.json field lua/pipegoose/hf.lua reads when "
                   "the field is absent ({default = value} or {derived = rule on the other fields})",
        "families": {},
    }
    for family, (cls, fixture_dir, fields) in FAMILIES.items():
        with open(os.path.join(ROOT, fixture_dir, "config.json")) as f:
            fixture = json.load(f)
        table["families"][family] = {
            "class": cls.__name__,
            "fields": {field: entry(family, cls, fixture, field) for field in fields},
        }
    with open(out, "w") as f:
        json.dump(table, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {out} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
