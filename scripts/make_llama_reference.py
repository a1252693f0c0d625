#!/usr/bin/python3
"""Write a tiny random LLaMA in Hugging Face's layout and its PyTorch reference.

Run (from the repository root; needs torch, which CI does not have):

    /usr/bin/python3 scripts/make_llama_reference.py spec/fixtures/hf_llama_tiny
    /usr/bin/python3 scripts/make_llama_reference.py spec/fixtures/hf_llama_tiny_t4 \\
        --dim 64 --heads 8 --kv-heads 4 --intermediate 96 --tie --clip 2.8
    /tmp/hfvenv/bin/python scripts/hf_reference.py llama-check DIR   # transformers agrees?

Defaults (hf_llama_tiny): vocab 61 (odd), hidden 32, 2 layers, 4 heads, 2 kv
heads (grouped-query attention), intermediate 48, 16 positions, rope_theta
10000, rms_norm_eps 1e-5, untied lm_head; batch B=4, T=16; 10 AdamW steps.
hf_llama_tiny_t4 (the second command) has a tied lm_head and 8 heads / 4 kv
heads, so that 4 tensor-parallel ranks divide both (its model.safetensors is
259 KiB, hf_llama_tiny's 78 KiB). The clip values are
chosen so that clipping is active in some steps only, with a margin of a few
per cent either way (hf_llama_tiny: gradient norms 2.39, 1.99, 1.71 .. 1.52,
clip 1.8, clipped in steps 1-2; hf_llama_tiny_t4: norms 3.94, 3.26, 2.97,
2.90, 2.66 .. 1.89, clip 2.8, clipped in steps 1-4); the run prints which.

Writes into OUTDIR:

  config.json        a transformers LlamaConfig (LlamaForCausalLM, float32)
  model.safetensors  the weights, F32, transformers' names
                     (model.embed_tokens.weight, model.layers.{i}.input_layernorm.weight,
                     ....self_attn.{q,k,v,o}_proj.weight, ....post_attention_layernorm.weight,
                     ....mlp.{gate,up,down}_proj.weight, model.norm.weight, lm_head.weight
                     -- the last left out when tied, as save_pretrained does)
  tokens.bin         an llm.c token shard (256 int32 header: 20240520, 1, count;
                     then uint16 tokens): B*(T+1) tokens uniform in [0, vocab)
  expected.json      the batch/optimizer settings and the reference numbers:
                     batch, seq_len, steps, lr, beta1, beta2, eps, weight_decay,
                     clip, loss (at the written weights), step_losses (loss
                     before update k, k = 1..steps; step_losses[0] == loss),
                     grad_norms (global gradient norm before clipping, per
                     step), final_loss (after the last update),
                     logits_sum_squares (at the written weights, summed in
                     float64), torch (version)

The batch: window b = tokens[b*(T+1) : (b+1)*(T+1)] for b < B; inputs are a
window's first T tokens, targets its last T; the same batch every step.
Training: torch.optim.AdamW (two groups: weight_decay on the tensors of 2+
dimensions, none on the RMSNorm weights), the global gradient norm clipped to
--clip before each step (torch.nn.utils.clip_grad_norm_), constant lr.

Weights: every matrix N(0, 0.1), embed_tokens and lm_head included, and every
RMSNorm weight 1 + 0.1 * N(0, 1) (so that a misplaced norm weight shows).
Not GPT-2's 0.02: at 0.02 the attention scores of this tiny model are ~0.03,
attention is nearly uniform, and mistakes in it hardly show -- the loss of a
model with interleaved instead of rotate-half RoPE, or with no RoPE at all,
differed from the right one by 3e-6 (relative), i.e. within float32 noise; at
0.1 by 4e-3 .. 7e-3 (gradient norms by 1e-2 .. 8e-2). --std / --embed-std
change it. The clipping factor is torch's: max_norm / (norm + 1e-6) where
norm > max_norm. The model is scripts/llama_torch.py.

Deterministic: fixed seeds and one CPU thread; a rerun writes the same bytes.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_torch as L  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--vocab", type=int, default=61)
    p.add_argument("--dim", type=int, default=32, help="hidden_size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=48)
    p.add_argument("--max-position", type=int, default=16)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rms-eps", type=float, default=1e-5)
    p.add_argument("--tie", action="store_true", help="tie lm_head to embed_tokens")
    p.add_argument("--batch", type=int, default=4, help="B")
    p.add_argument("--seq-len", type=int, default=16, help="T (<= max-position)")
    p.add_argument("--seed", type=int, default=1337, help="weight init seed")
    p.add_argument("--data-seed", type=int, default=42, help="token seed")
    p.add_argument("--std", type=float, default=0.1, help="std of the weight matrices")
    p.add_argument("--embed-std", type=float, default=0.1, help="std of embed_tokens and lm_head")
    p.add_argument("--norm-perturb", type=float, default=0.1, help="RMSNorm weights are 1 + this * N(0, 1)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.8,
                   help="clip the global gradient norm to this before each step (the default "
                        "clips hf_llama_tiny's steps 1-2 and not 3-10)")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(1)
    cfg = L.LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.intermediate,
                        num_hidden_layers=a.layers, num_attention_heads=a.heads,
                        num_key_value_heads=a.kv_heads, max_position_embeddings=a.max_position,
                        rms_norm_eps=a.rms_eps, rope_theta=a.rope_theta, tie_word_embeddings=a.tie)
    if a.seq_len > cfg.max_position_embeddings:
        sys.exit("--seq-len must not exceed --max-position")

    # Built first, then initialised from its own generator, so that module
    # construction (which draws default inits) cannot shift the stream.
    model = L.LlamaForCausalLM(cfg)
    L.init_weights(model, std=a.std, embed_std=a.embed_std, norm_perturb=a.norm_perturb,
                   generator=torch.Generator().manual_seed(a.seed))

    n_tokens = a.batch * (a.seq_len + 1)
    tokens = torch.randint(0, cfg.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(a.data_seed))

    os.makedirs(a.outdir, exist_ok=True)
    path = lambda name: os.path.join(a.outdir, name)  # noqa: E731
    with open(path("config.json"), "w") as f:
        json.dump(cfg.hf_dict(), f, indent=2)
        f.write("\n")
    L.write_safetensors(path("model.safetensors"), L.hf_state_dict(model))
    L.write_shard(path("tokens.bin"), tokens.numpy())

    # Read back what was written: the numbers are those of the files.
    x, y = L.batch_windows(L.read_shard(path("tokens.bin")), a.batch, a.seq_len)
    model = L.LlamaForCausalLM(cfg)
    L.load_hf_state_dict(model, L.read_safetensors(path("model.safetensors")))

    with torch.no_grad():
        logits, loss = model(x, y)
    sum_sq = float((logits.double() ** 2).sum())

    def forward_loss(m, xx, yy):
        return m(xx, yy)[1]

    losses, norms, final = L.train_steps(model, forward_loss, x, y, a.steps, a.lr, (a.beta1, a.beta2),
                                         a.eps, a.weight_decay, a.clip)
    expected = {
        "batch": a.batch, "seq_len": a.seq_len, "steps": a.steps,
        "lr": a.lr, "beta1": a.beta1, "beta2": a.beta2, "eps": a.eps,
        "weight_decay": a.weight_decay, "clip": a.clip,
        "loss": loss.item(), "step_losses": losses, "grad_norms": norms,
        "final_loss": final, "logits_sum_squares": sum_sq, "torch": torch.__version__,
    }
    with open(path("expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")

    clipped = [k + 1 for k, n in enumerate(norms) if a.clip is not None and n > a.clip]
    print(f"loss {loss.item():.9g}  (ln V = {torch.tensor(float(cfg.vocab_size)).log().item():.7f})")
    print("step_losses " + " ".join(f"{v:.7f}" for v in losses) + f" -> {final:.7f}")
    print("grad_norms " + " ".join(f"{v:.5f}" for v in norms) + f"  clip {a.clip}: clipped in steps {clipped}")
    for name in ("config.json", "model.safetensors", "tokens.bin", "expected.json"):
        print(f"wrote {path(name)} ({os.path.getsize(path(name))} bytes)")


if __name__ == "__main__":
    main()
