"""The runs of a namespace scope in a tree of block runs, for the index and our workers'
caches alike (scoped invalidation: docs/isolation.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar


class _Run(Protocol):
    keys: list[int]
    parent: Any


R = TypeVar("R", bound=_Run)


def runs_in_scope(
    find: Callable[[int], R | None],
    namespaces: dict[int, str],
    split: Callable[[R, int], object],
    runs: Iterable[R],
    scope: Callable[[str], bool],
    root: R | None = None,
) -> list[R]:
    """Every run in a namespace (`namespaces`: its first key -> its salt) whose salt passes
    `scope`. `find(key)`: the run holding `key`; `split(run, at)` cuts `run` so that it keeps
    its keys from `at` on; `root`: a sentinel run that is never in a scope."""
    tops: set[R] = set()
    for key, salt in namespaces.items():
        run = find(key)
        if run is None or not scope(salt):
            continue
        if run.keys[0] != key:
            split(run, run.keys.index(key))  # `run` keeps the keys from `key` on
        tops.add(run)
    if not tops:
        return []
    verdict: dict[R, bool] = dict.fromkeys(tops, True)
    if root is not None:
        verdict[root] = False
    found: list[R] = []
    for run in runs:
        path: list[R] = []
        cur: R | None = run
        while cur is not None and cur not in verdict:
            path.append(cur)
            cur = cur.parent
        inside = cur is not None and verdict[cur]
        for r in path:
            verdict[r] = inside
        if inside:
            found.append(run)
    return found
