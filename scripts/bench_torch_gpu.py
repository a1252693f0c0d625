#!/usr/bin/python3
"""PyTorch's best bf16 training step on a GPU: scripts/bench_gpu.lua's peer for the issue's table.

Run (from the repository root; needs torch 2.x with CUDA, e.g. from pip):

    python3 scripts/bench_torch_gpu.py --model gpt2-124m --seqs 1024,2048,4096 --tokens 16384
    python3 scripts/bench_torch_gpu.py --model llama-1b --seqs 1024,2048,4096 --tokens 16384
    python3 scripts/bench_torch_gpu.py --dry          # the script's logic on the CPU, tiny models, no compile

The models are scripts/gpt2_torch.py's GPT and scripts/llama_torch.py's LlamaForCausalLM (the reference models
the checks use) at bench_gpu.lua's shapes, with their attention running F.scaled_dot_product_attention
(is_causal, the flash backend required on a GPU) instead of the explicit softmax. PyTorch's best settings for
the step: bf16 autocast (weights, gradients and AdamW state float32, as pipegoose's precision = "bf16"),
torch.compile of the model, AdamW(fused=True) with torch's decay groups (2+ dimensions decay), clip_grad_norm_
1.0, TF32 off for what stays float32. A step is forward, backward, clipping, AdamW step and zero_grad, on a fixed
batch of tokens / T sequences.

Prints, one per line, the figures bench_gpu.lua prints (MFU over a bf16 matmul rate measured in the same run:
torch.matmul of two n x n bf16 matrices, float32 accumulation as cuBLAS does for bf16):

    torch_peak_bf16 <GFLOP/s> (n = N)
    torch <model> BxT tokens_per_s <v> step_ms <v> mfu_vs_bf16_gemm <v> mfu_attn <v> loss <v>
    torch_version <v>

MFU = 6 x parameters x tokens/s over the peak; mfu_attn adds 12 x layers x dim x T per token (attention's score
and value products, forward and backward). --dry runs two steps of each tiny model on the CPU (float32
autocast-free, no compile, no fused AdamW) so that the arithmetic of the script can be checked without a GPU.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402
import llama_torch as lt  # noqa: E402


def gpt2_attention_sdpa(self, x):
    """gpt2_torch.CausalSelfAttention.forward with scaled_dot_product_attention (same projections and layout)."""
    B, T, C = x.shape
    nh, hs = self.num_heads, C // self.num_heads
    q, k, v = self.qkv(x).split(C, dim=2)
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


def llama_attention_sdpa(self, x, cos, sin):
    """llama_torch.Attention.forward with scaled_dot_product_attention (GQA through enable_gqa)."""
    B, T, _ = x.shape
    nh, nkv, hd = self.nh, self.nkv, self.hd
    q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)
    k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)
    v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
    q = q * cos + lt.rotate_half(q) * sin
    k = k * cos + lt.rotate_half(k) * sin
    if nkv != nh:
        group = nh // nkv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    y = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, is_causal=True)
    return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * hd))


# bench_gpu.lua's MODELS, the same shapes (layers and dim also give the attention term of mfu_attn)
def make_model(name, max_T):
    if name.startswith("gpt2"):
        shapes = {"gpt2-124m": (50257, 50304, 12, 12, 768), "gpt2-tiny": (61, 64, 2, 4, 32)}
        vocab, padded, layers, heads, dim = shapes[name]
        cfg = g.GPTConfig(max_seq_len=max_T, vocab_size=vocab, padded_vocab_size=padded, num_layers=layers,
                          num_heads=heads, channels=dim)
        g.CausalSelfAttention.forward = gpt2_attention_sdpa
        model = g.GPT(cfg)
        g.init_weights(model, perturb=0.0)
        return model, g.make_adamw(model), vocab, layers, dim
    shapes = {"llama-1b": (32000, 2048, 5632, 22, 32, 4), "llama-tiny": (61, 32, 48, 2, 4, 2)}
    vocab, dim, hidden, layers, heads, kv = shapes[name]
    cfg = lt.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_T)
    lt.Attention.forward = llama_attention_sdpa
    model = lt.LlamaForCausalLM(cfg)
    lt.init_weights(model, std=0.02, embed_std=0.02, norm_perturb=0.0)
    return model, lt.make_adamw(model), vocab, layers, dim


def peak_bf16_gflops(dev, n, reps):
    """torch.matmul of two n x n bf16 matrices: the rate MFU is measured against (one warm-up)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return 2.0 * n * n * n * reps / (time.perf_counter() - t0) / 1e9


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def positive_list(text):
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': lengths must be positive integers")
    return values


def bench(a, dev, name, T, peak):
    model, opt, vocab, layers, dim = make_model(name, T)
    model.to(dev)
    if not a.dry:
        # the same decay groups and hyperparameters, the fused implementation
        opt = torch.optim.AdamW(opt.param_groups, fused=True)
        model = torch.compile(model)
    B = max(1, a.tokens // T)
    gen = torch.Generator().manual_seed(a.seed)
    x = torch.randint(0, vocab, (B, T), generator=gen).to(dev)
    y = torch.randint(0, vocab, (B, T), generator=gen).to(dev)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def step():
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    if dev.type == "cuda":  # the flash kernel or an error, not a silent fallback to the math path
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    else:
        import contextlib
        ctx = contextlib.nullcontext()
    with ctx:
        for _ in range(a.warmup):
            step()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step()
        sync(dev)
    dt = (time.perf_counter() - t0) / a.steps
    params = sum(p.numel() for p in model.parameters())
    tps = B * T / dt
    mfu = 6 * params * tps / (peak * 1e9)
    mfu_attn = (6 * params + 12 * layers * dim * T) * tps / (peak * 1e9)
    print(f"torch {name} {B}x{T} tokens_per_s {tps:.0f} step_ms {dt * 1e3:.2f} mfu_vs_bf16_gemm {mfu:.3f} "
          f"mfu_attn {mfu_attn:.3f} loss {loss.item():.4f} ({params} parameters)", flush=True)
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(description="PyTorch bf16 training-step benchmark (bench_gpu.lua's peer)")
    p.add_argument("--model", default="gpt2-124m", choices=["gpt2-124m", "llama-1b", "gpt2-tiny", "llama-tiny"])
    p.add_argument("--seqs", type=positive_list, default=[1024], help="sequence lengths, comma-separated")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (the batch is tokens / T)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch.compile compiles in them)")
    p.add_argument("--peak-n", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry", action="store_true",
                   help="the CPU, both tiny models at T = 8 and 16, two steps, no compile: checks the script")
    a = p.parse_args(argv)
    if a.tokens < 1 or a.steps < 1 or a.warmup < 0 or a.peak_n < 1:
        p.error("--tokens, --steps and --peak-n must be >= 1, --warmup >= 0")
    if a.dry:
        dev, models, seqs = torch.device("cpu"), ["gpt2-tiny", "llama-tiny"], [8, 16]
        a.tokens, a.steps, a.warmup, a.peak_n = 32, 2, 0, 64
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device (--dry checks the script on the CPU)")
        dev, models, seqs = torch.device("cuda"), [a.model], a.seqs
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(a.seed)
    peak = peak_bf16_gflops(dev, a.peak_n, 2 if a.dry else 20)
    print(f"torch_peak_bf16 {peak:.1f} GFLOP/s (n = {a.peak_n})", flush=True)
    for name in models:
        for T in seqs:
            bench(a, dev, name, T, peak)
    print(f"torch_version {torch.__version__}")


if __name__ == "__main__":
    main()
