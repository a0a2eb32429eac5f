"""The protect hint (docs/flow-control.md, step 6): which better rank a worker must keep its
steps short for before a request of that rank reaches it. A worker's step budget protects a
better-ranked request while it is there and for `--protect-window-ms` after; what it cannot see
is a rank that is about to come back. The gateway can: it remembers, per worker, the best engine
priority each flow was sent at, and a request ranked after another flow's recent one carries
that rank to the worker (`x-urc-protect`). Flows, not priorities alone: a flow's own earlier
requests at a better rank (before it was ahead of its share) protect nothing against it."""

from __future__ import annotations

import math


class _Rank:
    """One engine priority at one worker: the flow last sent at it, when, and the latest time
    another flow was."""

    __slots__ = ("flow", "at", "other")

    def __init__(self, flow: str, at: float) -> None:
        self.flow = flow
        self.at = at
        self.other = -math.inf


class RankGuard:
    """One worker's (of one pool) recent ranks, by engine priority."""

    __slots__ = ("ranks",)

    def __init__(self) -> None:
        self.ranks: dict[int, _Rank] = {}

    def note(self, flow: str, priority: int, now: float, window_s: float) -> int | None:
        """A request of `flow` is sent `now` at `priority`: the best better rank another flow
        was sent at within `window_s` (None: none), which its worker must protect."""
        ranks = self.ranks
        here = ranks.get(priority)
        hint: int | None = None
        if here is None or len(ranks) > 1:  # else its rank is the only one: none better
            since = now - window_s
            for rank, seen in ranks.items():
                recent = (seen.flow != flow and seen.at > since) or seen.other > since
                if recent and rank < priority and (hint is None or rank < hint):
                    hint = rank
        if here is None:
            ranks[priority] = _Rank(flow, now)
        else:
            if here.flow != flow:
                here.other = here.at
                here.flow = flow
            here.at = now
        return hint
