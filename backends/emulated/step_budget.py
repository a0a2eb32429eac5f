"""The step budget of ranked scheduling (docs/workers.md): while a better-ranked request is in
the engine (waiting, prefilling or decoding), or was within the protect window, the requests
ranked after it prefill at most `tokens` a step (`protect_step_s` of prefill), so the steps that
carry the better one stay short; better-ranked prefill is not capped. A request with the
gateway's protect hint (`Request.protect`: that rank is active elsewhere in its pool) counts as
one of the hinted rank, so a worker keeps its steps short before the better one reaches it.
With every request at one priority and no hint nothing is capped: full chunks, the throughput
unchanged."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from backends.emulated.request import Request, floor


class StepBudget:
    """Which priority is protected, until when, and what the worse-ranked may still prefill in
    the step being planned (a plain class: compiled, it is native)."""

    __slots__ = ("tokens", "window_s", "level", "until", "left")

    def __init__(self, tokens: int, window_s: float) -> None:
        self.tokens = tokens  # prefill tokens a step for requests ranked after `level`; 0: off
        self.window_s = window_s
        self.level = 0  # the protected priority: a request with a higher one is capped
        self.until = -math.inf  # protecting until then; renewed while the level is present
        self.left = -1  # of `tokens`, in the step being planned; -1: no cap in it

    def protecting(self, now: float) -> bool:
        return now < self.until

    def plan(self, ranked: Sequence[Request], decoding: Iterable[Request], now: float) -> None:
        """A step is planned `now` over `ranked` (the waiting and prefilling requests, best
        first) and the `decoding` ones. The best rank present (a priority, or a hint's:
        `floor`) becomes the level when it ranks ahead of it or the window ran out; while one at
        the level is present among non-zero priorities, the window is renewed."""
        self.left = -1
        if not self.tokens:
            return
        best: int | None = None
        for present in (ranked, decoding):
            for req in present:
                rank = floor(req)
                if best is None or rank < best:
                    best = rank
        if best is None:
            return  # nothing here: the window runs out
        worst = ranked[-1].priority if ranked else best
        if best < self.level or now >= self.until:
            self.level = best
        if best <= self.level and (best or worst):
            self.until = now + self.window_s
        if now < self.until:
            self.left = self.tokens

    def limit(self, priority: int, budget: int) -> int:
        """The most a request of `priority` may prefill in this step, of the step's `budget`."""
        if self.left < 0 or priority <= self.level:
            return budget
        return min(budget, self.left)

    def spend(self, priority: int, n: int) -> int:
        """A request of `priority` was given `n` tokens in this step; returns `n`."""
        if self.left >= 0 and priority > self.level:
            self.left -= n
        return n
