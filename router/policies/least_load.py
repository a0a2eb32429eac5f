"""Load-only baselines (load: in-flight requests, as in SGLang's router; prefixes ignored)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import Candidate, Decision, RouteRequest


def _loads(candidates: Sequence[Candidate]) -> list[float]:
    return [float(c.in_flight) for c in candidates]


class LeastLoadPolicy:
    """Fewest requests in flight; ties by fewer queued prefill tokens, then by name."""

    name: ClassVar[str] = "least_load"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        best = candidates[0]
        for c in candidates:
            if c.in_flight != best.in_flight:
                better = c.in_flight < best.in_flight
            elif c.queued_prefill_tokens != best.queued_prefill_tokens:
                better = c.queued_prefill_tokens < best.queued_prefill_tokens
            else:
                better = c.worker < best.worker
            if better:
                best = c
        return Decision(best.worker, "least_load", request, candidates, _loads(candidates))


class PowerOfTwoPolicy:
    """Sample two distinct candidates with the instance's RNG; keep the one with fewer in flight,
    the first on a tie (SGLang's `power_of_two`: `load1 <= load2`)."""

    name: ClassVar[str] = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)  # the object, not its bound method: deepcopy copies it

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        n = len(candidates)
        if n == 1:
            chosen = candidates[0]
        else:
            first = int(self._rng.random() * n)
            second = int(self._rng.random() * (n - 1))
            if second >= first:  # distinct from the first sample, uniform over the rest
                second += 1
            a, b = candidates[first], candidates[second]
            chosen = a if a.in_flight <= b.in_flight else b
        return Decision(chosen.worker, "power_of_two", request, candidates, _loads(candidates))
