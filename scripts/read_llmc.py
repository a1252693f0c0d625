#!/usr/bin/python3
"""Read the reference fixtures back and check them.

Run (from the repository root; needs torch):

    /usr/bin/python3 scripts/read_llmc.py
    /usr/bin/python3 scripts/read_llmc.py --model M.bin --state S.bin --steps S.json

Checks, printing the max abs difference of each comparison:
  1. the model file's header and sizes; padded wte rows are zero;
  2. PyTorch (scripts/gpt2_torch.py) loaded from the model file reproduces the
     state file's logits, loss and all 16 gradients on the state's batch;
  3. an independent float64 NumPy forward, written straight from the file's
     stacked arrays, gives the same logits and loss (checks the layout, not
     just that the writer and reader agree);
  4. central finite differences of that NumPy loss match the state file's
     gradients at a few entries of every tensor (checks the gradients against
     the definition, including the tied wte's two contributions);
  5. re-running the steps file's AdamW steps from the model file gives its losses.
Exits 1 if any check fails.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402

failures = []


def report(what, diff, tol, kind="max abs diff"):
    ok = diff <= tol
    if not ok:
        failures.append(what)
    print(f"  {'ok  ' if ok else 'FAIL'} {what:<28} {kind} {diff:.3e}  (tol {tol:.0e})")


# --------------------------------------------------------------------------
# Independent NumPy forward (float64) on the llm.c tensors


def np_layernorm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased, as LayerNorm
    return (x - mean) / np.sqrt(var + g.LN_EPS) * w + b


def np_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def np_forward(cfg, t, x, y):
    """t: dict name -> float64 array (file layout). -> (logits [B,T,V], loss)."""
    B, T = x.shape
    C, nh = cfg.channels, cfg.num_heads
    hs = C // nh
    h = t["wte"][x] + t["wpe"][:T]
    causal = np.triu(np.ones((T, T), dtype=bool), 1)
    for l in range(cfg.num_layers):
        a = np_layernorm(h, t["ln1w"][l], t["ln1b"][l])
        qkv = a @ t["qkvw"][l].T + t["qkvb"][l]
        # Part p (q, k, v) is columns p*C .. p*C+C-1; head j its j-th hs block.
        q, k, v = (qkv[..., p * C:(p + 1) * C].reshape(B, T, nh, hs).transpose(0, 2, 1, 3)
                   for p in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)
        s[..., causal] = -np.inf
        s = np.exp(s - s.max(-1, keepdims=True))
        att = s / s.sum(-1, keepdims=True)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        h = h + o @ t["attprojw"][l].T + t["attprojb"][l]
        m = np_layernorm(h, t["ln2w"][l], t["ln2b"][l])
        f = np_gelu_tanh(m @ t["fcw"][l].T + t["fcb"][l])
        h = h + f @ t["fcprojw"][l].T + t["fcprojb"][l]
    h = np_layernorm(h, t["lnfw"], t["lnfb"])
    logits = (h @ t["wte"].T)[..., :cfg.vocab_size]
    mx = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - mx).sum(-1)) + mx[..., 0]
    picked = np.take_along_axis(logits, y[..., None], -1)[..., 0]
    return logits, float((lse - picked).mean())


def finite_difference_check(cfg, tensors, state, per_tensor=3, h=1e-4):
    t64 = {n: v.numpy().astype(np.float64) for n, v in zip(g.LLMC_TENSOR_NAMES, tensors)}
    x, y = state["x"].numpy(), state["y"].numpy()
    rng = np.random.default_rng(0)
    worst_err, worst_name = 0.0, ""
    for name, grad in zip(g.LLMC_TENSOR_NAMES, state["grads"]):
        grad = grad.numpy()
        flat = t64[name].reshape(-1)  # a view: editing it edits t64[name]
        # The largest gradient entry plus a few random ones.
        picks = [int(np.abs(grad).argmax())] + list(rng.integers(0, flat.size, per_tensor - 1))
        for i in picks:
            keep = flat[i]
            flat[i] = keep + h
            up = np_forward(cfg, t64, x, y)[1]
            flat[i] = keep - h
            down = np_forward(cfg, t64, x, y)[1]
            flat[i] = keep
            numeric = (up - down) / (2 * h)
            # Relative error, floored so that near-zero entries compare absolutely.
            err = abs(numeric - grad.reshape(-1)[i]) / max(1e-3, abs(numeric))
            if err > worst_err:
                worst_err, worst_name = err, f"{name}[{i}]"
    return worst_err, worst_name


# --------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description="check the reference fixtures")
    p.add_argument("--model", default="spec/fixtures/gpt2_tiny_model.bin")
    p.add_argument("--state", default="spec/fixtures/gpt2_tiny_state.bin")
    p.add_argument("--steps", default="spec/fixtures/gpt2_tiny_steps.json",
                   help="steps JSON to replay ('' to skip)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    cfg, tensors = g.read_model_file(a.model)
    print(f"model {a.model}: {cfg}")
    n_params = sum(t.numel() for t in tensors)
    print(f"  {n_params} parameters, {os.path.getsize(a.model)} bytes")
    report("padded wte rows == 0", tensors[0][cfg.vocab_size:].abs().max().item()
           if cfg.padded_vocab_size > cfg.vocab_size else 0.0, 0.0)

    model = g.GPT(cfg)
    g.load_llmc_tensors(model, tensors)
    roundtrip = max((a_ - b_).abs().max().item() for a_, b_ in zip(g.llmc_tensors(model), tensors))
    report("load -> export round trip", roundtrip, 0.0)

    state = g.read_state_file(a.state, cfg)
    print(f"state {a.state}: B={state['B']} T={state['T']} loss={state['loss']:.7f}")
    report("state padded dwte rows == 0", state["grads"][0][cfg.vocab_size:].abs().max().item()
           if cfg.padded_vocab_size > cfg.vocab_size else 0.0, 0.0)

    print("PyTorch forward/backward vs state file:")
    logits, loss = model(state["x"], state["y"])
    loss.backward()
    report("logits", (logits[..., :cfg.vocab_size] - state["logits"]).abs().max().item(), 1e-5)
    report("padded logit columns == 0", logits[..., cfg.vocab_size:].abs().max().item()
           if cfg.padded_vocab_size > cfg.vocab_size else 0.0, 0.0)
    report("loss", abs(loss.item() - state["loss"]), 1e-5)
    for name, mine, ref in zip(g.LLMC_TENSOR_NAMES, g.llmc_tensors(model, grads=True), state["grads"]):
        report("d" + name, (mine - ref).abs().max().item(), 1e-5)

    print("independent float64 NumPy forward vs state file:")
    t64 = {n: v.numpy().astype(np.float64) for n, v in zip(g.LLMC_TENSOR_NAMES, tensors)}
    np_logits, np_loss = np_forward(cfg, t64, state["x"].numpy(), state["y"].numpy())
    report("logits", float(np.abs(np_logits - state["logits"].numpy()).max()), 1e-5)
    report("loss", abs(np_loss - state["loss"]), 1e-5)

    print("central finite differences (float64 NumPy loss) vs state gradients:")
    err, where = finite_difference_check(cfg, tensors, state)
    report(f"worst entry {where}", err, 1e-3, kind="rel err")

    if a.steps:
        with open(a.steps) as f:
            steps = json.load(f)
        o = steps["optimizer"]
        print(f"replaying {steps['num_steps']} AdamW steps of {a.steps}:")
        model = g.GPT(cfg)
        g.load_llmc_tensors(model, tensors)
        opt = g.make_adamw(model, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                           weight_decay=o["weight_decay"])
        mine = []
        for _ in range(steps["num_steps"]):
            opt.zero_grad(set_to_none=True)
            loss = model(state["x"], state["y"])[1]
            loss.backward()
            mine.append(loss.item())
            opt.step()
        final = model(state["x"], state["y"])[1].item()
        report("losses", max(abs(u - v) for u, v in zip(mine, steps["losses"])), 1e-5)
        report("loss after last step", abs(final - steps["loss_after_last_step"]), 1e-5)
        report("losses[0] == state loss", abs(steps["losses"][0] - state["loss"]), 0.0)

    if failures:
        print(f"FAILED: {', '.join(failures)}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
