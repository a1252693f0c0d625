#!/usr/bin/env python3
"""Write a tiny random Mixtral in Hugging Face's layout and its PyTorch reference.

Run (from the repository root; needs torch and transformers, which CI does not have):

    /tmp/hfvenv/bin/python scripts/make_mixtral_reference.py spec/fixtures/hf_mixtral_tiny

The model is transformers' own MixtralForCausalLM (float32, eager attention),
saved with save_pretrained; the numbers are transformers' loss with
output_router_logits=True: the mean next-token cross-entropy plus
router_aux_loss_coef x load_balancing_loss_func over both layers' router
logits (no attention mask).

Defaults (hf_mixtral_tiny): vocab 61, hidden 32, 2 layers, 4 heads, 2 kv heads,
intermediate 48 per expert, 4 experts, top-2, router_aux_loss_coef 0.02 (not
Mixtral's 0.001, so that the load-balancing term shows in the gradients), 16
positions, rope_theta 10000, rms_norm_eps 1e-5, untied lm_head; batch B=4,
T=16; 10 AdamW steps with make_llama_reference.py's settings (lr 1e-3, betas
0.9/0.95, eps 1e-8, weight decay 0.1 on tensors of 2+ dimensions, the global
gradient norm clipped to --clip).

Weights: every matrix N(0, 0.1), the router gates N(0, --gate-std), every
RMSNorm weight 1 + 0.1 N(0, 1) (scripts/llama_torch.py's init_weights rule).
Routing is a discontinuous function of the weights: the run prints the
smallest gap between a token's k-th and (k+1)-th router probability over all
steps, so that float32 differences between implementations cannot flip a
choice (it should be well above 1e-5).

Writes into OUTDIR: config.json and model.safetensors (save_pretrained),
tokens.bin (an llm.c shard of B*(T+1) tokens; window b = tokens[b*(T+1) :
(b+1)*(T+1)], inputs its first T tokens, targets its last T; the same batch
every step) and expected.json: the settings, loss / ce_loss / aux_loss at the
written weights (aux_loss is load_balancing_loss_func's value, before the
coefficient), step_losses, step_ce_losses, step_aux_losses (before update k),
grad_norms (before clipping), final_loss, torch and transformers versions.

Deterministic: fixed seeds and one CPU thread.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers import MixtralConfig, MixtralForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_torch as L  # noqa: E402  (shard files, batch windows, AdamW groups)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--vocab", type=int, default=61)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=48)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--aux-coef", type=float, default=0.02)
    p.add_argument("--max-position", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=6, help="weight init seed (chosen for its routing gap, 1e-4)")
    p.add_argument("--data-seed", type=int, default=42)
    p.add_argument("--std", type=float, default=0.1)
    p.add_argument("--gate-std", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=None)
    return p.parse_args(argv)


def losses(model, x, y, gaps=None):
    out = model(input_ids=x, output_router_logits=True)
    V = out.logits.shape[-1]
    ce = F.cross_entropy(out.logits.reshape(-1, V), y.reshape(-1))
    if gaps is not None:  # the routing margin: k-th minus (k+1)-th probability
        k = model.config.num_experts_per_tok
        for lg in out.router_logits:
            p = torch.softmax(lg.detach().float(), dim=-1).sort(dim=-1, descending=True).values
            if k < p.shape[-1]:
                gaps.append(float((p[:, k - 1] - p[:, k]).min()))
    return ce, out.aux_loss


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.intermediate,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        max_position_embeddings=a.max_position, rms_norm_eps=1e-5, rope_theta=10000.0,
                        num_local_experts=a.experts, num_experts_per_tok=a.top_k, output_router_logits=True,
                        router_aux_loss_coef=a.aux_coef, tie_word_embeddings=False, sliding_window=None,
                        attn_implementation="eager", torch_dtype="float32")
    model = MixtralForCausalLM(cfg)
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, a.gate_std, generator=g)
            else:
                p.normal_(0.0, a.std, generator=g)
    tokens = torch.randint(0, a.vocab, (a.batch * (a.seq_len + 1),), generator=torch.Generator().manual_seed(a.data_seed))
    os.makedirs(a.outdir, exist_ok=True)
    path = lambda name: os.path.join(a.outdir, name)  # noqa: E731
    model.save_pretrained(a.outdir, safe_serialization=True)
    if os.path.exists(path("generation_config.json")):  # not a training input: not committed
        os.remove(path("generation_config.json"))
    L.write_shard(path("tokens.bin"), tokens.numpy())

    # the numbers are those of the files
    model = MixtralForCausalLM.from_pretrained(a.outdir, torch_dtype=torch.float32, attn_implementation="eager")
    model.train()  # no dropout in this config; jitter is 0
    x, y = L.batch_windows(L.read_shard(path("tokens.bin")), a.batch, a.seq_len)
    coef = cfg.router_aux_loss_coef
    with torch.no_grad():
        ce0, aux0 = losses(model, x, y)
    opt = L.make_adamw(model, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay)
    step_losses, step_ce, step_aux, norms, gaps = [], [], [], [], []
    for _ in range(a.steps):
        opt.zero_grad(set_to_none=True)
        ce, aux = losses(model, x, y, gaps)
        loss = ce + coef * aux
        loss.backward()
        step_losses.append(loss.item())
        step_ce.append(ce.item())
        step_aux.append(aux.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip if a.clip is not None else float("inf"))
        norms.append(norm.item())
        opt.step()
    with torch.no_grad():
        ce_f, aux_f = losses(model, x, y, gaps)
    expected = {
        "batch": a.batch, "seq_len": a.seq_len, "steps": a.steps, "lr": a.lr, "beta1": a.beta1, "beta2": a.beta2,
        "eps": a.eps, "weight_decay": a.weight_decay, "clip": a.clip, "aux_loss_coef": coef,
        "loss": (ce0 + coef * aux0).item(), "ce_loss": ce0.item(), "aux_loss": aux0.item(),
        "step_losses": step_losses, "step_ce_losses": step_ce, "step_aux_losses": step_aux, "grad_norms": norms,
        "final_loss": (ce_f + coef * aux_f).item(), "min_routing_gap": min(gaps),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    with open(path("expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    print(f"loss {expected['loss']:.9g} = ce {expected['ce_loss']:.9g} + {coef} x aux {expected['aux_loss']:.9g}")
    print("step_losses " + " ".join(f"{v:.7f}" for v in step_losses) + f" -> {expected['final_loss']:.7f}")
    print("step_aux " + " ".join(f"{v:.6f}" for v in step_aux))
    print("grad_norms " + " ".join(f"{v:.5f}" for v in norms))
    print(f"smallest routing gap {min(gaps):.3g}")
    for name in sorted(os.listdir(a.outdir)):
        print(f"wrote {path(name)} ({os.path.getsize(path(name))} bytes)")


if __name__ == "__main__":
    main()
