"""The torch worker's page cache under isolation levels and scoped invalidation: a public
prefix shared across salts (its events rebuilding the tree in the gateway's mirror), and
invalidation of a tenant with a locked path: unmatchable at once, its pages back once released.
The integrity check runs after every operation."""

from __future__ import annotations

import torch

from backends.engine.cache_scopes import invalidate
from backends.engine.page_pool import KVLayout, PagePool
from backends.engine.radix_cache import PageRadixCache
from core.blocks import block_keys, salt_scope
from core.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent
from router.gateway.isolation import user_salt
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror

BS = 4
LAYOUT = KVLayout(1, 1, 2, BS, torch.float32)
PUBLIC = list(range(100, 112))  # 3 blocks


def make(pages: int = 40) -> tuple[PageRadixCache, list[KVEvent]]:
    events: list[KVEvent] = []
    cache = PageRadixCache(
        PagePool(LAYOUT, pages, torch.device("cpu")),
        on_stored=lambda g, parent, keys, toks, salt: events.append(
            BlockStored(keys, parent, toks, BS, None, "GPU", cache_salt=salt)
        ),
        on_removed=lambda g, keys: events.append(BlockRemoved(keys, "GPU")),
    )
    return cache, events


def put(cache: PageRadixCache, tokens: list[int], salt: str | None, public: int = 0):
    """Compute `tokens` as a request would (in two chunks), keyed with a public prefix."""
    keys = block_keys(tokens, BS, salt, public)
    match = cache.match("g", keys, tokens, len(keys))
    node, have = match.node, len(match.pages)
    cache.lock(node)
    for end in (min(have + 2, len(keys)), len(keys)):  # chunked, across the public edge
        if end <= have:
            continue
        pages = cache.allocate(end - have)
        assert pages is not None
        result = cache.insert(
            node, keys[have:end], tokens[have * BS : end * BS], pages, salt, public - have
        )
        cache.lock(result.node)
        cache.unlock(node)
        node, have = result.node, end
        cache.check()
    return node, len(match.pages)


def test_public_prefix_is_shared_and_events_rebuild_the_tree() -> None:
    cache, events = make()
    a = PUBLIC + [1] * 8
    node_a, hit = put(cache, a, "ta", 3)
    assert hit == 0
    node_b, hit = put(cache, a, "tb", 3)
    assert hit == 3  # the public blocks, and none of ta's
    node_c, hit = put(cache, a, "tc")  # tenant level: a root in its own namespace
    assert hit == 0
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "g", block_size=BS)
    mirror.apply(0, EventBatch(0.0, list(events)), 0.0)
    assert index.residency("w", "g") == cache.keys("g")
    assert mirror.stats().skipped_orphans == 0
    for salt, public in (("ta", 3), ("tb", 3), ("tc", 0)):
        assert index.match(block_keys(a, BS, salt, public), "g") == {"w": 5}
    for node in (node_a, node_b, node_c):
        cache.unlock(node)
    cache.check()


def test_invalidating_a_tenant_frees_now_or_once_released() -> None:
    cache, events = make()
    a = PUBLIC + [1] * 8
    held, _ = put(cache, a, "ta", 3)  # running: locked
    done, _ = put(cache, PUBLIC + [2] * 8, user_salt("ta", "u"), 3)
    cache.unlock(done)
    other, _ = put(cache, a, "tb", 3)
    cache.unlock(other)
    events.clear()
    gone = invalidate(cache, salt_scope(salt_prefix="ta"))
    cache.check()
    assert gone.freed_blocks == 2 and gone.locked_blocks == 2  # ta.u.* freed, ta locked
    removed = {k for e in events if isinstance(e, BlockRemoved) for k in e.block_hashes}
    assert removed == set(block_keys(a, BS, "ta", 3)[3:]) | set(
        block_keys(PUBLIC + [2] * 8, BS, user_salt("ta", "u"), 3)[3:]
    )
    keys_a = block_keys(a, BS, "ta", 3)
    assert len(cache.match("g", keys_a, a, 5).pages) == 3  # the public part only
    assert len(cache.match("g", block_keys(a, BS, "tb", 3), a, 5).pages) == 5
    # nothing is cached under the invalidated path; released, its pages come back
    pages = cache.allocate(1)
    assert pages is not None
    assert cache.insert(held, [keys_a[-1] + 1], [7] * BS, pages, "ta").inserted == 0
    cache.free(pages)
    cache.unlock(held)
    cache.check()
    assert cache.allocate(cache.pool.free_pages + cache.evictable_pages) is not None
    cache.check()
    assert all(k >= 0 for e in events for k in getattr(e, "block_hashes", []))
