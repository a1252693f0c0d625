#!/usr/bin/env python3
"""Write a tiny random BLOOM in Hugging Face's layout and transformers' reference numbers.

Run (from the repository root; needs torch and transformers, which CI does not have):

    /tmp/hfvenv/bin/python scripts/make_bloom_reference.py spec/fixtures/hf_bloom_tiny
    /tmp/hfvenv/bin/python scripts/make_bloom_reference.py spec/fixtures/hf_bloom_tiny_h8 --heads 8
    /tmp/hfvenv/bin/python scripts/make_bloom_reference.py --slopes   # ALiBi slopes only

(/tmp/hfvenv: python3 -m venv --system-site-packages over Debian's python3-torch,
plus pip install transformers==4.45.2 safetensors.) Every number comes from
transformers' own BloomForCausalLM (float32, eager attention) -- unlike
make_llama_reference.py there is no model of ours in torch.

Defaults (hf_bloom_tiny): vocab 61 (odd), hidden 32, 2 layers, 4 heads
(head_dim 8), layer_norm_epsilon 1e-5, tied lm_head, no dropout,
apply_residual_connection_post_layernorm false; batch B=4, T=16; 10 AdamW
steps (lr 1e-3, betas 0.9/0.95, eps 1e-8, weight_decay 0.1) with the global
gradient norm clipped to --clip. hf_bloom_tiny_h8: the same with 8 heads
(head_dim 4), so that 2, 4 and 8 tensor ranks divide the heads. The clip
values are chosen so that clipping is active in some steps only; the run
prints the norms and which steps clip.

What an importer needs to know about BLOOM (transformers 4.45.2,
models/bloom/modeling_bloom.py):

  Tensor names (model.safetensors as save_pretrained writes it from
  BloomForCausalLM: every name under "transformer."; bigscience's own
  checkpoints, saved from BloomModel, have the same names without that
  prefix -- an importer should take both). L layers, C = hidden_size,
  H = n_head, hd = C / H, V = vocab_size:
    transformer.word_embeddings.weight                [V, C]
    transformer.word_embeddings_layernorm.{weight,bias} [C]  (right after the embedding)
    transformer.h.{i}.input_layernorm.{weight,bias}    [C]
    transformer.h.{i}.self_attention.query_key_value.{weight [3C, C], bias [3C]}
        per-head interleaved: output rows [3 hd h, 3 hd (h+1)) are head h's
        q (hd rows), then its k (hd rows), then its v (hd rows) --
        transformers views the output as [.., H, 3, hd]. Not GPT-2's
        q|k|v blocks: an importer into a fused q|k|v of [q heads | k heads |
        v heads] permutes the rows (and the bias) per head.
    transformer.h.{i}.self_attention.dense.{weight [C, C], bias [C]}
    transformer.h.{i}.post_attention_layernorm.{weight,bias} [C]
    transformer.h.{i}.mlp.dense_h_to_4h.{weight [4C, C], bias [4C]}
    transformer.h.{i}.mlp.dense_4h_to_h.{weight [C, 4C], bias [C]}
    transformer.ln_f.{weight,bias}                     [C]
    lm_head.weight: tied to word_embeddings (left out of the file), no bias.
  torch Linear layout: weight [out, in], y = x W^T + b. All LayerNorms
  with eps = layer_norm_epsilon (1e-5 here) and biases.
  The block (apply_residual_connection_post_layernorm = false, as every
  BLOOM): h = x + dense(attn(input_layernorm(x))); out = h +
  dense_4h_to_h(gelu(dense_h_to_4h(post_attention_layernorm(h)))).
  No position embeddings: ALiBi. score[b,h,i,j] = (q_i . k_j) / sqrt(hd) +
  slope_h * j (alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(hd)); j the key
  position, from attention_mask.cumsum - 1, so 0..T-1 without padding),
  masked causally by adding finfo(float32).min, softmax in float32.
  Slopes: build_alibi_tensor (this script prints them with --slopes; the
  same in every run below); pipegoose's pg_alibi_slopes and pg.ops.alibi_slopes.
  GELU: bloom_gelu_forward, the tanh form x * 0.5 * (1 + tanh(0.79788456 x
  (1 + 0.044715 x^2))) -- 0.79788456 is sqrt(2/pi) to 8 digits, the same
  float32 (0x3f4c422a) as GPT-2's "gelu_new"; in training mode (as here) its
  backward is bloom_gelu_back, the analytic derivative of that form.
  The final ln_f, then logits = h @ word_embeddings^T. The config's
  pretraining_tp = 1 and slow_but_exact = false (the plain Linear calls).
  config.json: save_pretrained writes hidden_size, n_head, n_layer (and
  leaves out values equal to BloomConfig's defaults; this script adds
  tie_word_embeddings: true outright). bigscience's published configs say
  n_embed (BloomConfig takes it for hidden_size) and num_attention_heads (an
  alias of n_head, as num_hidden_layers is of n_layer), and carry Megatron
  keys transformers ignores (offset_alibi, seq_length, masked_softmax_fusion,
  ...): an importer reads hidden_size or n_embed, n_head or
  num_attention_heads, n_layer or num_hidden_layers. BLOOM has no maximum
  sequence length in its config (ALiBi extrapolates).

Writes into OUTDIR:

  config.json        BloomConfig (BloomForCausalLM, float32) from save_pretrained
  model.safetensors  the weights, F32, save_pretrained's names above
  tokens.bin         an llm.c token shard (256 int32 header: 20240520, 1, count;
                     then uint16 tokens): B*(T+1) tokens uniform in [0, vocab)
  expected.json      the keys of hf_llama_tiny/expected.json: batch, seq_len,
                     steps, lr, beta1, beta2, eps, weight_decay, clip, loss (at
                     the written weights), step_losses (loss before update k,
                     k = 1..steps; step_losses[0] == loss), grad_norms (global
                     gradient norm before clipping, per step), final_loss
                     (after the last update), logits_sum_squares (at the written
                     weights, summed in float64), torch (version)

The batch: window b = tokens[b*(T+1) : (b+1)*(T+1)] for b < B; inputs are a
window's first T tokens, targets its last T; the same batch every step. The
loss is the mean cross-entropy over the B*T targets of the model's float32
logits for the inputs (model(input_ids=x).logits; as make_llama_reference.py
and hf_reference.py: no attention mask, i.e. all ones). Training
(llama_torch.train_steps): model.train() (dropouts are 0), torch.optim.AdamW
with two groups (weight_decay on the tensors of 2+ dimensions, none on the
biases and LayerNorm parameters; the tied embedding once), the global
gradient norm clipped to --clip before each step (clip_grad_norm_: factor
clip / (norm + 1e-6) where norm > clip), constant lr.

Weights: every matrix N(0, --std = 0.1) (word_embeddings included), every
Linear bias N(0, 0.1), every LayerNorm weight 1 + 0.1 N(0, 1) and bias
0.1 N(0, 1), so that a misplaced norm or bias shows (drawn in
named_parameters() order from one generator). The run also prints the loss
with the ALiBi biases left out (slopes 0) and with q|k|v read as GPT-2's
blocks, to show that both matter at these weights, and checks the layout
described above: a forward written from it (documented_loss: plain torch
over the safetensors' tensors, ALiBi as slope_h (j - i)) must give
transformers' loss within 2e-6 (relative).

Deterministic: fixed seeds and one CPU thread; a rerun writes the same bytes.
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers import BloomConfig, BloomForCausalLM
from transformers.models.bloom import modeling_bloom

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_torch as L  # noqa: E402  (shard files, batch windows, AdamW steps)

SLOPE_HEADS = (1, 2, 3, 4, 6, 8, 12, 16, 30, 112)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", nargs="?")
    p.add_argument("--slopes", action="store_true", help="print the ALiBi slopes only")
    p.add_argument("--vocab", type=int, default=61)
    p.add_argument("--dim", type=int, default=32, help="hidden_size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ln-eps", type=float, default=1e-5)
    p.add_argument("--batch", type=int, default=4, help="B")
    p.add_argument("--seq-len", type=int, default=16, help="T")
    p.add_argument("--seed", type=int, default=1337, help="weight init seed")
    p.add_argument("--data-seed", type=int, default=42, help="token seed")
    p.add_argument("--std", type=float, default=0.1, help="std of the weight matrices and biases")
    p.add_argument("--norm-perturb", type=float, default=0.1,
                   help="LayerNorm weights 1 + this * N(0, 1), biases this * N(0, 1)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.235,
                   help="clip the global gradient norm to this before each step (the default clips steps 1-3 of "
                        "both fixtures and not 4-10)")
    return p.parse_args(argv)


def alibi_slopes(n):
    """transformers' slopes for n heads: build_alibi_tensor at key position 1 (a mask of ones, T = 2)."""
    alibi = modeling_bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), n, torch.float32)
    return alibi[:, 0, 1]  # slope_h * 1


