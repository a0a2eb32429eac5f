"""The one radix cache of both workers (backends/cache/): match, insert, locks, LRU eviction of
unlocked leaves for the shortfall only, kv_groups and salts, pages and token confirmation,
scoped invalidation, the events it reports, and the integrity check after every operation
(test_radix_cache_model.py: the property test against a brute-force model)."""

from __future__ import annotations

from backends.cache.check import check
from backends.cache.nodes import Run
from backends.cache.radix import RadixCache
from backends.cache.scopes import invalidate
from core.blocks import block_keys, salt_scope
from core.kv_events import BlockRemoved, EventBatch, KVEvent, block_stored
from router.gateway.isolation import user_salt
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror

BS = 4


def toks(*blocks: int) -> list[int]:
    """One block of BS equal tokens per argument."""
    return [t for b in blocks for t in [b] * BS]


class Recorder:
    """What the callbacks say each tree holds (a KV event stream in miniature)."""

    def __init__(self) -> None:
        self.keys: dict[str, set[int]] = {}
        self.removed: list[tuple[str, list[int]]] = []
        self.events: list[KVEvent] = []

    def stored(
        self,
        group: str,
        parent: int | None,
        keys: list[int],
        tokens: list[int] | None,
        salt: str | None,
    ) -> None:
        held = self.keys.setdefault(group, set())
        assert parent is None or parent in held, "a store under an unknown parent"
        assert tokens is not None and len(tokens) == len(keys) * BS
        assert parent is not None or block_keys(tokens, BS, salt)[0] == keys[0], "root salt"
        assert held.isdisjoint(keys)
        held.update(keys)
        self.events.append(block_stored(keys, parent, tokens, BS, salt=salt))

    def gone(self, group: str, keys: list[int]) -> None:
        assert set(keys) <= self.keys[group]
        self.keys[group].difference_update(keys)
        self.removed.append((group, keys))
        self.events.append(BlockRemoved(keys, "GPU"))


def make(blocks: int, paged: bool = False) -> tuple[RadixCache, Recorder]:
    rec = Recorder()
    ids = list(range(blocks, 0, -1)) if paged else None
    cache = RadixCache(
        blocks * BS, BS, page_ids=ids, keep_tokens=paged, on_stored=rec.stored, on_removed=rec.gone
    )
    return cache, rec


def put(
    cache: RadixCache, tokens: list[int], salt: str | None = None, group: str = "", public: int = 0
) -> Run:
    """Allocate, insert and unlock a whole prompt (as a finished request leaves it)."""
    keys = block_keys(tokens, BS, salt, public)
    match = cache.match(keys, None, group, tokens)
    cache.lock(match.node)
    n = len(keys) - match.blocks
    pages = cache.allocate_pages(n) if cache.page_ids is not None else None
    assert pages is not None or cache.allocate(n * BS)
    rest = tokens[match.blocks * BS :]
    ins = cache.insert(match.node, keys[match.blocks :], rest, salt, public - match.blocks, pages)
    cache.unlock(match.node)
    check(cache)
    return ins.node


def test_match_insert_and_split() -> None:
    cache, rec = make(16)
    put(cache, toks(1, 2, 3))
    assert len(cache) == 3 and rec.keys[""] == cache.keys()
    keys = block_keys(toks(1, 2, 9), BS)
    match = cache.match(keys)
    assert match.blocks == 2 and match.node.keys == keys[:2]  # the run was split
    check(cache)
    assert cache.match(block_keys(toks(1, 2, 3, 4), BS), max_blocks=2).blocks == 2
    assert cache.match(block_keys(toks(7), BS)).blocks == 0
    check(cache)


def test_insert_returns_what_was_cached_meanwhile() -> None:
    cache, _ = make(16)
    keys = block_keys(toks(1, 2, 3), BS)
    a = cache.match(keys)
    cache.lock(a.node)
    assert cache.allocate(3 * BS)
    put(cache, toks(1, 2))  # another request cached the first two blocks meanwhile
    free_before = cache.free_tokens
    ins = cache.insert(a.node, keys, toks(1, 2, 3))
    assert (ins.cached_blocks, ins.new_blocks) == (2, 1)
    assert cache.free_tokens == free_before + 2 * BS  # our copy of the two is freed
    assert ins.node.keys == keys[2:]
    check(cache)
    cache.unlock(a.node)
    check(cache)


