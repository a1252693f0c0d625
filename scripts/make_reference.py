#!/usr/bin/python3
"""Write the GPT-2 reference fixtures that pipegoose's model is checked against.

Run (from the repository root; needs torch, which CI does not have):

    /usr/bin/python3 scripts/make_reference.py
    /usr/bin/python3 scripts/read_llmc.py          # checks the files it wrote

Writes, for a small random GPT-2 (defaults: max_seq_len 16, vocab 61 padded to
64, 2 layers, 4 heads, 32 channels; one batch B=4 x T=16):

  spec/fixtures/gpt2_tiny_model.bin   weights, llm.c's GPT-2 format (fp32)
  spec/fixtures/gpt2_tiny_state.bin   llm.c's debug state: the batch, logits,
                                      mean cross-entropy loss and all gradients
  spec/fixtures/gpt2_tiny_steps.json  hyperparameters and the losses of 10
                                      AdamW steps on that same batch

The committed gpt2_tiny_b8_state.bin / gpt2_tiny_b8_steps.json are the same
model on an 8-row batch (for 8 micro-batches):
  make_reference.py --batch=8 --state-out spec/fixtures/gpt2_tiny_b8_state.bin \
      --steps-out spec/fixtures/gpt2_tiny_b8_steps.json --model-out /tmp/same_model.bin
and gpt2_tiny_clip_steps.json the 4-row steps with the gradient norm clipped
to 0.05 (about 1/15 of its value) before every step:
  make_reference.py --clip=0.05 --steps-only --steps-out spec/fixtures/gpt2_tiny_clip_steps.json
Every steps file also lists the global gradient norm before each step
(before clipping). --steps-only rewrites a steps file and leaves the model and
state files alone: logits written on another machine can differ in the last
bit, and the committed ones are what the specs compare with.

Byte layouts: docs/FORMATS.md. The model is scripts/gpt2_torch.py.

Weights: N(0, 0.02) for embeddings and weight matrices, zero biases, LayerNorm
gain 1 / bias 0, padded wte rows zero -- and then every bias and LayerNorm
parameter is perturbed by 0.05 * N(0, 1) (--perturb), so that the fixture's
gradients also check how biases and LayerNorm parameters act (with exact 0/1
values some mistakes, e.g. a missing bias or swapped gain/bias, are invisible).
Tokens are uniform in [0, V); the targets are the inputs shifted by one.

Deterministic: fixed seeds and one CPU thread (so that no reduction order
depends on the machine's core count); a rerun writes the same bytes.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-seq-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=61)
    p.add_argument("--padded-vocab", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="B")
    p.add_argument("--seq-len", type=int, default=16, help="T (<= max-seq-len)")
    p.add_argument("--seed", type=int, default=1337, help="weight init seed")
    p.add_argument("--data-seed", type=int, default=42, help="token seed")
    p.add_argument("--perturb", type=float, default=0.05,
                   help="std of the noise added to biases and LayerNorm params")
    p.add_argument("--steps", type=int, default=10, help="AdamW steps K")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=None,
                   help="clip the global gradient norm to this before each step "
                        "(torch.nn.utils.clip_grad_norm_)")
    p.add_argument("--steps-only", action="store_true",
                   help="write only the steps file (the model and state files named stay as they are)")
    p.add_argument("--model-out", default="spec/fixtures/gpt2_tiny_model.bin")
    p.add_argument("--state-out", default="spec/fixtures/gpt2_tiny_state.bin")
    p.add_argument("--steps-out", default="spec/fixtures/gpt2_tiny_steps.json")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(1)
    cfg = g.GPTConfig(max_seq_len=a.max_seq_len, vocab_size=a.vocab,
                      padded_vocab_size=a.padded_vocab, num_layers=a.layers,
                      num_heads=a.heads, channels=a.channels)
    if a.seq_len > cfg.max_seq_len:
        sys.exit("--seq-len must not exceed --max-seq-len")

    # Model: built first, then initialised from its own generator, so that
    # module construction (which draws default inits) cannot shift the stream.
    model = g.GPT(cfg)
    g.init_weights(model, perturb=a.perturb, generator=torch.Generator().manual_seed(a.seed))

    # Batch: T+1 uniform tokens per row; x = first T, y = last T.
    data_gen = torch.Generator().manual_seed(a.data_seed)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len + 1), generator=data_gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    outputs = (a.steps_out,) if a.steps_only else (a.model_out, a.state_out, a.steps_out)
    for path in outputs:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if not a.steps_only:
        g.write_model_file(a.model_out, model)

    opt = g.make_adamw(model, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                       weight_decay=a.weight_decay)
    losses, grad_norms = [], []
    for step in range(a.steps):
        opt.zero_grad(set_to_none=True)
        logits, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        # the global norm before clipping (what clip_grad_norm_ returns);
        # max_norm = inf measures without changing the gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip or float("inf"))
        grad_norms.append(norm.item())
        if step == 0 and not a.steps_only:
            # The state file is the untouched model's forward/backward.
            g.write_state_file(a.state_out, x, y, logits[..., : cfg.vocab_size],
                               loss.item(), g.llmc_tensors(model, grads=True))
        opt.step()
    with torch.no_grad():
        _, final_loss = model(x, y)

    steps = {
        "description": "Losses of AdamW steps on the state file's batch, "
                       "starting from the model file. losses[i] (0-based) is the "
                       "loss before update i+1; losses[0] is the state file's loss.",
        "model_file": os.path.basename(a.model_out),
        "state_file": os.path.basename(a.state_out),
        "config": cfg.as_dict(),
        "batch": a.batch,
        "seq_len": a.seq_len,
        "init": {"seed": a.seed, "std": 0.02, "perturb": a.perturb},
        "data_seed": a.data_seed,
        "optimizer": {
            "name": "AdamW",
            "lr": a.lr,
            "betas": [a.beta1, a.beta2],
            "eps": a.eps,
            "weight_decay": a.weight_decay,
            "decay_tensors": ["wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"],
            "no_decay_tensors": ["ln1w", "ln1b", "qkvb", "attprojb", "ln2w", "ln2b",
                                 "fcb", "fcprojb", "lnfw", "lnfb"],
            "grad_clip": a.clip,
            "lr_schedule": "constant",
        },
        "num_steps": a.steps,
        "losses": losses,
        "grad_norms": grad_norms,
        "loss_after_last_step": final_loss.item(),
        "torch_version": torch.__version__,
    }
    with open(a.steps_out, "w") as f:
        json.dump(steps, f, indent=2)
        f.write("\n")

    print(f"reference loss {losses[0]:.7f}  (ln V = {torch.tensor(float(cfg.vocab_size)).log().item():.7f})")
    print("losses " + " ".join(f"{v:.6f}" for v in losses) + f" -> {final_loss.item():.6f}")
    for path in outputs:
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
