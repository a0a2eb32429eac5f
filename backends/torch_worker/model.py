"""A Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over paged KV,
with Hugging Face's parameter names. RoPE as HF's Llama applies it (rotate_half), with "default",
"linear" and "llama3" scaling; others are refused: a wrong RoPE silently changes every K.
`ModelRunner` turns one model's batch of (request, new tokens) into tensors (decodes first, as
attention.py expects) and runs one forward pass, with its LoRA adapter's deltas when it has one
(lora.py). `LlamaConfig` is its shape, read from (and
written as) a Hugging Face config.json; `PRESETS` are shapes built with random weights."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch_worker.attention import BatchLayout, PagedAttention, SequenceView
from backends.torch_worker.lora import LayerLora, LoraWeights, lora_linear
from backends.torch_worker.paging import PagePool
from backends.torch_worker.request import Request
from core.tokenizer import BYTE_VOCAB_SIZE

Device = torch.device | str | None

_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: str | None = None  # the config's rope_scaling object as canonical JSON
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.hidden_size, self.num_hidden_layers) <= 0:
            raise ValueError("vocab_size, hidden_size and num_hidden_layers must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else json.loads(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """From a config.json; ValueError for an architecture this engine does not run."""
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (expected one of {_ARCHITECTURES})"
            )
        heads = int(hf["num_attention_heads"])
        scaling = hf.get("rope_scaling")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10_000.0)),
            rope_scaling=None if scaling is None else json.dumps(scaling, sort_keys=True),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that `from_hf` reads back to an equal config."""
        out: dict[str, Any] = asdict(self)
        out["rope_scaling"] = self.rope_scaling_dict
        out["architectures"] = ["LlamaForCausalLM"]
        out["model_type"] = "llama"
        out["hidden_act"] = "silu"
        return out


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
    ),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500_000.0,
        rope_scaling='{"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, '
        '"original_max_position_embeddings": 8192, "rope_type": "llama3"}',  # canonical JSON
        max_position_embeddings=131_072,
        tie_word_embeddings=True,
    ),
}


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The per-pair inverse frequencies (float32 on the CPU, [head_dim / 2]) after scaling."""
    dims = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (theta ** (dims / head_dim))
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv.float()
    assert scaling is not None
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = original / low, original / high
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(medium, blended, out).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: Device = None) -> None:
        super().__init__()
        self.q_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias, d = cfg.attention_bias, device
        q_size, kv_size = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=bias, device=d)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=bias, device=d)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=bias, device=d)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False, device=d)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,
        attention: PagedAttention,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = lora_linear(self.q_proj, x, lora, "q_proj").view(n, self.q_heads, self.head_dim)
        k = lora_linear(self.k_proj, x, lora, "k_proj").view(n, self.kv_heads, self.head_dim)
        v = lora_linear(self.v_proj, x, lora, "v_proj").view(n, self.kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache.view(-1, self.kv_heads, self.head_dim)[write_slots] = k
        v_cache.view(-1, self.kv_heads, self.head_dim)[write_slots] = v
        out = attention.attend(q, k_cache, v_cache)
        return lora_linear(
            self.o_proj, out.reshape(n, self.q_heads * self.head_dim), lora, "o_proj"
        )


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: Device = None) -> None:
        super().__init__()
        bias, hidden, inner = cfg.mlp_bias, cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, device=device)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        gate = F.silu(lora_linear(self.gate_proj, x, lora, "gate_proj"))
        return lora_linear(
            self.down_proj, gate * lora_linear(self.up_proj, x, lora, "up_proj"), lora, "down_proj"
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: Device = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = Attention(cfg, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.mlp = MLP(cfg, device)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: Device = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    """`forward(ids, positions, kv, write_slots, attention)`: `kv` is the pool tensor
    `[2, layers, pages, page_size, kv_heads, head_dim]` (K at 0, V at 1). `device="meta"`
    builds it without memory (the loader then allocates and fills it)."""

    def __init__(self, cfg: LlamaConfig, device: Device = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's [tokens, head_dim] each, once per forward for all layers."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        write_slots: torch.Tensor,
        attention: PagedAttention,
        lora: LoraWeights | None = None,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            delta = None if lora is None else lora.layers[i]
            x = layer.input_layernorm(h)
            h = h + layer.self_attn(x, cos, sin, kv[0, i], kv[1, i], write_slots, attention, delta)
            h = h + layer.mlp(layer.post_attention_layernorm(h), delta)
        return self.model.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def new_token_slots(seq: SequenceView, page_size: int) -> list[int]:
    """Where the sequence's new tokens go (the last `q_len` of its `kv_len`)."""
    return [
        seq.pages[p // page_size] * page_size + p % page_size
        for p in range(seq.kv_len - seq.q_len, seq.kv_len)
    ]


class WorkItem(NamedTuple):
    req: Request
    n: int  # new tokens this forward computes: tokens[computed : computed + n]


class ForwardResult(NamedTuple):
    sampled: list[Request]  # requests whose last token was computed: they get a next token
    logits: torch.Tensor  # [len(sampled), vocab] float32, row i for sampled[i]


class ModelRunner:
    """One model's forward passes; `lora`: its adapter's weights on the device while active
    (a LoRA adapter's runner shares its base's model and attention)."""

    def __init__(
        self, model: LlamaForCausalLM, attention: PagedAttention, device: torch.device
    ) -> None:
        self.model = model
        self.attention = attention
        self.device = device
        self.lora: LoraWeights | None = None

    def forward(self, pool: PagePool, items: list[WorkItem]) -> ForwardResult:
        bs = pool.layout.page_size
        decodes = [SequenceView(1, it.req.computed + 1, it.req.pages) for it in items if it.n == 1]
        prefills = [
            SequenceView(it.n, it.req.computed + it.n, it.req.pages) for it in items if it.n > 1
        ]
        ordered = [it for it in items if it.n == 1] + [it for it in items if it.n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []  # the batch row of each sampled request's last token
        sampled: list[Request] = []
        for it, seq in zip(ordered, decodes + prefills, strict=True):
            req, start = it.req, it.req.computed
            assert len(req.pages) * bs >= start + it.n, "pages do not cover the chunk"
            ids.extend(req.tokens[start : start + it.n])
            positions.extend(range(start, start + it.n))
            slots.extend(new_token_slots(seq, bs))
            if start + it.n == req.num_tokens:
                rows.append(len(ids) - 1)
                sampled.append(req)
        device = self.device
        layout = BatchLayout(bs, decodes, prefills, torch.tensor(slots, dtype=torch.long))
        self.attention.prepare(layout, device)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            pool.kv,
            layout.write_slots.to(device),
            self.attention,
            self.lora,
        )
        if not rows:
            return ForwardResult([], hidden.new_empty((0, self.model.config.vocab_size)))
        logits = self.model.logits(hidden[torch.tensor(rows, device=device)])
        return ForwardResult(sampled, logits)
