#!/usr/bin/env python3
"""The transformers peer of scripts/bench.lua's part generate: greedy
generate (KV cache on) of a Hugging Face directory (the model pipegoose
exported with engine:save_hf), the same prompts pipegoose generates from.

  bench_generate.py DIR --batch B --prompt-len N --new-tokens M --threads K

Prompt ids: row b, position i is (i * 37 + b * 11 + 1) % vocab (bench/generate.lua's rule).
Prints "tokens_per_s X" (new tokens of the whole batch per second, the best
of --repeats timed runs after a short warm-up)."""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.dir, torch_dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([[(i * 37 + b * 11 + 1) % vocab for i in range(a.prompt_len)] for b in range(a.batch)])
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        best = None
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw)
            dt = time.perf_counter() - t0
            assert out.shape[1] == a.prompt_len + a.new_tokens, out.shape
            best = dt if best is None else min(best, dt)
    print("tokens_per_s %.3f" % (a.batch * a.new_tokens / best))
    print("first_ids " + ",".join(str(int(x)) for x in out[0, a.prompt_len:a.prompt_len + 8]))


if __name__ == "__main__":
    main()
