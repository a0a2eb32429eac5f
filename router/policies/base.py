"""What every routing policy sees and returns (DESIGN §4).

A policy is a synchronous object with no I/O and no clock reads: the gateway and the
simulator hand it the same `RouteRequest` and `Candidate`s and get the same `Decision`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


class RouteRequest(NamedTuple):
    """The request as routing sees it: its block keys in the tenant's namespace."""

    block_keys: Sequence[int]  # chained keys of the prompt's full blocks
    prompt_tokens: int  # all prompt tokens, the partial last block included
    block_size: int
    kv_group: str
    model: str = ""


class Candidate(NamedTuple):
    """One worker that serves the request's kv_group, with what it holds and its load."""

    worker: str
    matched_blocks: int  # leading blocks of the request this worker holds (unified index)
    in_flight: int = 0  # requests sent and not finished
    queued_prefill_tokens: int = 0  # uncached prompt tokens routed to it and not yet prefilled
    running_decode: int = 0  # requests past their first token, still decoding
    cached_blocks: int = 0  # all blocks this worker holds for the kv_group (its tree size)
    stored_blocks: int = 0  # blocks it has stored so far (its cache's inflow, from KV events)


class Score(NamedTuple):
    """How a policy saw one candidate: the explanation's row."""

    worker: str
    matched_tokens: int
    load: int  # in-flight requests
    cost: float  # what the policy minimised (lower is better); meaning is per policy


class Decision(NamedTuple):
    worker: str
    reason: str  # short machine-friendly word: "cache_hit", "cold_miss", "imbalanced", ...
    scores: tuple[Score, ...]  # every candidate, in the order given

    @property
    def matched_tokens(self) -> int:
        return next(s.matched_tokens for s in self.scores if s.worker == self.worker)

    def ranked(self) -> list[str]:
        """Workers by the policy's preference, best first (the failover order)."""
        order = sorted(self.scores, key=lambda s: (s.worker != self.worker, s.cost))
        return [s.worker for s in order]


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of `candidates` (non-empty). Must not do I/O or read a clock."""
        ...
