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
        Loads DIR with GPT2LMHeadModel.from_pretrained and prints
        "transformers_loss <v>" on the tokens of TOKENS.json (its "tokens").
"""
import json
import sys

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


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


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "loss":
        model = GPT2LMHeadModel.from_pretrained(sys.argv[2], torch_dtype=torch.float32).eval()
        with open(sys.argv[3]) as f:
            tokens = json.load(f)["tokens"]
        loss, _ = loss_of(model, tokens)
        print(f"transformers_loss {loss:.9g}")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
