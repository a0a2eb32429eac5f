"""The radix cache of pages on its own: matching, inserting what another request cached
meanwhile, locks, eviction of the shortfall only in LRU order across kv_groups, namespaces,
the events it reports, and a randomized run against a brute-force model with the integrity
check after every operation."""

from __future__ import annotations

import random

import torch

from backends.engine.page_pool import KVLayout, PagePool
from backends.engine.radix_cache import PageRadixCache
from core.blocks import block_keys

BS = 4
LAYOUT = KVLayout(1, 1, 2, BS, torch.float32)


class Recorder:
    def __init__(self) -> None:
        self.stored: list[tuple[str, int | None, list[int], list[int], str | None]] = []
        self.removed: list[tuple[str, list[int]]] = []

    def on_stored(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.stored.append(args)

    def on_removed(self, group: str, keys: list[int]) -> None:
        self.removed.append((group, keys))


def make(pages: int = 9) -> tuple[PageRadixCache, Recorder]:
    rec = Recorder()
    cache = PageRadixCache(
        PagePool(LAYOUT, pages, torch.device("cpu")),
        on_stored=rec.on_stored,
        on_removed=rec.on_removed,
    )
    return cache, rec


def put(cache: PageRadixCache, group: str, tokens: list[int], salt: str | None = None):
    """Compute `tokens` as a request would: allocate, insert under the root, lock."""
    keys = block_keys(tokens, BS, salt)
    pages = cache.allocate(len(keys))
    assert pages is not None
    result = cache.insert(cache.root(group), keys, tokens, pages, salt)
    cache.lock(result.node)
    cache.check()
    return result


def test_match_insert_and_what_was_cached_meanwhile() -> None:
    cache, rec = make()
    tokens = list(range(12))
    first = put(cache, "g", tokens)
    assert first.inserted == 3 and cache.stats().protected_pages == 3
    keys = block_keys(tokens, BS)
    assert rec.stored == [("g", None, keys, tokens, None)]
    # a second request computed the same blocks meanwhile: its pages are freed, the tree's win
    second = put(cache, "g", tokens)
    assert second.pages == first.pages and second.node is first.node
    assert cache.stats().in_use_pages == 0 and len(rec.stored) == 1
    # match on a longer prompt stops where the tree ends; max_blocks caps it
    longer = tokens + [99] * 8
    assert cache.match("g", block_keys(longer, BS), longer, 5).pages == first.pages
    assert cache.match("g", block_keys(longer, BS), longer, 2).pages == first.pages[:2]
    # an extension continues the chain under its parent
    ext_keys = block_keys(longer, BS)[3:]
    pages = cache.allocate(2)
    assert pages is not None
    cache.insert(first.node, ext_keys, longer[12:], pages)
    assert rec.stored[-1] == ("g", keys[-1], ext_keys, longer[12:], None)
    cache.check()


def test_groups_and_salts_never_share() -> None:
    cache, rec = make()
    tokens = list(range(8))
    put(cache, "a", tokens)
    assert cache.match("b", block_keys(tokens, BS), tokens, 2).pages == []
    assert cache.match("a", block_keys(tokens, BS, "t1"), tokens, 2).pages == []
    put(cache, "a", tokens, salt="t1")
    assert rec.stored[-1][4] == "t1" and rec.stored[-1][1] is None
    assert cache.keys("a") == set(block_keys(tokens, BS)) | set(block_keys(tokens, BS, "t1"))
    assert cache.keys("b") == set()


def test_a_hash_collision_is_never_shared() -> None:
    cache, _ = make()
    put(cache, "g", [1, 2, 3, 4])
    key = block_keys([1, 2, 3, 4], BS)[0]
    assert cache.match("g", [key], [5, 6, 7, 8], 1).pages == []  # same key, other tokens
    pages = cache.allocate(1)
    assert pages is not None
    result = cache.insert(cache.root("g"), [key], [5, 6, 7, 8], pages)
    assert result.inserted == 0 and cache.stats().in_use_pages == 1  # still the caller's
    cache.free(pages)
    cache.check()


def test_eviction_frees_only_the_shortfall_oldest_leaf_first_across_groups() -> None:
    cache, rec = make(pages=9)  # 8 usable
    old = put(cache, "a", list(range(8)))  # 2 pages
    new = put(cache, "b", list(range(100, 108)))  # 2 pages
    cache.unlock(old.node)
    cache.unlock(new.node)  # both evictable; "a" less recently used
    held = cache.allocate(4)  # exactly the free pages: nothing evicted
    assert held is not None and rec.removed == []
    assert cache.allocate(5) is None  # more than free + evictable: refused, nothing evicted
    assert rec.removed == []
    one = cache.allocate(1)  # shortfall 1: the deepest block of the oldest leaf
    assert one is not None
    assert rec.removed == [("a", [block_keys(list(range(8)), BS)[1]])]
    assert cache.stats().evictable_pages == 3
    locked = cache.match("a", block_keys(list(range(8)), BS), list(range(8)), 2)
    cache.lock(locked.node)  # "a"'s remaining block is in use now: "b" goes next
    assert cache.allocate(2) is not None
    assert rec.removed[1:] == [("b", block_keys(list(range(100, 108)), BS)[::-1])]
    assert cache.allocate(1) is None  # the only cached page left is locked
    cache.check()


def test_randomized_against_a_brute_force_model() -> None:
    """Random requests over shared prefixes: the tree always holds exactly the blocks stored
    and not removed (as the events tell), and every check passes."""
    rng = random.Random(7)
    cache, rec = make(pages=24)
    bases = [[rng.randrange(50) for _ in range(24)] for _ in range(3)]
    live: list = []  # locked nodes of requests in flight
    expected: dict[str, set[int]] = {"a": set(), "b": set()}
    for _ in range(400):
        if live and (rng.random() < 0.4 or cache.stats().free_pages + cache.evictable_pages < 6):
            cache.unlock(live.pop(rng.randrange(len(live))))
        else:
            group = rng.choice("ab")
            salt = rng.choice([None, None, "s"])
            tokens = rng.choice(bases)[: rng.randrange(4, 25)] + [rng.randrange(50)] * 4
            tokens = tokens[: len(tokens) // BS * BS]
            keys = block_keys(tokens, BS, salt)
            match = cache.match(group, keys, tokens, len(keys) - 1)
            cache.lock(match.node)
            n = len(match.pages)
            pages = cache.allocate(len(keys) - n)
            if pages is None:
                cache.unlock(match.node)
            else:
                result = cache.insert(match.node, keys[n:], tokens[n * BS :], pages, salt)
                cache.lock(result.node)
                cache.unlock(match.node)
                live.append(result.node)
        for group, parent, keys, _, _ in rec.stored:
            assert parent is None or parent in expected[group]
            expected[group].update(keys)
        for group, keys in rec.removed:
            expected[group].difference_update(keys)
        rec.stored.clear()
        rec.removed.clear()
        cache.check()
        assert cache.keys("a") == expected["a"] and cache.keys("b") == expected["b"]
    assert cache.evicted_pages > 0
