"""GPT-2 in plain PyTorch, plus readers/writers for llm.c's binary files.

Shared by make_reference.py, read_llmc.py and bench_torch.py; it is the
reference that pipegoose's C model is checked against. Needs only torch,
numpy and the standard library (run with /usr/bin/python3 on the dev box).

The model follows the GPT-2 definition: token + position embedding, L pre-LN
blocks (x += attn(ln1(x)); x += mlp(ln2(x))), final LayerNorm, LM head tied
to the token embedding. Logits cover the padded vocabulary; the loss only the
real vocabulary (columns [0, V)). The file formats are in docs/FORMATS.md.
"""

import math
import struct
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
STATE_MAGIC = 20240327
STATE_VERSION = 2
SHARD_MAGIC = 20240520
HEADER_INTS = 256
LN_EPS = 1e-5


@dataclass
class GPTConfig:
    max_seq_len: int = 16
    vocab_size: int = 61
    padded_vocab_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    channels: int = 32

    def check(self):
        assert self.channels % self.num_heads == 0, "channels must divide by heads"
        assert self.padded_vocab_size >= self.vocab_size, "padded vocab < vocab"

    def as_dict(self):
        return asdict(self)


# --------------------------------------------------------------------------
# The model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        # Fused projection: output rows are [q; k; v], each C rows, head-major.
        self.qkv = nn.Linear(cfg.channels, 3 * cfg.channels)
        self.proj = nn.Linear(cfg.channels, cfg.channels)

    def forward(self, x):
        B, T, C = x.shape
        nh, hs = self.num_heads, C // self.num_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, nh, T, hs]: head h is channels h*hs .. (h+1)*hs-1.
        q = q.view(B, T, nh, hs).transpose(1, 2)
        k = k.view(B, T, nh, hs).transpose(1, 2)
        v = v.view(B, T, nh, hs).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        att = F.softmax(scores, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.channels, 4 * cfg.channels)
        self.proj = nn.Linear(4 * cfg.channels, cfg.channels)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.channels, eps=LN_EPS)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.channels, eps=LN_EPS)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.empty(cfg.padded_vocab_size, cfg.channels))
        self.wpe = nn.Parameter(torch.empty(cfg.max_seq_len, cfg.channels))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.lnf = nn.LayerNorm(cfg.channels, eps=LN_EPS)

    def forward(self, idx, targets=None):
        """idx int64 [B, T] -> (logits [B, T, Vp], mean loss over B*T or None)."""
        B, T = idx.shape
        assert T <= self.cfg.max_seq_len, "sequence longer than max_seq_len"
        x = F.embedding(idx, self.wte) + self.wpe[:T]
        for block in self.blocks:
            x = block(x)
        x = self.lnf(x)
        logits = x @ self.wte.t()  # tied LM head, padded vocabulary
        loss = None
        if targets is not None:
            V = self.cfg.vocab_size
            # Padded columns are not classes: the softmax runs over [0, V) only.
            real = logits[..., :V]
            loss = F.cross_entropy(real.reshape(B * T, V), targets.reshape(B * T))
        return logits, loss


def init_weights(model: GPT, perturb: float = 0.0, generator=None):
    """GPT-2 style init: N(0, 0.02) for embeddings and weight matrices, zero
    biases, LayerNorm (1, 0), zero padded wte rows. With perturb > 0, every
    bias and LayerNorm parameter then gets perturb * N(0, 1) added, so that a
    reference exercises them (at exactly 0/1 some bugs stay invisible).
    Draws happen in the fixed order of model.named_parameters()."""
    cfg = model.cfg
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=generator)
            else:
                # The only 1-D weights are LayerNorm gains; all biases start at 0.
                p.fill_(1.0 if name.endswith("weight") else 0.0)
        if perturb > 0:
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(perturb * torch.randn(p.shape, generator=generator))
        model.wte[cfg.vocab_size:].zero_()


def make_adamw(model: GPT, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    """AdamW with decay on tensors of >= 2 dims (wte, wpe, weight matrices)
    and none on biases and LayerNorm parameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the plain per-tensor loop, same arithmetic everywhere.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


# --------------------------------------------------------------------------
# llm.c tensor layout: 16 tensors, the per-layer ones stacked over layers.

LLMC_TENSOR_NAMES = [
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb",
]


def llmc_shapes(cfg: GPTConfig):
    """Shapes of the 16 tensors, in file order."""
    L, C, Vp, maxT = cfg.num_layers, cfg.channels, cfg.padded_vocab_size, cfg.max_seq_len
    return [
        (Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C),
        (L, C, C), (L, C), (L, C), (L, C), (L, 4 * C, C), (L, 4 * C),
        (L, C, 4 * C), (L, C), (C,), (C,),
    ]


def _per_layer_params(block: Block):
    """A block's parameters in llm.c order (ln1w .. fcprojb)."""
    return [
        block.ln1.weight, block.ln1.bias, block.attn.qkv.weight, block.attn.qkv.bias,
        block.attn.proj.weight, block.attn.proj.bias, block.ln2.weight, block.ln2.bias,
        block.mlp.fc.weight, block.mlp.fc.bias, block.mlp.proj.weight, block.mlp.proj.bias,
    ]


def llmc_tensors(model: GPT, grads: bool = False):
    """The model's parameters (or their gradients) as the 16 llm.c tensors."""
    def get(p):
        t = p.grad if grads else p
        return (torch.zeros_like(p) if t is None else t).detach()

    per_layer = [_per_layer_params(b) for b in model.blocks]
    stacked = [torch.stack([get(layer[i]) for layer in per_layer]) for i in range(12)]
    return [get(model.wte), get(model.wpe)] + stacked + [get(model.lnf.weight), get(model.lnf.bias)]


def load_llmc_tensors(model: GPT, tensors):
    """Copy the 16 llm.c tensors into the model's parameters."""
    for t, shape, name in zip(tensors, llmc_shapes(model.cfg), LLMC_TENSOR_NAMES):
        assert tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)} != {shape}"
    with torch.no_grad():
        model.wte.copy_(tensors[0])
        model.wpe.copy_(tensors[1])
        for l, block in enumerate(model.blocks):
            for i, p in enumerate(_per_layer_params(block)):
                p.copy_(tensors[2 + i][l])
        model.lnf.weight.copy_(tensors[14])
        model.lnf.bias.copy_(tensors[15])


