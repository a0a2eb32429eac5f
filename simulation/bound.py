"""The bound of one infinite cache: every request on one worker that never evicts.

Requests in their order; each reuses the longest prefix of its block keys seen before (at most
all but its last token, as the engine computes at least one), then leaves its prompt and output
blocks behind. No fleet, capacity or timing can reuse more, so it is the ceiling a policy's hit
rate is read against.
"""

from __future__ import annotations

from collections.abc import Iterable

from simulation.requests import SimRequest


def infinite_cache_hit_rate(requests: Iterable[SimRequest]) -> float | None:
    """Cached / prompt tokens with one infinite cache; None without prompt tokens."""
    seen: set[int] = set()
    prompt = cached = 0
    for req in requests:
        keys = req.keys
        n = len(req.prompt)
        bs = req.route.block_size
        cap = min(len(keys), (n - 1) // bs)
        hit = 0
        while hit < cap and keys[hit] in seen:  # chained: a held key holds its whole prefix
            hit += 1
        prompt += n
        cached += hit * bs
        seen.update(keys)
        seen.update(req.tail_keys)
    return cached / prompt if prompt else None