def test_eviction_takes_only_the_shortfall_from_unlocked_lru_leaves() -> None:
    cache, rec = make(10)
    put(cache, toks(1, 2, 3))
    put(cache, toks(4, 5, 6))
    put(cache, toks(7, 8))
    cache.match(block_keys(toks(1, 2, 3), BS))  # used again: 4,5,6 is now the oldest
    assert cache.free_tokens == 2 * BS
    assert cache.allocate(3 * BS + 1)  # 2 blocks short (1 token over a block)
    check(cache)
    assert rec.removed == [("", block_keys(toks(4, 5, 6), BS)[1:][::-1])]  # the oldest's tail
    assert cache.free_tokens == BS - 1  # 2 blocks freed, 3 blocks + 1 token taken


def test_locked_paths_survive_and_allocation_fails_without_evicting() -> None:
    cache, rec = make(6)
    put(cache, toks(1, 2, 3))
    leaf = put(cache, toks(4, 5, 6))
    cache.lock(leaf)  # a running request holds 4,5,6 and, through it, nothing else
    check(cache)
    assert cache.protected_tokens == 3 * BS and cache.evictable_tokens == 3 * BS
    assert not cache.allocate(4 * BS)  # would need a locked block
    assert rec.removed == [] and len(cache) == 6
    assert cache.allocate(3 * BS)  # all of 1,2,3 goes, deepest first
    assert rec.removed == [("", block_keys(toks(1, 2, 3), BS)[::-1])]
    cached = cache.keys()  # a set of every cached key
    assert block_keys(toks(4, 5, 6), BS)[-1] in cached
    check(cache)
    cache.unlock(leaf)
    cache.free(3 * BS)
    check(cache)
    assert cache.evictable_tokens == 3 * BS and cache.free_tokens == 3 * BS


def test_a_parent_becomes_evictable_once_its_children_are_gone() -> None:
    cache, rec = make(4)
    put(cache, toks(1, 2))
    put(cache, toks(1, 2, 3))  # a child run under 1,2
    put(cache, toks(9, 9))
    cache.match(block_keys(toks(9, 9), BS))
    assert cache.allocate(4 * BS)  # everything, LRU: 3, then 2 and 1, then 9,9
    assert rec.removed[0] == ("", block_keys(toks(1, 2, 3), BS)[-1:])
    assert len(cache) == 0
    check(cache)


def test_salts_and_kv_groups_isolate() -> None:
    cache, rec = make(32)
    put(cache, toks(1, 2, 3), salt="tenant-a")
    assert cache.match(block_keys(toks(1, 2, 3), BS)).blocks == 0
    assert cache.match(block_keys(toks(1, 2, 3), BS, "tenant-b")).blocks == 0
    assert cache.match(block_keys(toks(1, 2, 3), BS, "tenant-a")).blocks == 3
    put(cache, toks(1, 2, 3))
    assert len(cache) == 6 and rec.keys[""] == cache.keys()
    put(cache, toks(1, 2, 3), group="b")  # the same keys, another group's tree
    assert cache.keys("b") == set(block_keys(toks(1, 2, 3), BS)) and len(cache) == 9
    assert cache.match(block_keys(toks(1, 2, 3), BS), None, "c").blocks == 0
    check(cache)


def test_repeated_touches_keep_one_lru_entry_per_leaf() -> None:
    cache, _ = make(16)
    put(cache, toks(1, 2))
    keys = block_keys(toks(1, 2), BS)
    for _ in range(5000):
        cache.match(keys)
    check(cache)  # the list holds exactly the unlocked leaves, in stamp order
    assert cache._lru.next is cache._lru.prev is not cache._lru


