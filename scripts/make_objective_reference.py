#!/usr/bin/python3
"""Write the fixture that objectives written in Lua are checked against
(spec/dist/objectives_spec.lua; issue: custom objectives in every layout).

Run from the repository root (needs torch, which CI does not have):

    /usr/bin/python3 scripts/make_objective_reference.py

Reads the tiny GPT-2 of spec/fixtures/gpt2_tiny_model.bin and the batch of
spec/fixtures/gpt2_tiny_state.bin (B = 4, T = 16), writes

  spec/fixtures/gpt2_tiny_teacher.bin  a second GPT-2 of the same shape (another
                                       init seed): the distillation teacher
  spec/fixtures/objectives.json        per objective, the loss before each of
                                       5 AdamW steps and the gradient norm

Objectives (the same arithmetic as pg.loss; torch's semantics):
  smooth_z   F.cross_entropy(label_smoothing=0.1, ignore_index=-100) over the
             real vocabulary + 1e-3 * mean(logsumexp^2) over the rows that
             count; the targets of the first 3 positions of every row are -100
  classify   no LM head: the last token's final hidden state -> Linear(32, 3)
             (its initial weight and bias are in the JSON) -> cross-entropy
             against one label per sequence
  distill    0.5 * cross-entropy + 0.5 * tau^2 * KL(teacher || student) with
             tau = 2 (F.kl_div of log-softmaxes, reduction "batchmean" over
             the B*T rows); the teacher is frozen

The reference runs in float64 (pipegoose runs float32; the specs' tolerance
says how far apart the two may be). AdamW as in make_reference.py: lr 1e-3,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on tensors of 2+ dimensions.
Deterministic: fixed seeds, one thread.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402

MODEL = "spec/fixtures/gpt2_tiny_model.bin"
STATE = "spec/fixtures/gpt2_tiny_state.bin"
TEACHER = "spec/fixtures/gpt2_tiny_teacher.bin"
OUT = "spec/fixtures/objectives.json"
STEPS = 5
CLASSES = 3
LABELS = [0, 2, 1, 2]
IGNORED_POSITIONS = 3


def load(path):
    cfg, tensors = g.read_model_file(path)
    model = g.GPT(cfg)
    g.load_llmc_tensors(model, tensors)
    return model.double()


def hidden(model, idx):
    """The final LayerNorm's output [B, T, C] (GPT.forward without the head)."""
    B, T = idx.shape
    x = F.embedding(idx, model.wte) + model.wpe[:T]
    for block in model.blocks:
        x = block(x)
    return model.lnf(x)


def real_logits(model, idx):
    V = model.cfg.vocab_size
    return (hidden(model, idx) @ model.wte.t())[..., :V]


def adamw(params):
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def run(params, objective):
    params = list(params)
    opt = adamw(params)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = objective()
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, float("inf")).item())
        opt.step()
    return {"losses": losses, "grad_norms": norms}


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg, _ = g.read_model_file(MODEL)
    state = g.read_state_file(STATE, cfg)
    x, y = state["x"], state["y"]
    B, T = x.shape
    V = cfg.vocab_size

    # The teacher: same shape, another init.
    teacher = g.GPT(cfg)
    g.init_weights(teacher, perturb=0.05, generator=torch.Generator().manual_seed(4242))
    g.write_model_file(TEACHER, teacher)
    teacher = teacher.double()
    for p in teacher.parameters():
        p.requires_grad_(False)

    out = {"description": __doc__.split("\n\n")[0], "model_file": os.path.basename(MODEL),
           "state_file": os.path.basename(STATE), "teacher_file": os.path.basename(TEACHER),
           "steps": STEPS, "torch_version": torch.__version__}

    # (a) label smoothing and z-loss, some targets ignored
    model = load(MODEL)
    y_ignored = y.clone()
    y_ignored[:, :IGNORED_POSITIONS] = -100

    def smooth_z():
        logits = real_logits(model, x).reshape(B * T, V)
        t = y_ignored.reshape(B * T)
        ce = F.cross_entropy(logits, t, label_smoothing=0.1, ignore_index=-100)
        lse = torch.logsumexp(logits, -1)[t != -100]
        return ce + 1e-3 * (lse * lse).mean()
    out["smooth_z"] = dict(run(model.parameters(), smooth_z), label_smoothing=0.1, z_loss=1e-3,
                           ignored_positions=IGNORED_POSITIONS)

    # (b) a classification head on the last token (no LM head: wte is the embedding only)
    model = load(MODEL)
    head = torch.nn.Linear(cfg.channels, CLASSES).double()
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(7))
        head.bias.copy_(0.05 * torch.randn(CLASSES, generator=torch.Generator().manual_seed(8)))
    head_init = {"weight": head.weight.tolist(), "bias": head.bias.tolist()}
    labels = torch.tensor(LABELS)

    def classify():
        return F.cross_entropy(head(hidden(model, x)[:, -1, :]), labels)
    out["classify"] = dict(run(list(model.parameters()) + list(head.parameters()), classify), classes=CLASSES,
                           labels=LABELS, head=head_init)

    # (c) distillation
    model = load(MODEL)
    with torch.no_grad():
        teacher_logits = real_logits(teacher, x).reshape(B * T, V)
    tau, alpha = 2.0, 0.5

    def distill():
        logits = real_logits(model, x).reshape(B * T, V)
        ce = F.cross_entropy(logits, y.reshape(B * T))
        kl = F.kl_div(F.log_softmax(logits / tau, -1), F.log_softmax(teacher_logits / tau, -1), log_target=True,
                      reduction="batchmean") * tau * tau
        return alpha * ce + (1 - alpha) * kl
    out["distill"] = dict(run(model.parameters(), distill), temperature=tau, alpha=alpha)

    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for k in ("smooth_z", "classify", "distill"):
        print(k, " ".join(f"{v:.7f}" for v in out[k]["losses"]))
    print(f"wrote {OUT}, {TEACHER}")


if __name__ == "__main__":
    main()
