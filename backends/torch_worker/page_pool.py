"""One preallocated, zeroed KV tensor per KV layout, cut into pages, page 0 reserved
(docs/workers.md). Which pages are free is the radix cache's business."""

from __future__ import annotations

from typing import NamedTuple

import torch

RESERVED_PAGE = 0


class KVLayout(NamedTuple):
    """What makes two models' pages interchangeable as memory (not as content)."""

    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def page_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.page_size * self.kv_heads * self.head_dim * elem


class PagePool:
    """`num_pages` pages of `layout` on `device`, page 0 reserved (so `capacity` is one less)."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        if num_pages < 2:
            raise ValueError("a pool needs at least 2 pages (page 0 is reserved)")
        self.layout = layout
        self.num_pages = num_pages
        shape = (2, layout.layers, num_pages, layout.page_size, layout.kv_heads, layout.head_dim)
        self.kv = torch.zeros(shape, dtype=layout.dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def page_ids(self) -> list[int]:
        """Every page but the reserved one, as a stack (the last is handed out first)."""
        return list(range(self.num_pages - 1, RESERVED_PAGE, -1))
