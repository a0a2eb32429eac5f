"""Scoped invalidation of the unified index (docs/index.md): an operator's call, never the
request path, so it lives beside the index rather than in its hot module."""

from __future__ import annotations

from collections.abc import Callable

from router.index import UnifiedIndex

SaltTest = Callable[[str], bool]


def invalidate(index: UnifiedIndex, scope: SaltTest | None, kv_group: str | None = None) -> int:
    """Drop every resident's hold on the blocks of the namespaces `scope` matches (None: every
    block) in `kv_group` (None: every group). Returns the block residencies dropped."""
    doomed = index.runs_in(scope)
    if scope is not None and kv_group is None:  # gone from every group: the tags go too
        for key in [k for k, salt in index.namespaces.items() if scope(salt)]:
            del index.namespaces[key]
    return index.release(doomed, kv_group)
