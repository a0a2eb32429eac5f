"""Paged attention over the KV pool: each sequence's K/V live in its pages, wherever they are.

A forward batch holds, in order, the decode sequences (one new token each) and then the prefill
chunks (several new tokens each). Every sequence is described by its page table and its
length; the new tokens are the last `q_len` of its `kv_len` tokens, so a query at offset i of
its chunk sees keys [0, kv_len - q_len + i].

Two implementations of one contract (`attend(layer, q, k_cache, v_cache) -> out`):
- `TorchPagedAttention`: gather the sequence's pages, then scaled dot product attention;
  decodes in one padded batch (padding reads the reserved page 0 and is masked), chunks one
  by one.
  Runs on CPU and CUDA; it is the tested path.
- `FlashInferPagedAttention`: FlashInfer's batch prefill kernel over the same NHD pages (CUDA,
  when `flashinfer` imports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

try:  # optional: only on CUDA machines that have it
    import flashinfer  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - not installed in CI
    flashinfer = None


@dataclass(slots=True)
class SequenceView:
    """One sequence of a forward batch: `q_len` new tokens ending its `kv_len` tokens."""

    q_len: int
    kv_len: int
    pages: list[int]  # its page table: token p lives in pages[p // page_size]


@dataclass(slots=True)
class BatchLayout:
    """Everything attention needs about a batch, built once per forward on the CPU."""

    page_size: int
    decodes: list[SequenceView]  # q_len == 1, first in the batch
    prefills: list[SequenceView]  # after the decodes, in order
    write_slots: torch.Tensor  # [tokens] long: pool slot (page * page_size + offset) per token

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.q_len for s in self.prefills)


def new_token_slots(seq: SequenceView, page_size: int) -> list[int]:
    """Where the sequence's new tokens go (the last `q_len` of its `kv_len`)."""
    return [
        seq.pages[p // page_size] * page_size + p % page_size
        for p in range(seq.kv_len - seq.q_len, seq.kv_len)
    ]


class PagedAttention(Protocol):
    def prepare(self, layout: BatchLayout, device: torch.device) -> None:
        """Called once per forward, before the layers."""
        ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [tokens, q_heads, head_dim]; caches: [pages, page_size, kv_heads, head_dim] with
        this forward's K/V already written. Returns [tokens, q_heads, head_dim]."""
        ...


class TorchPagedAttention:
    """Gather whole pages (index_select of contiguous page_size x heads x dim blocks, much
    cheaper than a gather per token), then scaled_dot_product_attention; see the module doc."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._decode_pages: torch.Tensor | None = None  # [B * Pmax] pages, padded with page 0
        self._decode_shape = (0, 0)  # (B, Pmax)
        self._decode_mask: torch.Tensor | None = None  # [B, 1, 1, Pmax * page_size]
        self._prefill: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []

    def prepare(self, layout: BatchLayout, device: torch.device) -> None:
        bs = layout.page_size
        self._decode_pages = self._decode_mask = None
        if layout.decodes:
            pmax = max(-(-s.kv_len // bs) for s in layout.decodes)
            pages = torch.zeros(len(layout.decodes), pmax, dtype=torch.long)
            for i, seq in enumerate(layout.decodes):
                used = -(-seq.kv_len // bs)
                pages[i, :used] = torch.tensor(seq.pages[:used], dtype=torch.long)
            lengths = torch.tensor([s.kv_len for s in layout.decodes])
            mask = torch.arange(pmax * bs)[None, :] < lengths[:, None]
            self._decode_pages = pages.view(-1).to(device)
            self._decode_shape = (len(layout.decodes), pmax)
            self._decode_mask = mask[:, None, None, :].to(device)
        self._prefill = []
        start = len(layout.decodes)
        for seq in layout.prefills:
            past = seq.kv_len - seq.q_len
            causal = torch.arange(seq.kv_len)[None, :] <= past + torch.arange(seq.q_len)[:, None]
            used = -(-seq.kv_len // bs)
            pages = torch.tensor(seq.pages[:used], dtype=torch.long).to(device)
            self._prefill.append((start, seq.q_len, seq.kv_len, pages, causal.to(device)))
            start += seq.q_len

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        heads, dim = k_cache.shape[-2], k_cache.shape[-1]
        out = torch.empty_like(q)
        if self._decode_pages is not None:
            b, pmax = self._decode_shape
            k = k_cache.index_select(0, self._decode_pages).view(b, -1, heads, dim)
            v = v_cache.index_select(0, self._decode_pages).view(b, -1, heads, dim)
            o = F.scaled_dot_product_attention(
                q[:b].unsqueeze(2),  # [B, Hq, 1, D]
                k.transpose(1, 2),  # [B, Hkv, Pmax * page_size, D]
                v.transpose(1, 2),
                attn_mask=self._decode_mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[:b] = o.squeeze(2)
        for start, n, kv_len, pages, causal in self._prefill:
            k = k_cache.index_select(0, pages).view(-1, heads, dim)[:kv_len]
            v = v_cache.index_select(0, pages).view(-1, heads, dim)[:kv_len]
            o = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
                k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, kv_len, D]
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=causal,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + n] = o.squeeze(0).transpose(0, 1)
        return out


class FlashInferPagedAttention:  # pragma: no cover - needs CUDA and flashinfer
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper: one plan per forward, one run per
    layer. Decodes are prefills of one token, so the whole mixed batch is one kernel call."""

    def __init__(
        self,
        scale: float,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if flashinfer is None:
            raise RuntimeError("flashinfer is not installed")
        self.scale = scale
        self.shape = (q_heads, kv_heads, head_dim)
        self.dtype = dtype
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def prepare(self, layout: BatchLayout, device: torch.device) -> None:
        seqs = layout.decodes + layout.prefills
        bs = layout.page_size
        qo = [0]
        kv_indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        for seq in seqs:
            used = -(-seq.kv_len // bs)
            qo.append(qo[-1] + seq.q_len)
            indices.extend(seq.pages[:used])
            kv_indptr.append(len(indices))
            last.append(seq.kv_len - (used - 1) * bs)
        i32 = torch.int32
        q_heads, kv_heads, head_dim = self.shape
        self._wrapper.plan(
            torch.tensor(qo, dtype=i32, device=device),
            torch.tensor(kv_indptr, dtype=i32, device=device),
            torch.tensor(indices, dtype=i32, device=device),
            torch.tensor(last, dtype=i32, device=device),
            q_heads,
            kv_heads,
            head_dim,
            bs,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q.contiguous(), (k_cache, v_cache))


def make_attention(
    backend: str,
    scale: float,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedAttention:
    """`backend`: "torch", "flashinfer", or "auto" (FlashInfer on CUDA when it imports and
    the dtype is one its kernels take)."""
    use_flashinfer = backend == "flashinfer" or (
        backend == "auto"
        and device.type == "cuda"
        and flashinfer is not None
        and dtype in (torch.float16, torch.bfloat16)
    )
    if use_flashinfer:
        return FlashInferPagedAttention(scale, q_heads, kv_heads, head_dim, dtype, device)
    if backend not in ("torch", "auto"):
        raise ValueError(f"unknown attention backend {backend!r}")
    return TorchPagedAttention(scale)
