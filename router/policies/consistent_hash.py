"""Consistent hashing of a prompt's first blocks onto a ring of worker virtual nodes; each
worker's points are hashed and sorted once, the ring of a candidate set never built."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import ClassVar, Final

import xxhash

from router.policies.base import Candidate, Decision, RouteRequest

_xxh3 = xxhash.xxh3_64_intdigest
_U64: Final = (1 << 64) - 1


class ConsistentHashPolicy:
    """Ring placement by prompt prefix. Score cost: clockwise ring distance to the worker."""

    name: ClassVar[str] = "consistent_hash"

    def __init__(self, prefix_blocks: int = 4, virtual_nodes: int = 160) -> None:
        if prefix_blocks < 1 or virtual_nodes < 1:
            raise ValueError("prefix_blocks and virtual_nodes must be at least 1")
        self.prefix_blocks = prefix_blocks
        self.virtual_nodes = virtual_nodes
        self._points: dict[str, list[int]] = {}  # worker -> its sorted ring points

    def worker_points(self, worker: str) -> list[int]:
        points = self._points.get(worker)
        if points is None:
            points = sorted(_xxh3(f"{worker}#{i}".encode()) for i in range(self.virtual_nodes))
            self._points[worker] = points
        return points

    def request_point(self, request: RouteRequest) -> int:
        keys = request.block_keys
        n = min(len(keys), self.prefix_blocks)
        return keys[n - 1] & _U64 if n else 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        point = self.request_point(request)
        chosen, nearest = "", _U64 + 1
        known = self._points
        costs: list[float] = []
        for c in candidates:
            points = known.get(c.worker) or self.worker_points(c.worker)
            j = bisect_right(points, point)
            # clockwise distance to the worker's first point after ours, wrapping past 2**64
            distance = (points[j] - point) if j < len(points) else (points[0] - point) & _U64
            if distance < nearest:
                chosen, nearest = c.worker, distance
            costs.append(float(distance))
        return Decision(chosen, "consistent_hash", request, candidates, costs)