def print_slopes():
    for n in SLOPE_HEADS:
        s = alibi_slopes(n)
        print(f"slopes {n}: " + " ".join(f"{v:.9g}" for v in s.tolist()))
        print(f"slopes_exact {n}: " + " ".join(float.hex(v) for v in s.tolist()))  # C99 / Lua hex floats


def init_weights(model, std, norm_perturb, generator):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.startswith("transformer.ln_f"):
                base = 1.0 if name.endswith(".weight") else 0.0
                p.copy_(base + norm_perturb * torch.randn(p.shape, generator=generator))
            else:  # word_embeddings, Linear weights and biases
                p.normal_(0.0, std, generator=generator)


def load(outdir):
    model = BloomForCausalLM.from_pretrained(outdir, torch_dtype=torch.float32, attn_implementation="eager")
    assert model.lm_head.weight is model.transformer.word_embeddings.weight, "lm_head not tied"
    return model


def forward_loss(model, x, y):
    logits = model(input_ids=x).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def variant_losses(model, x, y):
    """The loss without ALiBi, and with q|k|v read as [q heads | k heads | v heads]."""
    out = {}
    real = modeling_bloom.build_alibi_tensor
    modeling_bloom.build_alibi_tensor = lambda mask, n, dtype: 0 * real(mask, n, dtype)
    try:
        with torch.no_grad():
            out["no_alibi"] = forward_loss(model, x, y).item()
    finally:
        modeling_bloom.build_alibi_tensor = real
    H, C = model.config.n_head, model.config.hidden_size
    hd = C // H
    saved = {}
    with torch.no_grad():
        for blk in model.transformer.h:
            lin = blk.self_attention.query_key_value
            saved[lin] = (lin.weight.clone(), lin.bias.clone())
            # the rows of GPT-2's blocks (part-major) moved to where BLOOM reads them (head-major)
            idx = torch.arange(3 * C).view(3, H, hd).transpose(0, 1).reshape(-1)
            lin.weight.copy_(lin.weight[idx])
            lin.bias.copy_(lin.bias[idx])
        out["qkv_as_blocks"] = forward_loss(model, x, y).item()
        for lin, (w, b) in saved.items():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    return out


