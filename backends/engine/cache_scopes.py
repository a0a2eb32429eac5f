"""Scoped invalidation of the torch worker's page radix cache (an operator's call).

As in the emulated worker (backends/emulated/cache_scopes.py): a namespace starts at a key
noted on insert (`PageRadixCache.namespaces`) and holds every node below it. Matching nodes go
at once: unlocked ones give their pages back to the pool now; locked ones (a running request's
path) are re-keyed below zero, so no request matches them and nothing is cached under them,
and their pages come back through ordinary eviction once released. BlockRemoved is announced
now for every real key dropped. Must run on the thread that owns the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from backends.engine.radix_cache import Node, PageRadixCache

SaltTest = Callable[[str], bool]


class Invalidated(NamedTuple):
    freed_blocks: int  # pages back in the pool now
    locked_blocks: int  # in use by running requests: unmatchable now, freed once released


def invalidate(
    cache: PageRadixCache, scope: SaltTest | None, kv_group: str | None = None
) -> Invalidated:
    """Drop the nodes of the namespaces `scope` matches (None: every node) in `kv_group`'s
    tree (None: every tree)."""
    freed = locked = 0
    namespaces = cache.namespaces
    for group in cache.groups():
        if kv_group is not None and group != kv_group:
            continue
        doomed = _doomed(cache.root(group), scope, namespaces)
        removed: list[int] = []
        pages: list[int] = []
        parents: list[Node] = []  # of freed nodes
        for node in reversed(doomed):  # children before their parents
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            removed.append(node.key)
            if node.lock_ref:
                locked += 1
                node.key = cache.next_tombstone
                cache.next_tombstone -= 1
                parent.children[node.key] = node
                continue
            pages.append(node.page)
            parents.append(parent)
            node.parent = None  # dead: a stale heap entry or handle never matches it again
            node.heap_seq = -1
            cache.group_pages[group] -= 1
        for parent in parents:  # left childless and unlocked: an evictable leaf now
            alive = parent.parent is not None and parent.key in parent.parent.children
            if alive and not parent.children and parent.lock_ref == 0:
                cache._push(parent)
        cache.evictable_pages -= len(pages)
        cache.pool.give_back(pages)
        freed += len(pages)
        if removed and cache.on_removed is not None:
            cache.on_removed(group, removed)
    if scope is None:
        namespaces.clear()
    else:
        for key in [k for k, s in namespaces.items() if scope(s)]:
            del namespaces[key]
    return Invalidated(freed, locked)


def _doomed(root: Node, scope: SaltTest | None, namespaces: dict[int, str]) -> list[Node]:
    """The nodes in matching namespaces, parents before children."""
    out: list[Node] = []
    stack: list[tuple[Node, bool]] = [(child, scope is None) for child in root.children.values()]
    while stack:
        node, inside = stack.pop()
        if not inside and node.key in namespaces:
            inside = scope is not None and scope(namespaces[node.key])
        if inside:
            out.append(node)
        stack.extend((child, inside) for child in node.children.values())
    return out
