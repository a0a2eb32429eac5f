"""The radix cache's integrity check: tests run it after every step, the engines in theirs."""

from __future__ import annotations

from backends.cache.nodes import Run, Tree
from backends.cache.radix import RadixCache


def check(cache: RadixCache) -> set[int]:
    """Assert the invariants (token states, counts, keys, the LRU list, pages); returns the
    pages in the trees (empty when the cache is not paged)."""
    assert cache.free_tokens >= 0 and cache.allocated_tokens >= 0
    assert (
        cache.free_tokens + cache.evictable_tokens + cache.protected_tokens + cache.allocated_tokens
        == cache.capacity_tokens
    ), "free + evictable + protected + allocated != capacity"
    listed = _listed(cache)
    evictable = protected = blocks = 0
    pages: list[int] = []
    for tree in cache.trees.values():
        e, p, tree_blocks = _check_tree(cache, tree, listed, pages)
        evictable, protected, blocks = evictable + e, protected + p, blocks + tree_blocks
    assert blocks == len(cache), "blocks count"
    assert evictable == cache.evictable_tokens, "evictable count"
    assert protected == cache.protected_tokens, "protected count"
    free = cache.page_ids
    if free is None:
        return set()
    in_tree = set(pages)
    bs = cache.block_size
    assert len(free) * bs == cache.free_tokens and len(set(free)) == len(free), "free pages"
    assert len(in_tree) == len(pages) and not in_tree & set(free), "a page in two places"
    return in_tree


def _listed(cache: RadixCache) -> set[int]:
    """The ids of the runs on the LRU list, which must be in strict stamp order."""
    listed: set[int] = set()
    lru = cache._lru
    at = lru.next
    stamp = -1
    while at is not lru:
        assert at is not None and id(at) not in listed, "LRU list loops"
        assert at.stamp > stamp, "LRU list out of stamp order"
        assert at.alive and at.children == 0 and at.lock_ref == 0, "listed, not a leaf"
        assert at.next is not None and at.next.prev is at, "LRU links"
        listed.add(id(at))
        stamp = at.stamp
        at = at.next
    return listed


def _check_tree(
    cache: RadixCache, tree: Tree, listed: set[int], pages: list[int]
) -> tuple[int, int, int]:
    """One tree's links and counts; returns its evictable and protected tokens and blocks."""
    bs = cache.block_size
    children: dict[Run, int] = {}
    locks: dict[Run, int] = {}
    evictable = protected = blocks = 0
    for run in tree.runs:
        assert run.alive and run.keys and run.tree is tree, "dead, empty or stray run listed"
        assert tree.heads[run.keys[0]] is run, "head map out of step"
        parent = run.parent
        assert parent is not None and (parent is tree.root or parent in tree.runs)
        children[parent] = children.get(parent, 0) + 1
        locks[parent] = locks.get(parent, 0) + run.lock_ref
        blocks += len(run.keys)
        if run.lock_ref:
            protected += len(run.keys) * bs
        else:
            evictable += len(run.keys) * bs
        if cache.page_ids is not None:
            assert run.pages is not None and len(run.pages) == len(run.keys), "pages of a run"
            pages.extend(run.pages)
        if cache.keep_tokens:
            assert run.tokens is not None and len(run.tokens) == len(run.keys) * bs, "tokens"
    assert blocks == tree.blocks and len(tree.heads) == len(tree.runs), "stray heads"
    for run in tree.runs:
        assert run.children == children.get(run, 0), "children count"
        assert run.lock_ref >= locks.get(run, 0), "a locked run under an unlocked one"
        evictable_leaf = run.children == 0 and run.lock_ref == 0
        assert evictable_leaf == (id(run) in listed), "LRU list != unlocked leaves"
    assert tree.root.children == children.get(tree.root, 0), "root children count"
    return evictable, protected, blocks


def check_locks(cache: RadixCache, holders: list[Run]) -> None:
    """Lock counts are exactly the paths that `holders` (one locked node per holder) lock."""
    expected: dict[int, int] = {}
    for node in holders:
        while node.parent is not None:
            expected[id(node)] = expected.get(id(node), 0) + 1
            node = node.parent
    for tree in cache.trees.values():
        for run in tree.runs:
            assert run.lock_ref == expected.get(id(run), 0), "lock counts != the holders' paths"
