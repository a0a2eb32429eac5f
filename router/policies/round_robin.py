"""Round robin over worker names, not positions: a worker leaving or joining does not make the
others skip or repeat a turn."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import ClassVar, Final

from router.policies.base import Candidate, Decision, RouteRequest

_MAX_CACHED_SETS: Final = 256


class RoundRobinPolicy:
    """Cycle through the candidates by name. Score cost: turns until that worker's."""

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None
        # candidate names as given -> (names sorted, each candidate's position in that order)
        self._orders: dict[tuple[str, ...], tuple[list[str], list[int]]] = {}

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        names = tuple([c.worker for c in candidates])
        order = self._orders.get(names)
        if order is None:
            if len(self._orders) >= _MAX_CACHED_SETS:
                self._orders.clear()
            ring = sorted(names)
            position = {w: i for i, w in enumerate(ring)}
            order = self._orders[names] = (ring, [position[w] for w in names])
        ring, positions = order
        n = len(ring)
        # the next name after the last one chosen (which may have left the ring)
        start = 0 if self._last is None else bisect_right(ring, self._last) % n
        self._last = ring[start]
        costs = [float((p - start) % n) for p in positions]
        return Decision(ring[start], "round_robin", request, candidates, costs)