# --------------------------------------------------------------------------
# Binary files (little-endian; see docs/FORMATS.md)


def _header(values):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[: len(values)] = values
    return h.tobytes()


def _f32(t):
    return np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f4").tobytes()


def _read_header(f, magic, what):
    raw = f.read(HEADER_INTS * 4)
    if len(raw) != HEADER_INTS * 4:
        raise ValueError(f"{what}: file shorter than its 1024-byte header")
    h = np.frombuffer(raw, dtype="<i4")
    if h[0] != magic:
        raise ValueError(f"{what}: bad magic {h[0]} (want {magic})")
    return h


def _read_f32(f, shape, what):
    n = int(np.prod(shape))
    raw = f.read(4 * n)
    if len(raw) != 4 * n:
        raise ValueError(f"{what}: file ends inside a tensor of shape {shape}")
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape))


def write_model_file(path, model: GPT):
    cfg = model.cfg
    with open(path, "wb") as f:
        f.write(_header([MODEL_MAGIC, MODEL_VERSION_FP32, cfg.max_seq_len, cfg.vocab_size,
                         cfg.num_layers, cfg.num_heads, cfg.channels, cfg.padded_vocab_size]))
        for t in llmc_tensors(model):
            f.write(_f32(t))


def read_model_file(path):
    """-> (GPTConfig, list of the 16 tensors)."""
    with open(path, "rb") as f:
        h = _read_header(f, MODEL_MAGIC, path)
        if h[1] != MODEL_VERSION_FP32:
            raise ValueError(f"{path}: version {h[1]}, only 3 (fp32) is supported")
        cfg = GPTConfig(max_seq_len=int(h[2]), vocab_size=int(h[3]), num_layers=int(h[4]),
                        num_heads=int(h[5]), channels=int(h[6]), padded_vocab_size=int(h[7]))
        tensors = [_read_f32(f, s, f"{path}:{n}") for s, n in zip(llmc_shapes(cfg), LLMC_TENSOR_NAMES)]
        if f.read(1):
            raise ValueError(f"{path}: trailing bytes after the last tensor")
    return cfg, tensors


def write_state_file(path, x, y, logits, loss, grads):
    """x, y int [B, T]; logits [B, T, V] (unpadded); loss scalar; grads: 16 tensors."""
    B, T = x.shape
    with open(path, "wb") as f:
        f.write(_header([STATE_MAGIC, STATE_VERSION, B, T]))
        f.write(np.ascontiguousarray(x.numpy(), dtype="<i4").tobytes())
        f.write(np.ascontiguousarray(y.numpy(), dtype="<i4").tobytes())
        f.write(_f32(logits))
        f.write(struct.pack("<f", float(loss)))
        for g in grads:
            f.write(_f32(g))


def read_state_file(path, cfg: GPTConfig):
    """-> dict(x, y int64 [B, T], logits [B, T, V], loss float, grads: 16 tensors)."""
    with open(path, "rb") as f:
        h = _read_header(f, STATE_MAGIC, path)
        if h[1] != STATE_VERSION:
            raise ValueError(f"{path}: version {h[1]}, want {STATE_VERSION}")
        B, T = int(h[2]), int(h[3])
        ints = np.frombuffer(f.read(2 * B * T * 4), dtype="<i4")
        if ints.size != 2 * B * T:
            raise ValueError(f"{path}: file ends inside the tokens")
        x = torch.from_numpy(ints[: B * T].astype(np.int64).reshape(B, T))
        y = torch.from_numpy(ints[B * T:].astype(np.int64).reshape(B, T))
        logits = _read_f32(f, (B, T, cfg.vocab_size), f"{path}:logits")
        loss = float(_read_f32(f, (1,), f"{path}:loss")[0])
        grads = [_read_f32(f, s, f"{path}:d{n}") for s, n in zip(llmc_shapes(cfg), LLMC_TENSOR_NAMES)]
        if f.read(1):
            raise ValueError(f"{path}: trailing bytes after the last gradient")
    return {"B": B, "T": T, "x": x, "y": y, "logits": logits, "loss": loss, "grads": grads}
