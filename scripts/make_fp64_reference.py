#!/usr/bin/python3
"""Write the float64 reference of the tiny GPT-2's AdamW steps (the fixture
that precision = "bf16" is checked against).

Run (from the repository root; needs torch, which CI does not have):

    /usr/bin/python3 scripts/make_fp64_reference.py

Reads spec/fixtures/gpt2_tiny_model.bin (weights), gpt2_tiny_state.bin (the
batch) and gpt2_tiny_steps.json (the AdamW hyperparameters, number of
steps), runs the same steps as make_reference.py with the model, the batch
and AdamW in float64, and writes spec/fixtures/gpt2_tiny_fp64_steps.json:
the loss before each update, the global gradient norm before each update
and the loss after the last one. The float32 weights of the model file are
exact in float64, so both references start from the same point.

Deterministic: one CPU thread; a rerun writes the same bytes.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fixtures", default="spec/fixtures")
    p.add_argument("--steps-in", default="gpt2_tiny_steps.json")
    p.add_argument("--out", default="gpt2_tiny_fp64_steps.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with open(os.path.join(a.fixtures, a.steps_in)) as f:
        ref = json.load(f)
    cfg, tensors = g.read_model_file(os.path.join(a.fixtures, ref["model_file"]))
    state = g.read_state_file(os.path.join(a.fixtures, ref["state_file"]), cfg)
    model = g.GPT(cfg)
    g.load_llmc_tensors(model, tensors)
    model = model.double()
    o = ref["optimizer"]
    if o.get("grad_clip") is not None:
        sys.exit("the steps file clips gradients; this reference does not")
    opt = g.make_adamw(model, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"])
    x, y = state["x"], state["y"]
    losses, grad_norms = [], []
    for _ in range(ref["num_steps"]):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
    with torch.no_grad():
        _, final_loss = model(x, y)
    out = {
        "description": "float64 PyTorch: losses of AdamW steps on the state file's batch, starting from the model "
                       "file, model and optimizer in float64. losses[i] (0-based) is the loss before update i+1.",
        "model_file": ref["model_file"],
        "state_file": ref["state_file"],
        "optimizer": o,
        "num_steps": ref["num_steps"],
        "dtype": "float64",
        "losses": losses,
        "grad_norms": grad_norms,
        "loss_after_last_step": final_loss.item(),
        "torch_version": torch.__version__,
    }
    path = os.path.join(a.fixtures, a.out)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print("losses " + " ".join(f"{v:.9f}" for v in losses) + f" -> {final_loss.item():.9f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
