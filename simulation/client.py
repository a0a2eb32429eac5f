"""The load generator in virtual time: when each request is sent, by the rules of
loadgen/runner.py (open or closed loop) and loadgen/sessions.py (a session's turn waits for the
previous one; a failed turn drops the session's later turns)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Final

from simulation.requests import SimRequest

INF: Final = math.inf


class Client:
    """`next_at` says when `poll(now)` has something to send; `complete` reports ends."""

    def __init__(
        self, requests: list[SimRequest], concurrency: int | None = None, max_in_flight: int = 1024
    ) -> None:
        self.open_loop = concurrency is None
        if self.open_loop and any(r.arrival_s is None for r in requests):
            raise ValueError("an open loop needs an arrival time on every request")
        if not self.open_loop:
            assert concurrency is not None and concurrency >= 1
        self.requests = requests
        self.slots: int = max_in_flight if concurrency is None else concurrency
        self._arrival = [r.arrival_s or 0.0 for r in requests] if self.open_loop else []
        self.lookahead = max(64, 4 * self.slots)
        self.active = 0
        self.dropped = 0  # turns never sent: an earlier turn of their session failed
        self._next = 0  # the next request to arrive (open) or to pull (closed)
        self._ready: list[int] = []  # heap of request indices
        self._waiting: dict[int, deque[int]] = {}  # session -> turns held back, in order
        self._n_waiting = 0
        self._busy: set[int] = set()
        self._failed: set[int] = set()
        self.next_at = 0.0  # when `poll` has something to do next (INF: nothing until a completion)

    def poll(self, now: float) -> list[SimRequest]:
        """Add what has arrived by `now`; return what is sent at `now`."""
        requests = self.requests
        n = len(requests)
        if self.open_loop:
            arrival = self._arrival
            while self._next < n and arrival[self._next] <= now:
                self._add(self._next)
                self._next += 1
        out: list[SimRequest] = []
        while self.active < self.slots:
            if self._ready:
                out.append(requests[heapq.heappop(self._ready)])
                self.active += 1
                continue
            if self.open_loop or self._next >= n or self._n_waiting >= self.lookahead:
                break
            self._add(self._next)
            self._next += 1
        if self.open_loop and self._next < n:
            self.next_at = self._arrival[self._next]
        else:
            self.next_at = INF
        return out

    def _add(self, i: int) -> None:
        session = self.requests[i].session
        if session < 0:
            heapq.heappush(self._ready, i)
        elif session in self._failed:
            self.dropped += 1
        elif session in self._busy:
            self._waiting.setdefault(session, deque()).append(i)
            self._n_waiting += 1
        else:
            self._busy.add(session)
            heapq.heappush(self._ready, i)

    def complete(self, req: SimRequest, ok: bool, now: float) -> None:
        """`req` finished (ok) or failed at `now`."""
        self.active -= 1
        session = req.session
        if not self.open_loop or self._ready or session >= 0:
            self.next_at = now  # a slot freed: something may be sent now
        if session < 0:
            return
        queued = self._waiting.pop(session, None)
        held = len(queued) if queued else 0
        self._n_waiting -= held
        if not ok:
            self._busy.discard(session)
            self._failed.add(session)
            self.dropped += held
        elif queued:
            heapq.heappush(self._ready, queued.popleft())
            if queued:
                self._waiting[session] = queued
                self._n_waiting += len(queued)
        else:
            self._busy.discard(session)