def documented_loss(outdir, x, y, cfg):
    """The loss from the tensors of model.safetensors alone, by the layout this
    docstring states (heads interleaved in query_key_value, ALiBi as slope_h *
    (j - i), the tanh GELU), to check the description against transformers."""
    from safetensors.torch import load_file
    w = {k.removeprefix("transformer."): v for k, v in load_file(os.path.join(outdir, "model.safetensors")).items()}
    H, C, eps = cfg.n_head, cfg.hidden_size, cfg.layer_norm_epsilon
    hd, T = C // H, x.shape[1]
    ln = lambda t, p: F.layer_norm(t, (C,), w[p + ".weight"], w[p + ".bias"], eps)  # noqa: E731
    lin = lambda t, p: t @ w[p + ".weight"].T + w[p + ".bias"]  # noqa: E731
    pos = torch.arange(T, dtype=torch.float32)
    slopes = alibi_slopes(H)
    bias = slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None])  # [H, i, j]: slope_h (j - i)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    h = ln(w["word_embeddings.weight"][x], "word_embeddings_layernorm")
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        qkv = lin(ln(h, p + "input_layernorm"), p + "self_attention.query_key_value")
        qkv = qkv.view(*x.shape, H, 3, hd)  # per head: q, k, v
        q, k, v = (qkv[..., n, :].transpose(1, 2) for n in range(3))  # [B, H, T, hd]
        s = q @ k.transpose(-1, -2) / math.sqrt(hd) + bias
        a = s.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        h = h + lin(a.transpose(1, 2).reshape(*x.shape, C), p + "self_attention.dense")
        m = lin(ln(h, p + "post_attention_layernorm"), p + "mlp.dense_h_to_4h")
        m = m * 0.5 * (1.0 + torch.tanh(0.79788456 * m * (1 + 0.044715 * m * m)))
        h = h + lin(m, p + "mlp.dense_4h_to_h")
    logits = ln(h, "ln_f") @ w["word_embeddings.weight"].T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(1)
    print_slopes()
    if a.slopes:
        return
    if a.outdir is None:
        sys.exit("give OUTDIR (or --slopes)")
    cfg = BloomConfig(vocab_size=a.vocab, hidden_size=a.dim, n_layer=a.layers, n_head=a.heads,
                      layer_norm_epsilon=a.ln_eps, tie_word_embeddings=True,
                      apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
                      pretraining_tp=1, slow_but_exact=False, bos_token_id=a.vocab - 1, eos_token_id=a.vocab - 1,
                      pad_token_id=None, torch_dtype="float32")
    if a.dim % a.heads:
        sys.exit("--dim must divide by --heads")

    torch.manual_seed(0)  # module construction draws default inits; ours overwrite them all
    model = BloomForCausalLM(cfg)
    init_weights(model, a.std, a.norm_perturb, torch.Generator().manual_seed(a.seed))

    n_tokens = a.batch * (a.seq_len + 1)
    tokens = torch.randint(0, cfg.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(a.data_seed))

    os.makedirs(a.outdir, exist_ok=True)
    path = lambda name: os.path.join(a.outdir, name)  # noqa: E731
    model.save_pretrained(a.outdir, safe_serialization=True)
    if os.path.exists(path("generation_config.json")):
        os.remove(path("generation_config.json"))
    # save_pretrained leaves out values equal to BloomConfig's defaults; say the tie outright
    with open(path("config.json")) as f:
        written = json.load(f)
    written["tie_word_embeddings"] = True
    with open(path("config.json"), "w") as f:
        json.dump(written, f, indent=2, sort_keys=True)
        f.write("\n")
    L.write_shard(path("tokens.bin"), tokens.numpy())

    # Read back what was written: the numbers are those of the files.
    x, y = L.batch_windows(L.read_shard(path("tokens.bin")), a.batch, a.seq_len)
    model = load(a.outdir)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    sum_sq = float((logits.double() ** 2).sum())
    variants = variant_losses(model, x, y)
    with torch.no_grad():
        own = documented_loss(a.outdir, x, y, cfg)
    if abs(own - loss.item()) > 2e-6 * abs(loss.item()):
        sys.exit(f"the documented layout's loss {own:.9g} is not transformers' {loss.item():.9g}")

    model.train()
    losses, norms, final = L.train_steps(model, forward_loss, x, y, a.steps, a.lr, (a.beta1, a.beta2), a.eps,
                                         a.weight_decay, a.clip)
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
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"loss {loss.item():.9g}  (ln V = {math.log(cfg.vocab_size):.7f}); without ALiBi "
          f"{variants['no_alibi']:.9g}; q|k|v read as blocks {variants['qkv_as_blocks']:.9g}; the documented "
          f"layout's {own:.9g}")
    print("step_losses " + " ".join(f"{v:.7f}" for v in losses) + f" -> {final:.7f}")
    print("grad_norms " + " ".join(f"{v:.5f}" for v in norms) + f"  clip {a.clip}: clipped in steps {clipped}")
    for name in sorted(os.listdir(a.outdir)):
        print(f"wrote {path(name)} ({os.path.getsize(path(name))} bytes)")


if __name__ == "__main__":
    main()
