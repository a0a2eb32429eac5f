"""What every routing policy sees and returns (docs/policies.md): dataclasses with a written-out
`__init__`, built and read natively once compiled (docs/compiled.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(init=False, slots=True)
class RouteRequest:
    """The request as routing sees it: its block keys in the tenant's namespace."""

    block_keys: Sequence[int]  # chained keys of the prompt's full blocks
    prompt_tokens: int  # all prompt tokens, the partial last block included
    block_size: int
    kv_group: str
    model: str
    adapter: str  # the LoRA adapter it names ("": a base model), docs/adapters.md

    def __init__(
        self,
        block_keys: Sequence[int],
        prompt_tokens: int,
        block_size: int,
        kv_group: str,
        model: str = "",
        adapter: str = "",
    ) -> None:
        self.block_keys = block_keys
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size
        self.kv_group = kv_group
        self.model = model
        self.adapter = adapter

    def matched_tokens(self, blocks: int) -> int:
        """The prompt tokens a worker holding its first `blocks` blocks can reuse: whole
        blocks, less the last one of a prompt it holds whole (docs/dispatch.md says why)."""
        usable = (self.prompt_tokens - 1) // self.block_size  # the last token is computed
        if blocks > usable:
            blocks = usable
        return blocks * self.block_size if blocks > 0 else 0

    def host_tokens(self, matched_blocks: int, host_blocks: int) -> int:
        """Of `matched_tokens(matched_blocks + host_blocks)`, those in the host tier: the
        `host_blocks` a worker holds there right after its GPU match (docs/tiers.md)."""
        if not host_blocks:
            return 0
        both = self.matched_tokens(matched_blocks + host_blocks)
        return both - self.matched_tokens(matched_blocks)


@dataclass(init=False, slots=True)
class WorkerLoad:
    """A worker's load as the gateway sees it, moved only by router/route.py's `LoadShare`."""

    worker: str
    in_flight: int  # requests sent and not finished
    queued_prefill_tokens: int  # uncached prompt tokens routed to it and not yet prefilled
    running_decode: int  # requests past their first token, still decoding

    def __init__(
        self,
        worker: str,
        in_flight: int = 0,
        queued_prefill_tokens: int = 0,
        running_decode: int = 0,
    ) -> None:
        self.worker = worker
        self.in_flight = in_flight
        self.queued_prefill_tokens = queued_prefill_tokens
        self.running_decode = running_decode


@dataclass(init=False, slots=True)
class Candidate(WorkerLoad):
    """A worker of the request's kv_group: a copy of its load when the request came, its cache."""

    matched_blocks: int  # leading blocks of the request this worker holds (unified index)
    cached_blocks: int  # all blocks this worker holds for the kv_group (its tree size)
    stored_blocks: int  # blocks it has stored so far (its cache's inflow, from KV events)
    host_blocks: int  # blocks right after matched_blocks it holds in its host tier (docs/tiers.md)
    adapter_s: float  # an adapter request's load + eviction price here (router/adapters.py)

    def __init__(
        self,
        worker: str,
        matched_blocks: int,
        in_flight: int = 0,
        queued_prefill_tokens: int = 0,
        running_decode: int = 0,
        cached_blocks: int = 0,
        stored_blocks: int = 0,
        host_blocks: int = 0,
        adapter_s: float = 0.0,
    ) -> None:
        self.worker = worker
        self.matched_blocks = matched_blocks
        self.in_flight = in_flight
        self.queued_prefill_tokens = queued_prefill_tokens
        self.running_decode = running_decode
        self.cached_blocks = cached_blocks
        self.stored_blocks = stored_blocks
        self.host_blocks = host_blocks
        self.adapter_s = adapter_s


@dataclass(init=False, slots=True)
class Score:
    """How a policy saw one candidate: the explanation's row."""

    worker: str
    matched_tokens: int  # in either tier (the prediction of the worker's cached tokens)
    load: int  # in-flight requests
    cost: float  # what the policy minimised (lower is better); meaning is per policy
    host_tokens: int  # of matched_tokens, those in the host tier (docs/tiers.md)

    def __init__(
        self, worker: str, matched_tokens: int, load: int, cost: float, host_tokens: int = 0
    ) -> None:
        self.worker = worker
        self.matched_tokens = matched_tokens
        self.load = load
        self.cost = cost
        self.host_tokens = host_tokens


@dataclass(init=False, slots=True)
class Decision:
    """A policy's choice, and what it minimised over the candidates (`costs`). The explanation
    (`scores`) is built from them when read: routing reads only `worker` and `reason`."""

    worker: str
    reason: str  # short machine-friendly word: "cache_hit", "cold_miss", "imbalanced", ...
    request: RouteRequest
    candidates: Sequence[Candidate]
    costs: list[float]  # per candidate, in the order given (lower is better; meaning per policy)

    def __init__(
        self,
        worker: str,
        reason: str,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        costs: list[float],
    ) -> None:
        self.worker = worker
        self.reason = reason
        self.request = request
        self.candidates = candidates
        self.costs = costs

    @property
    def scores(self) -> tuple[Score, ...]:
        """How the policy saw every candidate, in the order given: the explanation's rows."""
        request = self.request
        scores: list[Score] = []
        for c, cost in zip(self.candidates, self.costs, strict=True):
            matched = request.matched_tokens(c.matched_blocks + c.host_blocks)
            host = request.host_tokens(c.matched_blocks, c.host_blocks)
            scores.append(Score(c.worker, matched, c.in_flight, cost, host))
        return tuple(scores)

    @property
    def matched_tokens(self) -> int:
        """Prompt tokens the chosen worker holds, in either tier (shadow policies read it on
        every request)."""
        for c in self.candidates:
            if c.worker == self.worker:
                return self.request.matched_tokens(c.matched_blocks + c.host_blocks)
        raise ValueError(f"{self.worker!r} is not a candidate")

    def ranked(self) -> list[str]:
        """Workers by the policy's preference, best first (the failover order)."""
        order = sorted(self.scores, key=lambda s: (s.worker != self.worker, s.cost))
        return [s.worker for s in order]


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of `candidates` (non-empty). Must not do I/O or read a clock."""
        ...
