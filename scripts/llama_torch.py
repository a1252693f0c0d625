"""LLaMA in plain PyTorch (float32), plus writers for the files its fixtures use.

Used by make_llama_reference.py; it is the reference that pipegoose's LLaMA is
checked against. Needs only torch, numpy and the standard library (run with
/usr/bin/python3 on the dev box). Written from the model's definition, not
from any library's source; scripts/hf_reference.py llama-check compares it
with Hugging Face transformers' LlamaForCausalLM on the committed fixtures.

The model (the semantics of transformers' LlamaForCausalLM, eager attention):

  h = embed_tokens[idx]                                  no position embedding
  for each layer:
      h = h + o_proj(attn(input_layernorm(h)))
      h = h + down_proj(silu(gate_proj(x)) * up_proj(x)),  x = post_attention_layernorm(h)
  logits = lm_head(norm(h))                              lm_head tied to embed_tokens if tie

  RMSNorm(x) = weight * (x * rsqrt(mean(x^2) + eps)), computed in float32.
  attn: q = q_proj(x), k = k_proj(x), v = v_proj(x), split into heads of hd
  channels (head h = channels h*hd .. (h+1)*hd-1); q and k rotated by RoPE;
  query head h attends with key/value head h // (heads / kv_heads) (grouped
  query attention); causal softmax of q.k / sqrt(hd); heads concatenated.
  RoPE ("rotate half" convention): inv_freq[j] = 1 / theta^(2j / hd) for
  j < hd/2; angle[t, j] = t * inv_freq[j] (float32), t = 0..T-1 in every
  sequence; cos, sin of cat(angle, angle) over the hd channels;
  x' = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[hd/2:], x[:hd/2]).
  Loss: mean cross-entropy of the next token over all B*T positions.

Parameter names are transformers' (model.embed_tokens.weight,
model.layers.{i}.self_attn.q_proj.weight, ..., model.norm.weight,
lm_head.weight), so state_dict() can be written to model.safetensors as is.
"""

import json
import math
import struct
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256


@dataclass
class LlamaConfig:
    vocab_size: int = 61
    hidden_size: int = 32
    intermediate_size: int = 48
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def check(self):
        assert self.hidden_size % self.num_attention_heads == 0, "hidden_size must divide by heads"
        assert self.num_attention_heads % self.num_key_value_heads == 0, "heads must divide by kv_heads"
        assert self.head_dim % 2 == 0, "head_dim must be even (RoPE rotates pairs)"

    def hf_dict(self):
        """A transformers LlamaConfig as config.json holds it."""
        d = asdict(self)
        d.update({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "rope_scaling": None,
            "pretraining_tp": 1,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
            "rope_theta": float(self.rope_theta),
            "rms_norm_eps": float(self.rms_norm_eps),
        })
        return dict(sorted(d.items()))


# --------------------------------------------------------------------------
# The model


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(cfg: LlamaConfig, T, device=None):
    """cos, sin [T, hd] for positions 0..T-1."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (float(cfg.rope_theta) ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    pos = torch.arange(T, dtype=torch.int64).float()
    angle = pos[:, None] * inv_freq[None, :]  # [T, hd/2], float32
    emb = torch.cat((angle, angle), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        C = cfg.hidden_size
        self.q_proj = nn.Linear(C, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)   # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # query head h uses kv head h // group: repeat each kv head group times
        group = nh // nkv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        att = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, nh * hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        C, H = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, H, bias=False)
        self.up_proj = nn.Linear(C, H, bias=False)
        self.down_proj = nn.Linear(H, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, idx):
        T = idx.shape[1]
        assert T <= self.cfg.max_position_embeddings, "sequence longer than max_position_embeddings"
        cos, sin = rope_cos_sin(self.cfg, T, idx.device)
        h = self.embed_tokens(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx, targets=None):
        """idx int64 [B, T] -> (logits float32 [B, T, V], mean loss or None)."""
        logits = self.lm_head(self.model(idx)).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def init_weights(model: LlamaForCausalLM, std=0.02, embed_std=0.1, norm_perturb=0.1, generator=None):
    """Matrices N(0, std); embed_tokens and lm_head N(0, embed_std); every
    RMSNorm weight 1 + norm_perturb * N(0, 1) (so that a misplaced or missing
    norm weight changes the result). Draws in named_parameters() order (a tied
    lm_head is the embedding and is not drawn again)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + norm_perturb * torch.randn(p.shape, generator=generator))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                p.normal_(0.0, embed_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def make_adamw(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    """AdamW with decay on tensors of >= 2 dims and none on the norm weights."""
    params = list(model.parameters())  # deduplicated: a tied head appears once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


# --------------------------------------------------------------------------
# Files


def hf_state_dict(model):
    """name -> tensor in transformers' layout; a tied lm_head is left out (as
    save_pretrained does: the loader ties it back to embed_tokens)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        del sd["lm_head.weight"]
    return sd


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> float32 tensor. The safetensors format: u64 LE header
    length N, N bytes of JSON ({"__metadata__": ..., name: {dtype, shape,
    data_offsets [begin, end)}}, padded with spaces to a multiple of 8), then
    the raw little-endian data in the header's order (names sorted)."""
    header = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        assert t.dtype == torch.float32, f"{name}: only F32 is written"
        raw = np.ascontiguousarray(t.cpu().numpy(), dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)))
        f.write(js)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path):
    """-> name -> float32 tensor (F32 only)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", f"{name}: dtype {e['dtype']}"
        b, end = e["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[b:end], dtype="<f4").astype(np.float32).reshape(e["shape"]))
    return out


def load_hf_state_dict(model, tensors):
    sd = dict(tensors)
    if model.cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    model.load_state_dict(sd, strict=True)


def write_shard(path, tokens):
    """llm.c token shard: 256 int32 header (magic, version 1, count), uint16 tokens."""
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < 65536
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:3] = [SHARD_MAGIC, SHARD_VERSION, tokens.size]
    with open(path, "wb") as f:
        f.write(h.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def read_shard(path):
    """-> int64 tensor of the shard's tokens."""
    with open(path, "rb") as f:
        h = np.frombuffer(f.read(HEADER_INTS * 4), dtype="<i4")
        if h[0] != SHARD_MAGIC or h[1] != SHARD_VERSION:
            raise ValueError(f"{path}: not an llm.c token shard (magic {h[0]}, version {h[1]})")
        toks = np.frombuffer(f.read(), dtype="<u2")
    if toks.size != h[2]:
        raise ValueError(f"{path}: header says {h[2]} tokens, file holds {toks.size}")
    return torch.from_numpy(toks.astype(np.int64))


def batch_windows(tokens, B, T):
    """x, y int64 [B, T]: window b = tokens[b*(T+1) : (b+1)*(T+1)], x its
    first T tokens, y its last T."""
    need = B * (T + 1)
    if tokens.numel() < need:
        raise ValueError(f"{tokens.numel()} tokens, a batch of {B} x {T + 1} needs {need}")
    w = tokens[:need].view(B, T + 1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def train_steps(model, forward_loss, x, y, steps, lr, betas, eps, weight_decay, clip):
    """steps AdamW updates on the same batch, the gradient's global norm
    clipped to clip (None: no clipping) before each. forward_loss(model, x, y)
    -> scalar loss. -> (losses before each update, norms before clipping,
    loss after the last update)."""
    opt = make_adamw(model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(model, x, y)
        loss.backward()
        losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        norms.append(norm.item())
        opt.step()
    with torch.no_grad():
        final = forward_loss(model, x, y).item()
    return losses, norms, final
