"""Scoped invalidation of the radix cache (radix.py; docs/isolation.md): unlocked runs of the
scope are freed now; locked ones are re-keyed below zero, unmatchable, and evicted like any leaf
once released. BlockRemoved is announced at once for all. The torch worker calls it on the
thread that owns its engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from backends.cache.host import HostTier
from backends.cache.nodes import Tree
from backends.cache.radix import RadixCache
from core.scopes import runs_in_scope

SaltTest = Callable[[str], bool]


class Invalidated(NamedTuple):
    freed_blocks: int  # back in the free pool now
    locked_blocks: int  # in use by running requests: unmatchable now, freed once released


def invalidate(
    cache: RadixCache, scope: SaltTest | None, kv_group: str | None = None
) -> Invalidated:
    """Drop the blocks of the namespaces `scope` matches (None: every block) in `kv_group`'s
    tree (None: every tree)."""
    freed = locked = 0
    for tree in list(cache.trees.values()):
        if kv_group is None or tree.kv_group == kv_group:
            done = _drop(cache, tree, scope)
            freed += done.freed_blocks
            locked += done.locked_blocks
    if kv_group is None or list(cache.trees) == [kv_group]:  # else other trees keep theirs
        notes = cache.namespaces
        for key in [k for k, s in notes.items() if scope is None or scope(s)]:
            del notes[key]
    return Invalidated(freed, locked)


def invalidate_tiers(
    cache: RadixCache, host: HostTier | None, scope: SaltTest | None, kv_group: str | None = None
) -> Invalidated:
    """`invalidate` of the cache and of the host tier under it (None: none); `freed_blocks`
    counts both tiers'."""
    done = invalidate(cache, scope, kv_group)
    hosted = 0 if host is None else host.invalidate(scope, kv_group)
    return Invalidated(done.freed_blocks + hosted, done.locked_blocks)


def _drop(cache: RadixCache, tree: Tree, scope: SaltTest | None) -> Invalidated:
    if scope is None:
        doomed = list(tree.runs)
    else:  # a namespace's key starts a run (radix.py)
        doomed = runs_in_scope(
            tree.heads.get, cache.namespaces, cache._split, tree.runs, scope, tree.root
        )
    doomed = [run for run in doomed if run.keys[0] >= 0]  # not those invalidated already
    heads = tree.heads
    removed: list[int] = []
    freed = locked = 0
    for run in doomed:
        removed.extend(run.keys)
        if run.lock_ref:
            n = len(run.keys)
            locked += n
            del heads[run.keys[0]]
            run.keys = list(range(cache.next_tombstone, cache.next_tombstone - n, -1))
            cache.next_tombstone -= n
            heads[run.keys[0]] = run
        else:
            freed += len(run.keys)
            cache._cut_tail(run, len(run.keys))
    for run in doomed:  # parents left without children become evictable leaves
        if run.parent is not None:
            cache._relist(run.parent)
    cache.evicted_blocks += freed
    if cache.on_removed is not None and removed:
        cache.on_removed(tree.kv_group, removed)
    return Invalidated(freed, locked)
