"""A Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over paged KV,
with Hugging Face's parameter names. `forward` writes the new tokens' K/V into the pool and
returns the last hidden state; `logits` projects the rows that get sampled."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch_worker.attention import PagedAttention
from backends.torch_worker.config import LlamaConfig
from backends.torch_worker.rope import RotaryEmbedding, apply_rope

Device = torch.device | str | None


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
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.q_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_cache.view(-1, self.kv_heads, self.head_dim)[write_slots] = k
        v_cache.view(-1, self.kv_heads, self.head_dim)[write_slots] = v
        out = attention.attend(q, k_cache, v_cache)
        return self.o_proj(out.reshape(n, self.q_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: Device = None) -> None:
        super().__init__()
        bias, hidden, inner = cfg.mlp_bias, cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        write_slots: torch.Tensor,
        attention: PagedAttention,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn(
                layer.input_layernorm(h), cos, sin, kv[0, i], kv[1, i], write_slots, attention
            )
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
