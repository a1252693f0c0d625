#!/usr/bin/env python3
"""Tiny LlamaForCausalLM directories for the Hugging Face import's weight dtypes and rope_scaling types.
Needs torch and transformers 4.45.2 (never in CI: spec/unit/hf_import_spec.lua compares against what
this script committed).

    /tmp/hfvenv/bin/python scripts/make_hf_import_fixtures.py spec/fixtures

Writes, under the given directory:

  hf_llama_f16/              weights saved with torch_dtype=float16 (F16 safetensors)
  hf_llama_bf16/             the same weights saved as bfloat16 (BF16)
  hf_llama_rope_linear/      float32 weights, rope_scaling {"type": "linear", "factor": 4.0}
                             (the old "type" key, which transformers still reads; its config
                             also gets "rope_type", as LlamaConfig writes it)
  hf_llama_rope_dynamic/     rope_scaling {"rope_type": "dynamic", "factor": 2.0}
  hf_llama_rope_llama3/      rope_scaling Llama 3.1's: {"rope_type": "llama3", "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32}

Each is save_pretrained's config.json and model.safetensors of the same random model (vocab 61,
hidden 32, 1 layer, 2 query heads over 1 key/value head of head_dim 32 -- wider than hidden /
heads, so that RoPE has 16 frequencies -- intermediate 32, 64 positions, rope_theta 100, tied
head; matrices N(0, 0.1), RMSNorm weights 1 + 0.1 N(0, 1), as scripts/make_llama_reference.py
explains), and expected.safetensors:

  tokens    I32 [2, 16]      uniform in [0, 61)
  logits    F32 [2, 16, 61]  transformers' float32 logits of the directory loaded back with
                             from_pretrained(torch_dtype=float32, attn_implementation="eager"):
                             for the half-precision directories, the float32 model of the rounded
                             weights
  inv_freq  F32 [16]         that model's model.rotary_emb.inv_freq, as transformers computed it
                             (modeling_rope_utils.py's functions; for "dynamic" the one it uses at
                             sequences up to max_position_embeddings, all spec sequences)

rope_theta 100 (not 10000) and 64 positions make the three regions of llama3 all occur in 16
frequencies (wavelengths 2 pi 100^(i/16): 6.3 < 8 = 32 / 4 unchanged; 8.9 .. 25 smoothed; from
35 > 32 = 32 / 1 divided by 8) and the scaled frequencies change the logits by far more than the
float32 noise. Deterministic (fixed seeds, one thread): a rerun writes the same bytes.
"""
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=64, rope_theta=100.0, rms_norm_eps=1e-5,
             tie_word_embeddings=True, bos_token_id=60, eos_token_id=60)

CASES = [
    ("hf_llama_f16", torch.float16, None),
    ("hf_llama_bf16", torch.bfloat16, None),
    ("hf_llama_rope_linear", torch.float32, {"type": "linear", "factor": 4.0}),
    ("hf_llama_rope_dynamic", torch.float32, {"rope_type": "dynamic", "factor": 2.0}),
    ("hf_llama_rope_llama3", torch.float32, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
]


def random_model(rope_scaling):
    model = LlamaForCausalLM(LlamaConfig(rope_scaling=rope_scaling, **SIZES))
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():  # named_parameters: a fixed order
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def make(root, name, dtype, rope_scaling):
    out = os.path.join(root, name)
    shutil.rmtree(out, ignore_errors=True)
    model = random_model(rope_scaling).to(dtype)
    model.config.torch_dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    os.remove(os.path.join(out, "generation_config.json"))
    ref = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, SIZES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(42))
    with torch.no_grad():
        logits = ref(tokens).logits.float()
    inv_freq = ref.model.rotary_emb.inv_freq.float()
    save_file({"tokens": tokens.to(torch.int32).contiguous(), "logits": logits.contiguous(),
               "inv_freq": inv_freq.contiguous()}, os.path.join(out, "expected.safetensors"))
    print(f"{name}: inv_freq {inv_freq.tolist()}")
    for f in sorted(os.listdir(out)):
        print(f"  wrote {os.path.join(out, f)} ({os.path.getsize(os.path.join(out, f))} bytes)")


def main():
    torch.set_num_threads(1)
    root = sys.argv[1] if len(sys.argv) > 1 else "spec/fixtures"
    for name, dtype, rope in CASES:
        make(root, name, dtype, rope)


if __name__ == "__main__":
    main()