def test_pages_the_tree_had_win_and_eviction_crosses_groups() -> None:
    cache, rec = make(8, paged=True)
    tokens = toks(1, 2, 3)
    keys = block_keys(tokens, BS)
    first = put(cache, tokens, group="a")
    a_pages = cache.path_pages(first)
    mine = cache.allocate_pages(3)  # a second request computed the same blocks meanwhile
    assert mine is not None
    ins = cache.insert(cache.root("a"), keys, tokens, None, None, mine)
    assert ins.pages == a_pages and ins.node is first and ins.cached_blocks == 3
    assert len(cache.page_ids or []) == 5  # our copies went back
    longer = tokens + toks(7, 7)
    assert cache.match(block_keys(longer, BS), 5, "a", longer).blocks == 3
    put(cache, toks(5, 6), group="b")  # newer than "a"'s blocks
    assert cache.allocate_pages(4) is not None  # 3 free: 1 short, the tail of the oldest
    assert rec.removed == [("a", keys[-1:])]
    assert cache.allocate_pages(5) is None  # more than free + evictable: nothing evicted
    assert cache.allocate_pages(4) is not None
    assert rec.removed[1:] == [("a", keys[:2][::-1]), ("b", block_keys(toks(5, 6), BS)[::-1])]
    check(cache)


def test_a_hash_collision_is_never_shared() -> None:
    cache, _ = make(8, paged=True)
    put(cache, toks(1))
    key = block_keys(toks(1), BS)[0]
    assert cache.match([key], 1, "", toks(5)).blocks == 0  # same key, other tokens
    pages = cache.allocate_pages(1)
    assert pages is not None
    result = cache.insert(cache.root(), [key], toks(5), None, None, pages)
    assert result.inserted == 0 and cache.allocated_tokens == BS  # still the caller's
    cache.free_pages(pages)
    check(cache)


PUBLIC = list(range(100, 112))  # 3 blocks


def test_public_prefix_is_shared_and_events_rebuild_the_tree() -> None:
    cache, rec = make(40, paged=True)
    a = PUBLIC + [1] * 8
    put(cache, a, "ta", public=3)
    assert cache.match(block_keys(a, BS, "tb", 3), None, "", a).blocks == 3  # public only
    put(cache, a, "tb", public=3)
    put(cache, a, "tc")  # tenant level: a root in its own namespace
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "", block_size=BS)
    mirror.apply(0, EventBatch(0.0, list(rec.events)), 0.0)
    assert index.residency("w", "") == cache.keys()
    assert mirror.stats().skipped_orphans == 0
    for salt, public in (("ta", 3), ("tb", 3), ("tc", 0)):
        assert index.match(block_keys(a, BS, salt, public), "") == {"w": 5}


def test_invalidating_a_tenant_frees_now_or_once_released() -> None:
    cache, rec = make(40, paged=True)
    a = PUBLIC + [1] * 8
    keys_a = block_keys(a, BS, "ta", 3)
    held = put(cache, a, "ta", public=3)
    cache.lock(held)  # running
    put(cache, PUBLIC + [2] * 8, user_salt("ta", "u"), public=3)
    put(cache, a, "tb", public=3)
    rec.removed.clear()
    gone = invalidate(cache, salt_scope(salt_prefix="ta"))
    check(cache)
    assert gone.freed_blocks == 2 and gone.locked_blocks == 2  # ta.u.* freed, ta locked
    removed = {k for _, keys in rec.removed for k in keys}
    user = block_keys(PUBLIC + [2] * 8, BS, user_salt("ta", "u"), 3)
    assert removed == set(keys_a[3:]) | set(user[3:])
    assert cache.match(keys_a, 5, "", a).blocks == 3  # the public part only
    assert cache.match(block_keys(a, BS, "tb", 3), 5, "", a).blocks == 5
    # nothing is cached under the invalidated path; released, its pages come back
    pages = cache.allocate_pages(1)
    assert pages is not None
    assert cache.insert(held, [keys_a[-1] + 1], [7] * BS, "ta", None, pages).inserted == 0
    cache.free_pages(pages)
    cache.unlock(held)
    check(cache)
    assert cache.allocate_pages((cache.free_tokens + cache.evictable_tokens) // BS) is not None
    check(cache)
    assert all(k >= 0 for _, keys in rec.removed for k in keys)
    assert invalidate(cache, None) == (0, 0) and len(cache) == 0
