"""Paged attention over the KV pool, a batch of decodes then prefill chunks: torch (tested) and
FlashInfer (CUDA) implementations of one contract (docs/workers.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from backends.torch_worker.model import LlamaConfig

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


class PagedAttention(Protocol):
    """`prepare` once per forward, before the layers; `attend` per layer: q and the result
    [tokens, q_heads, head_dim], caches [pages, page_size, kv_heads, head_dim] (K/V written)."""

    def prepare(self, layout: BatchLayout, device: torch.device) -> None: ...
    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """Gather whole pages (index_select of contiguous page_size x heads x dim blocks, much
    cheaper than a gather per token), then scaled_dot_product_attention."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        # (first row, sequences, rows each, pages, mask, keys each): the decodes as one padded
        # group, then each prefill chunk
        self._groups: list[tuple[int, int, int, torch.Tensor, torch.Tensor, int | None]] = []

    def prepare(self, layout: BatchLayout, device: torch.device) -> None:
        bs, decodes = layout.page_size, layout.decodes
        self._groups = []
        if decodes:
            pmax = max(-(-s.kv_len // bs) for s in decodes)
            pages = torch.zeros(len(decodes), pmax, dtype=torch.long)
            for i, seq in enumerate(decodes):
                used = -(-seq.kv_len // bs)
                pages[i, :used] = torch.tensor(seq.pages[:used], dtype=torch.long)
            lengths = torch.tensor([s.kv_len for s in decodes])
            mask = (torch.arange(pmax * bs)[None, :] < lengths[:, None])[:, None, None, :]
            group = (0, len(decodes), 1, pages.view(-1).to(device), mask.to(device), None)
            self._groups.append(group)
        start = len(decodes)
        for seq in layout.prefills:
            past = seq.kv_len - seq.q_len
            causal = torch.arange(seq.kv_len)[None, :] <= past + torch.arange(seq.q_len)[:, None]
            pages = torch.tensor(seq.pages[: -(-seq.kv_len // bs)], dtype=torch.long).to(device)
            self._groups.append((start, 1, seq.q_len, pages, causal.to(device), seq.kv_len))
            start += seq.q_len

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        heads, dim = k_cache.shape[-2], k_cache.shape[-1]
        out = torch.empty_like(q)
        for start, b, n, pages, mask, kv_len in self._groups:
            k = k_cache.index_select(0, pages).view(b, -1, heads, dim)[:, :kv_len]
            v = v_cache.index_select(0, pages).view(b, -1, heads, dim)[:, :kv_len]
            o = F.scaled_dot_product_attention(
                q[start : start + b * n].unflatten(0, (b, n)).transpose(1, 2),  # [b, Hq, n, D]
                k.transpose(1, 2),  # [b, Hkv, keys, D]
                v.transpose(1, 2),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + b * n] = o.transpose(1, 2).flatten(0, 1)
        return out


class FlashInferPagedAttention:  # pragma: no cover - needs CUDA and flashinfer
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper: one plan per forward, one run per
    layer. Decodes are prefills of one token, so the whole mixed batch is one kernel call."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device) -> None:
        if flashinfer is None:
            raise RuntimeError("flashinfer is not installed")
        self.scale = cfg.head_dim**-0.5
        self.shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
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
    backend: str, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device
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
        return FlashInferPagedAttention(cfg, dtype, device)
    if backend not in ("torch", "auto"):
        raise ValueError(f"unknown attention backend {backend!r}")
    return TorchPagedAttention(cfg.head_dim**-0.5)
