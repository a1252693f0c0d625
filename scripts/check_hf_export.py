#!/usr/bin/env python3
"""Checks an engine:save_hf export with transformers (never run by CI).

    /tmp/hfvenv/bin/python scripts/check_hf_export.py EXPORT_DIR EXPECT.json

EXPECT.json is what scripts/hf_export_check.lua --expect writes: the prompt's
text and pipegoose's ids of it, the greedy ids pg.sample.generate gave after
it (no stop at EOS), a sample text and pipegoose's ids of it, the dtype written.

Checks, each printed as "ok ..." or "FAIL ...":
  - config.json's torch_dtype is the dtype written, and the model loads in it;
  - AutoTokenizer's ids of the prompt and of the sample text are pipegoose's;
  - AutoModelForCausalLM.generate, greedy (do_sample=False), from the same
    prompt ids for as many new tokens, EOS not stopping it (eos_token_id=None,
    as pipegoose's generate does not stop), gives the same ids (float32
    exports; a bfloat16 / float16 one holds the masters rounded, so a near
    tie may go the other way: printed as a note);
  - pipeline("text-generation", model=EXPORT_DIR) runs, greedy, and its text
    is the tokenizer's decoding of the prompt and transformers' own greedy ids
    (the pipeline stops at EOS: compared up to the first EOS).
Exit status 1 when a check fails.
"""
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    export, expect_path = sys.argv[1], sys.argv[2]
    with open(expect_path) as f:
        want = json.load(f)
    with open(export + "/config.json") as f:
        cfg = json.load(f)
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {export} ({want.get('family')})")
    written = cfg.get("torch_dtype")
    check(written == want["dtype"], f"config.json torch_dtype {written} (written {want['dtype']})")

    tok = AutoTokenizer.from_pretrained(export)
    got_prompt = tok(want["prompt"], add_special_tokens=False)["input_ids"]
    check(got_prompt == want["prompt_ids"],
          f"tokenizer ids of the prompt: {got_prompt} (pipegoose {want['prompt_ids']})")
    got_sample = tok(want["sample_text"], add_special_tokens=False)["input_ids"]
    check(got_sample == want["sample_ids"], f"tokenizer ids of the sample text ({len(got_sample)} ids)")
    check(tok.decode(want["sample_ids"]) == want["sample_text"], "tokenizer decodes pipegoose's ids to the sample text")

    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype="auto")  # "auto": config.json's torch_dtype
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    check(dtype == want["dtype"], f"the model loads in {dtype}")
    if dtype == "float16" and not torch.cuda.is_available():
        model = model.float()  # CPU torch has no float16 matmul; every float16 value is exact in float32
    n = len(want["new_ids"])
    ids = torch.tensor([want["prompt_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=0, eos_token_id=None, pad_token_id=cfg.get("pad_token_id") or 0)
    new = out[0, len(want["prompt_ids"]):].tolist()
    same = sum(1 for a, b in zip(new, want["new_ids"]) if a == b)
    what = f"greedy generate: {new} (pipegoose {want['new_ids']}; {same}/{n} equal)"
    if want["dtype"] == "float32":
        check(new == want["new_ids"], what)
    else:  # pipegoose generated from its float32 masters; the file holds them rounded: a near tie may flip
        print(("ok   " if new == want["new_ids"] else "note ") + what + f" ({want['dtype']} weights)")

    run_dtype = torch.float32 if dtype == "float16" and not torch.cuda.is_available() else "auto"
    pipe = pipeline("text-generation", model=export, torch_dtype=run_dtype)
    text = pipe(want["prompt"], do_sample=False, max_new_tokens=n)[0]["generated_text"]
    eos = cfg.get("eos_token_id")
    upto = new
    if eos is not None and eos in new:
        upto = new[: new.index(eos)]
    expected_text = tok.decode(want["prompt_ids"] + upto, skip_special_tokens=True)
    check(text == expected_text, f"pipeline text-generation runs: {text!r}")
    print("FAILED: " + "; ".join(failures) if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
