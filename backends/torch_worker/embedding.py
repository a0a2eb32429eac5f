"""Embeddings from a served model (docs/workers.md): the mean over the prompt's tokens of the
last hidden state (after the final norm), L2-normalised. One causal forward pass per prompt over
a scratch KV of its own: the pool's pages and the radix cache are not touched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.torch_worker.attention import BatchLayout, SequenceView, TorchPagedAttention
from backends.torch_worker.loader import LoadedModel


@torch.inference_mode()
def embed(loaded: LoadedModel, prompt: list[int]) -> list[float]:
    """The unit-norm mean-pooled last hidden state of `prompt` (checked token ids)."""
    cfg, page, device = loaded.config, loaded.page_size, loaded.device
    n = len(prompt)
    pages = -(-n // page)
    shape = (2, cfg.num_hidden_layers, pages + 1, page, cfg.num_key_value_heads, cfg.head_dim)
    kv = torch.zeros(shape, dtype=loaded.dtype, device=device)
    # page 0 stays unused, as in the pool; token p lives at slot page + p of pages 1..pages
    slots = torch.arange(page, page + n, dtype=torch.long)
    layout = BatchLayout(page, [], [SequenceView(n, n, list(range(1, pages + 1)))], slots)
    attention = TorchPagedAttention(cfg.head_dim**-0.5)
    attention.prepare(layout, device)
    hidden = loaded.model(
        torch.tensor(prompt, dtype=torch.long, device=device),
        torch.arange(n, dtype=torch.long, device=device),
        kv,
        slots.to(device),
        attention,
    )
    pooled = hidden.float().mean(dim=0)
    return F.normalize(pooled, dim=0).cpu().tolist()
