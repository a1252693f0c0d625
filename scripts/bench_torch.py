#!/usr/bin/python3
"""Time a full GPT-2 (or LLaMA) training step in PyTorch on the CPU, or a GPU (fp32).

Run (from the repository root; needs torch):

    /usr/bin/python3 scripts/bench_torch.py                   # GPT-2 124M, 4 x 64 tokens
    /usr/bin/python3 scripts/bench_torch.py --threads 1
    /usr/bin/python3 scripts/bench_torch.py --small           # examples/train_gpt.lua's default model, 16 x 128
    /usr/bin/python3 scripts/bench_torch.py --llama           # scripts/bench.lua's llama (scripts/llama_torch.py)
    python3 scripts/bench_torch.py --device cuda --batch 8 --seq-len 1024   # scripts/gpu_check.sh's peer

On a GPU, TF32 is off (as in pipegoose's fp32 path and scripts/bench_gpu.lua)
and every phase ends with torch.cuda.synchronize().

A step is forward, backward, AdamW step and zero_grad (gradients zeroed in
place, as pipegoose zeroes its flat gradient buffer), on random tokens, with
the model of scripts/gpt2_torch.py (the reference model). After --warmup
untimed steps, the median of --steps timed steps is reported as
machine-readable lines:

    torch_tokens_per_s <v>
    torch_step_ms <v>
    torch_threads <n>
    torch_version <v>

(plus informational lines starting with '#').
"""

import argparse
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch as g  # noqa: E402
import llama_torch as lt  # noqa: E402


def available_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def blas_of_torch():
    """The BLAS this PyTorch was built with: its build configuration's BLAS_INFO
    (mkl for PyPI's wheels; generic for Debian's, which calls the system
    libblas.so.3, i.e. whichever BLAS the alternatives select: OpenBLAS here)."""
    m = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return m.group(1) if m else "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description="PyTorch training-step benchmark")
    p.add_argument("--small", action="store_true",
                   help="examples/train_gpt.lua's default model (vocab 256, seq 128, dim 256, 4 heads, 4 layers)")
    p.add_argument("--llama", action="store_true",
                   help="scripts/bench.lua's llama model (dim 768, 12 layers, 12/4 heads, SwiGLU 2048, vocab 32000)")
    p.add_argument("--batch", type=int, default=None, help="batch rows (default 4, or 16 with --small)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 64, or 128 with --small)")
    p.add_argument("--threads", type=int, default=available_cores())
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ to this before each step (0: none)")
    p.add_argument("--fused-adamw", action="store_true",
                   help="AdamW(fused=True): one kernel for the whole update (PyTorch >= 2.4 on the CPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (PyTorch 2.x; its first steps compile: keep --warmup >= 2)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if a.llama:
        cfg = lt.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=64)
        batch, seq_len = a.batch or 4, a.seq_len or 64
    elif a.small:
        cfg = g.GPTConfig(max_seq_len=128, vocab_size=256, padded_vocab_size=256,
                          num_layers=4, num_heads=4, channels=256)
        batch, seq_len = a.batch or 16, a.seq_len or 128
    else:
        # GPT-2 124M; only the first 64 of its 1024 positions are used.
        cfg = g.GPTConfig(max_seq_len=1024, vocab_size=50257, padded_vocab_size=50304,
                          num_layers=12, num_heads=12, channels=768)
        batch, seq_len = a.batch or 4, a.seq_len or 64

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    if a.llama:
        model = lt.LlamaForCausalLM(cfg)
        lt.init_weights(model, std=0.02, embed_std=0.02, norm_perturb=0.0)
    else:
        model = g.GPT(cfg)
        g.init_weights(model, perturb=0.0)
    model.to(dev)
    opt = lt.make_adamw(model) if a.llama else g.make_adamw(model)
    if a.fused_adamw:  # the same groups and hyperparameters, the fused implementation
        opt = torch.optim.AdamW(opt.param_groups, fused=True)
    if a.compile:
        model = torch.compile(model)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=dev)
    y = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=dev)

    phases = {"forward": [], "backward": [], "optimizer": []}

    def step():
        t0 = time.perf_counter()
        _, loss = model(x, y)  # both models return (logits, mean loss)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
        t3 = time.perf_counter()
        for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[name].append(dt)
        return loss.item()

    n_params = sum(p.numel() for p in model.parameters())
    print(f"# model {cfg} params {n_params} batch {batch} seq_len {seq_len}", flush=True)
    for _ in range(a.warmup):
        step()
    for times in phases.values():
        times.clear()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    print(f"# step times ms: {' '.join(f'{t * 1e3:.1f}' for t in times)}; last loss {loss:.4f}")
    # The minimum is the better estimate on a machine shared with other work.
    print(f"# min step ms {min(times) * 1e3:.1f}")
    print("# median phase ms: " + ", ".join(
        f"{name} {statistics.median(ts) * 1e3:.1f}" for name, ts in phases.items()))
    print(f"torch_tokens_per_s {batch * seq_len / step_s:.1f}")
    print(f"torch_step_ms {step_s * 1e3:.2f}")
    print(f"torch_threads {torch.get_num_threads()}")
    print(f"torch_version {torch.__version__}")
    print(f"torch_mode {'compile' if a.compile else 'eager'}{'+fused_adamw' if a.fused_adamw else ''}")
    print(f"torch_blas {blas_of_torch()}")
    print(f"torch_device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}")


if __name__ == "__main__":
    main()
