"""The routing step of a request: tokenize -> block keys -> match -> policy.

Synchronous and free of I/O: the HTTP handler parses and checks the body (request_body.py),
calls `Router.plan` and then forwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import msgspec

from core.blocks import block_keys
from router.gateway.errors import APIError, bad_request, unavailable
from router.gateway.fleet import Fleet, Model, Worker
from router.gateway.isolation import leading_system, public_tokens
from router.index import UnifiedIndex
from router.policies import Candidate, Decision, Policy, RouteRequest


class Plan(NamedTuple):
    model: Model
    keys: list[int]
    prompt_tokens: int
    decision: Decision
    workers: list[Worker]  # the candidates, in the order the policy saw them
    matched_blocks: dict[str, int]  # leading blocks each candidate holds (from the index)
    decision_s: float
    arrived: float  # time.monotonic() when routing began
    request: RouteRequest  # what the policy saw (shadow policies see the same)
    candidates: list[Candidate]
    policy: str  # the policy that decided
    public_tokens: int = 0  # shared isolation: leading tokens keyed in the shared namespace

    def matched(self, worker: str) -> int:
        """Tokens of the prompt `worker` will find cached, as the index says: its full blocks,
        less the last one when it holds the whole prompt (vLLM, SGLang and our workers compute
        at least the last prompt token)."""
        bs = self.model.block_size
        usable = max(self.prompt_tokens - 1, 0) // bs
        return min(self.matched_blocks.get(worker, 0), usable) * bs

    def load_matched(self, worker: str, index: UnifiedIndex) -> int:
        """`matched`, less what the worker holds only pending (another request's prefix, maybe
        not computed when this one starts): the tokens its queued load takes as cached."""
        blocks = self.matched(worker) // self.model.block_size
        held = index.confirmed_depth(self.keys, worker, self.request.kv_group, blocks)
        return held * self.model.block_size

    def ranked(self) -> Iterator[Worker]:
        """The chosen worker, then (only if asked for: failover) the rest by the policy's cost."""
        chosen = self.decision.worker
        by_name = {w.name: w for w in self.workers}
        yield by_name[chosen]
        for name in self.decision.ranked()[1:]:
            yield by_name[name]


SYSTEM_RENDERS = 1024  # shared isolation: distinct system prompts whose render is kept
_json = msgspec.json.Encoder(order="sorted")


class Router:
    def __init__(self, fleet: Fleet, index: UnifiedIndex, policy: Policy) -> None:
        self.fleet = fleet
        self.index = index
        self.policy = policy
        # (tokenizer, the system messages and tools as JSON) -> their render alone: in shared
        # mode the same few system prompts come back on every request (oldest dropped first)
        self._system_renders: dict[tuple[object, bytes], Sequence[int]] = {}

    def tokens(self, model: Model, body: dict[str, Any], chat: bool) -> Sequence[int]:
        try:
            if chat:
                return model.tokenizer.encode_chat(body["messages"], body.get("tools"))
            prompt = body["prompt"]
            return model.tokenizer.prompt_ids(prompt) if isinstance(prompt, str) else prompt
        except ValueError as exc:
            raise bad_request(str(exc), "messages" if chat else "prompt") from None

    def public_tokens(self, model: Model, body: dict[str, Any], tokens: Sequence[int]) -> int:
        """Shared isolation: the whole blocks of the leading system prompt."""
        system = leading_system(body["messages"])
        if not system:
            return 0
        key = (model.tokenizer, _json.encode([system, body.get("tools")]))
        rendered = self._system_renders.get(key)
        if rendered is None:
            rendered = self.tokens(model, {**body, "messages": system}, True)
            if len(self._system_renders) >= SYSTEM_RENDERS:
                del self._system_renders[next(iter(self._system_renders))]
            self._system_renders[key] = rendered
        return public_tokens(tokens, rendered, model.block_size)

    def plan(
        self,
        body: dict[str, Any],
        chat: bool,
        salt: str | None,
        policy: Policy | None = None,
        public: bool = False,
    ) -> Plan:
        arrived = time.monotonic()
        t0 = time.perf_counter()
        name = body["model"]
        model = self.fleet.model(name)
        if model is None:
            raise APIError(
                404, f"The model '{name}' does not exist", param="model", code="model_not_found"
            )
        workers = self.fleet.candidates(model.kv_group)
        if not workers:
            raise unavailable(f"no healthy worker serves model '{name}'")
        tokens = self.tokens(model, body, chat)
        public_tokens = self.public_tokens(model, body, tokens) if public and chat and salt else 0
        public_blocks = public_tokens // model.block_size
        keys = block_keys(tokens, model.block_size, salt, public_blocks)
        if salt and len(keys) > public_blocks:  # where scoped invalidation finds the namespace
            self.index.tag_namespace(keys[public_blocks], salt)
        group = model.kv_group
        matched_blocks = self.index.match(keys, group, arrived)
        index = self.index
        candidates = [
            Candidate(
                w.name,
                matched_blocks.get(w.name, 0),
                w.in_flight,
                w.queued_prefill_tokens,
                w.running_decode,
                index.blocks_held(w.name, group),
                index.blocks_stored(w.name, group),
            )
            for w in workers
        ]
        request = RouteRequest(keys, len(tokens), model.block_size, group, name)
        policy = policy or self.policy
        decision = policy.choose(request, candidates)
        decision_s = time.perf_counter() - t0
        return Plan(
            model,
            keys,
            len(tokens),
            decision,
            workers,
            matched_blocks,
            decision_s,
            arrived,
            request,
            candidates,
            policy.name,
            public_tokens,
        )
