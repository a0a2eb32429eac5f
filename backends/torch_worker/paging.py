"""KV pages: one preallocated, zeroed KV tensor per KV layout, cut into pages, page 0 reserved
(docs/workers.md); and a request's pages through its life: admit (match, promote, lock), grow, cache
its full blocks, release, the only code that moves pages between a request and the radix cache
(which pages are free is the cache's business)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from backends.cache.host import HostTier
from backends.cache.radix import RadixCache
from backends.torch_worker.request import Request

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


def matched_blocks(
    cache: RadixCache, req: Request, kv_group: str, host: HostTier | None = None
) -> int:
    """The cached prefix of the request's tokens but the last (at least one token is always
    computed: it yields the next token's logits), in blocks, the host tier's continuation of
    the GPU match included; marks the GPU's used, locks nothing."""
    bs = cache.block_size
    blocks = (req.num_tokens - 1) // bs
    keys = req.block_keys(blocks, bs)
    matched = cache.match(keys, blocks, kv_group, req.tokens).blocks
    if host is not None:
        matched += host.match(keys, matched, blocks, kv_group, req.tokens)
    return matched


def admit(
    cache: RadixCache,
    req: Request,
    kv_group: str,
    use_cache: bool,
    host: HostTier | None = None,
) -> int:
    """Take the longest cached prefix of the request's tokens but the last and lock it; with a
    host tier, the blocks it holds after the GPU match are promoted first (copied into GPU
    pages, as far as the GPU has room). Returns the blocks promoted."""
    bs = cache.block_size
    assert req.node is None and not req.pages, "admitting a request that holds pages"
    node = cache.root(kv_group)
    promoted = 0
    if use_cache:
        blocks = (req.num_tokens - 1) // bs
        keys = req.block_keys(blocks, bs)
        match = cache.match(keys, blocks, kv_group, req.tokens)
        node = match.node
        cache.lock(node)
        if host is not None:
            node, promoted = host.promote(
                node,
                keys,
                match.blocks,
                blocks,
                kv_group,
                req.tokens,
                req.cache_salt,
                req.public_blocks,
            )
    else:
        cache.lock(node)
    req.node = node
    req.pages = cache.path_pages(node)
    req.node_blocks = len(req.pages)
    req.computed = len(req.pages) * bs
    return promoted


def pages_needed(req: Request, n: int, page_size: int) -> int:
    """Pages to add so the page table covers `n` more computed tokens."""
    return max(0, -(-(req.computed + n) // page_size) - len(req.pages))


def grow(cache: RadixCache, req: Request, n: int) -> bool:
    """Add `n` pages to the request's table (evicting for the shortfall); False if no room."""
    pages = cache.allocate_pages(n)
    if pages is None:
        return False
    req.pages.extend(pages)
    return True


def cache_blocks(cache: RadixCache, req: Request) -> None:
    """Insert the full blocks of its computed tokens that are not in the tree yet and move its
    lock down to them. Blocks another request cached meanwhile replace ours in its table:

        [0, node_blocks)            already on its locked path
        [node_blocks, full)         inserted now (the tree's page where it had one)
    """
    bs = cache.block_size
    full = req.computed // bs
    start = req.node_blocks
    if full <= start:
        return
    assert req.node is not None
    keys = req.block_keys(full, bs)[start:]
    tokens = req.tokens[start * bs : full * bs]
    salt_at = req.public_blocks - start  # where the salt starts in these blocks
    pages = req.pages[start:full]
    result = cache.insert(req.node, keys, tokens, req.cache_salt, salt_at, pages)
    if result.inserted == 0:
        return  # a hash collision at the first block, or an invalidated path: still private
    assert result.pages is not None
    req.pages[start : start + result.inserted] = result.pages
    cache.move_lock(req.node, result.node)
    req.node = result.node
    req.node_blocks = start + result.inserted


def release(cache: RadixCache, req: Request) -> None:
    """Give back its private pages and its lock (finish, abort or preemption); what it cached
    stays cached."""
    assert req.node is not None
    cache.free_pages(req.pages[req.node_blocks :])
    cache.unlock(req.node)
    req.node = None
    req.node_blocks = 0
    req.pages = []
    req.computed = 0
