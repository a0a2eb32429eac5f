"""Rotary position embeddings as Hugging Face's Llama applies them (rotate_half, not interleaved),
with the config's scaling: none ("default"), "linear" and "llama3". Other kinds are refused
rather than approximated: a wrong RoPE silently changes every K."""

from __future__ import annotations

import math
from typing import Any

import torch


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


class RotaryEmbedding:
    """cos/sin for a batch of positions, computed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, head_dim] each, in `dtype`, for int positions [tokens]."""
        inv = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
