#!/usr/bin/env python3
"""Hugging Face `transformers` fixtures and checks for pipegoose's hf.lua.
Needs torch and transformers (never in CI; run where they are installed).

    python3 scripts/hf_reference.py make DIR
        A small random GPT2LMHeadModel (odd vocabulary 61, 16 positions, 32
        channels, 4 heads, 2 layers, every LayerNorm and bias perturbed so a
        misplaced tensor shows) saved with save_pretrained(DIR) in float32
        safetensors, and DIR/expected.json: a batch of tokens (4 x 17) and
        transformers' loss on it (mean cross-entropy of the next token over the
        first 16 positions) and its logits' sum of squares.
    python3 scripts/hf_reference.py loss DIR TOKENS.json
        Loads DIR with from_pretrained (GPT2LMHeadModel or LlamaForCausalLM,
        by config.json's model_type) and prints "transformers_loss <v>" on the
        tokens of TOKENS.json (its "tokens").
    python3 scripts/hf_reference.py llama-check DIR
        Checks a fixture of scripts/make_llama_reference.py (whose numbers come
        from scripts/llama_torch.py) against transformers: loads DIR with
        LlamaForCausalLM.from_pretrained (float32, eager attention), takes
        expected.json's batch from DIR/tokens.bin (window b = tokens[b*(T+1) :
        (b+1)*(T+1)], inputs its first T tokens, targets its last T), prints
        "transformers_loss <v>" and its difference from expected.json's
        "loss", then runs the same AdamW steps (same groups, clipping and
        hyperparameters) on transformers' model and compares the step losses,
        gradient norms and final loss. Exits 1 if a relative difference
        exceeds --tol (default 1e-5).

On the dev box: /tmp/hfvenv/bin/python (a venv with --system-site-packages
over Debian's torch, plus pip install transformers==4.45.2).
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

MODEL_CLASSES = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}


def loss_of(model, tokens):
    x = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        logits = model(x[:, :-1]).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return loss.item(), float((logits.double() ** 2).sum())


def make(out):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=60, eos_token_id=60)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # LayerNorm and biases: not 1 and 0
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 61, (4, 17), generator=g).tolist()
    loss, sq = loss_of(model, tokens)
    with open(f"{out}/expected.json", "w") as f:
        json.dump({"tokens": tokens, "loss": loss, "logits_sum_squares": sq,
                   "transformers": __import__("transformers").__version__, "torch": torch.__version__}, f)
    print(f"transformers_loss {loss:.9g}")


def load_model(path):
    """from_pretrained with the class config.json's model_type names."""
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    if model_type not in MODEL_CLASSES:
        sys.exit(f"{path}: model_type {model_type!r}, known: {', '.join(MODEL_CLASSES)}")
    kwargs = {"attn_implementation": "eager"} if model_type == "llama" else {}
    return MODEL_CLASSES[model_type].from_pretrained(path, torch_dtype=torch.float32, **kwargs).eval()


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def llama_check(argv):
    p = argparse.ArgumentParser(prog="hf_reference.py llama-check")
    p.add_argument("dir")
    p.add_argument("--tol", type=float, default=1e-5, help="largest relative difference accepted")
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama_torch as L  # the shard reader and the training loop

    torch.manual_seed(0)
    torch.set_num_threads(1)
    with open(os.path.join(a.dir, "expected.json")) as f:
        ex = json.load(f)
    model = LlamaForCausalLM.from_pretrained(a.dir, torch_dtype=torch.float32, attn_implementation="eager")
    x, y = L.batch_windows(L.read_shard(os.path.join(a.dir, "tokens.bin")), ex["batch"], ex["seq_len"])

    def forward_loss(m, xx, yy):
        logits = m(input_ids=xx).logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yy.reshape(-1))

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    sum_sq = float((logits.double() ** 2).sum())
    worst = {"loss": rel(loss, ex["loss"]), "logits_sum_squares": rel(sum_sq, ex["logits_sum_squares"])}
    print(f"transformers_loss {loss!r}")
    print(f"expected_loss {ex['loss']!r}  diff {loss - ex['loss']:.3e}  rel {worst['loss']:.3e}")
    print(f"logits_sum_squares {sum_sq!r}  expected {ex['logits_sum_squares']!r}  "
          f"rel {worst['logits_sum_squares']:.3e}")

    model.train()  # no dropout in a LLaMA; as a training loop would
    losses, norms, final = L.train_steps(model, forward_loss, x, y, ex["steps"], ex["lr"],
                                         (ex["beta1"], ex["beta2"]), ex["eps"], ex["weight_decay"], ex["clip"])
    worst["step_losses"] = max(rel(u, v) for u, v in zip(losses, ex["step_losses"]))
    worst["grad_norms"] = max(rel(u, v) for u, v in zip(norms, ex["grad_norms"]))
    worst["final_loss"] = rel(final, ex["final_loss"])
    for k, (u, v, n) in enumerate(zip(losses, ex["step_losses"], norms)):
        print(f"step {k + 1}: transformers_loss {u:.9f}  expected {v:.9f}  rel {rel(u, v):.2e}  "
              f"grad_norm {n:.7f}{'  clipped' if ex['clip'] is not None and n > ex['clip'] else ''}")
    print(f"final_loss {final:.9f}  expected {ex['final_loss']:.9f}  rel {worst['final_loss']:.2e}")
    print("max relative differences: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    if max(worst.values()) > a.tol:
        sys.exit(f"FAIL: a relative difference exceeds {a.tol}")
    print(f"OK (all within {a.tol})")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "llama-check":
        llama_check(sys.argv[2:])
    elif len(sys.argv) >= 4 and sys.argv[1] == "loss":
        model = load_model(sys.argv[2])
        with open(sys.argv[3]) as f:
            tokens = json.load(f)["tokens"]
        loss, _ = loss_of(model, tokens)
        print(f"transformers_loss {loss:.9g}")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
