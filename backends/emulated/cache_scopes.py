"""Scoped invalidation of the emulated worker's radix cache (an operator's call).

A namespace starts at a key the cache noted on insert (`RadixCache.namespaces`): a salted root
block, or the first private block after a public prefix; every block below it is in it. The
runs of the matching namespaces (all runs when the scope is everything) go at once:

    unlocked   freed now: their tokens go back to the pool, BlockRemoved is announced
    locked     re-keyed below zero, so no request can match them and nothing is cached under
               them; they stay protected while locked and are evicted like any leaf after.
               BlockRemoved is announced now for their real keys.

Locks walk to the root, so the unlocked runs of a subtree are whole subtrees themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from backends.emulated.radix_cache import RadixCache
from core.scopes import runs_in_scope

SaltTest = Callable[[str], bool]


class Invalidated(NamedTuple):
    freed_blocks: int  # back in the free pool now
    locked_blocks: int  # in use by running requests: unmatchable now, freed once released


def invalidate(cache: RadixCache, scope: SaltTest | None) -> Invalidated:
    """Drop the blocks of the namespaces `scope` matches (None: every block)."""
    if scope is None:
        doomed = list(cache._runs)
        cache.namespaces.clear()
    else:
        doomed = runs_in_scope(  # a namespace's key starts a run (radix_cache.py)
            cache._heads.get, cache.namespaces, cache._split, cache._runs, scope, cache.root
        )
        for key in [k for k, s in cache.namespaces.items() if scope(s)]:
            del cache.namespaces[key]
    heads = cache._heads
    bs = cache.block_size
    removed: list[int] = []
    freed = locked = 0
    for run in doomed:
        removed.extend(run.keys)
        del heads[run.keys[0]]
        if run.lock_ref:
            locked += len(run.keys)
            tombstones = list(range(cache.next_tombstone, cache.next_tombstone - len(run.keys), -1))
            cache.next_tombstone -= len(run.keys)
            run.keys = tombstones
            heads[tombstones[0]] = run
            continue
        freed += len(run.keys)
        if run.prev is not None:  # an unlocked leaf
            cache._unlink(run)
        cache._blocks -= len(run.keys)
        cache.evictable_tokens -= len(run.keys) * bs
        cache.free_tokens += len(run.keys) * bs
        run.alive = False
        run.keys = []
        cache._runs.discard(run)
        parent = run.parent
        assert parent is not None
        parent.children -= 1
    for run in doomed:  # parents left without children become evictable leaves
        parent = run.parent
        if (
            parent is not None
            and parent is not cache.root
            and parent.alive
            and parent.children == 0
            and parent.lock_ref == 0
            and parent.prev is None
        ):
            cache._link_by_stamp(parent)
    cache.evicted_blocks += freed
    if cache.on_removed is not None and removed:
        cache.on_removed(removed)
    return Invalidated(freed, locked)
