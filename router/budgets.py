"""A tenant's budgets (docs/flow-control.md, "Budgets"): requests per minute, tokens per minute
(input and output) and requests in flight. Minutes are sliding windows, not buckets, so a tenant
never gets more than its budget in any 60 seconds; tokens are reserved on admission (the prompt
and the expected output) and settled on the usage the worker reports. Pure: the caller's clock."""

from __future__ import annotations

from collections import deque
from typing import Final

WINDOW_S: Final = 60.0


class Grant:
    """One admitted request's entry in its tenant's window: its tokens, settled when it ends."""

    __slots__ = ("at", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.at = at
        self.tokens = tokens


class Budget:
    """One tenant's limits (0: none) and what its last minute used. `share`: this process's part
    of the tenant's budget (1/N of a budget split across N gateway processes)."""

    __slots__ = ("rpm", "tpm", "max_concurrent", "windowed", "grants", "tokens", "in_flight")

    def __init__(self, rpm: int, tpm: int, max_concurrent: int, share: float = 1.0) -> None:
        self.rpm = max(1, int(rpm * share)) if rpm else 0  # a budget split never reads "none"
        self.tpm = max(1, int(tpm * share)) if tpm else 0
        self.max_concurrent = max(1, int(max_concurrent * share)) if max_concurrent else 0
        self.windowed = bool(self.rpm or self.tpm)  # else no window is kept: nothing reads it
        self.grants: deque[Grant] = deque()  # the last minute's, oldest first
        self.tokens = 0  # their tokens
        self.in_flight = 0

    def _slide(self, now: float) -> None:
        grants = self.grants
        while grants and grants[0].at <= now - WINDOW_S:
            self.tokens -= grants.popleft().tokens

    def refusal(self, tokens: int, now: float) -> tuple[str, float] | None:
        """Why a request of `tokens` must wait (the limit's name, seconds until it fits), None
        when it fits now. A request larger than the whole token budget fits an empty window."""
        if self.max_concurrent and self.in_flight >= self.max_concurrent:
            return "concurrency", 1.0
        if not self.windowed:
            return None
        self._slide(now)
        grants = self.grants
        if self.rpm and len(grants) >= self.rpm:
            return "requests_per_minute", grants[len(grants) - self.rpm].at + WINDOW_S - now
        if self.tpm and self.tokens + tokens > self.tpm and grants:
            excess = self.tokens + tokens - self.tpm  # the oldest grants that must leave first
            for grant in grants:
                excess -= grant.tokens
                if excess <= 0:
                    return "tokens_per_minute", grant.at + WINDOW_S - now
            return "tokens_per_minute", grants[-1].at + WINDOW_S - now
        return None

    def grant(self, tokens: int, now: float) -> Grant:
        """Admit a request of `tokens` (reserved): it counts from now."""
        entry = Grant(now, tokens)
        self.in_flight += 1
        if self.windowed:
            self.grants.append(entry)
            self.tokens += tokens
        return entry

    def settle(self, grant: Grant, tokens: int, now: float) -> None:
        """The request ended having used `tokens` (its reservation is corrected, if still in
        the window); it is no longer in flight."""
        self.in_flight -= 1
        if not self.windowed:
            return  # the grant is in no window: nothing to correct
        self._slide(now)
        if grant.at > now - WINDOW_S:  # still in the window: its tokens count as used
            self.tokens += tokens - grant.tokens
        grant.tokens = tokens

    def remaining(self, now: float) -> tuple[int, int]:
        """(requests, tokens) left in the current window (-1: no such limit)."""
        self._slide(now)
        requests = max(0, self.rpm - len(self.grants)) if self.rpm else -1
        return requests, max(0, self.tpm - self.tokens) if self.tpm else -1
