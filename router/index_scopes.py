"""Scoped invalidation of the unified index (docs/index.md): an operator's call, never the
request path, so it lives beside the index rather than in its hot module."""

from __future__ import annotations

from collections.abc import Callable

from core.scopes import runs_in_scope
from router.index import UnifiedIndex
from router.residency import _bits

SaltTest = Callable[[str], bool]


def invalidate(index: UnifiedIndex, scope: SaltTest | None, kv_group: str | None = None) -> int:
    """Drop every resident's hold on the blocks of the namespaces `scope` matches (None: every
    block) in `kv_group` (None: every group). Returns the block residencies dropped."""
    if kv_group is None:
        mask = sum(1 << bit for groups in index._bit_of.values() for bit in groups.values())
    else:
        mask = index._group_mask.get(kv_group, 0)
    if scope is None:
        doomed = list(index._runs.values())
    else:
        doomed = runs_in_scope(
            index.run_of, index.namespaces, index._split, index._runs.values(), scope
        )
        if kv_group is None:
            for key in [k for k, s in index.namespaces.items() if scope(s)]:
                del index.namespaces[key]
    dropped, touched = index._release_runs(doomed, mask)
    for bit in _bits(touched):
        if index._resident_of[bit] is not None and index._held[bit] == 0:
            index._forget(bit)
    return dropped
