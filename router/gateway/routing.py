"""The routing step of a request (docs/dispatch.md, 1), free of I/O: tokenize -> block keys ->
the one lifecycle's route (router/route.py); an embeddings request by load alone; and the
routing modes: live or degraded (least load), shadows that only watch."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final, NamedTuple

import msgspec

from core.blocks import block_keys
from core.errors import APIError
from router.gateway.fleet import Fleet, Model
from router.gateway.isolation import leading_system, public_tokens
from router.gateway.parsing import bad_request
from router.policies import Decision, Policy, RouteRequest, make_policy
from router.rollout import ARMS
from router.route import Route, Routing
from router.shadow import ShadowPolicies

_ARM_SUFFIXES: Final = tuple(f"; arm={name}" for name in ARMS)  # x-urc-route's, made once


class Keyed(NamedTuple):
    """A request keyed for routing, not yet routed (admission may hold it in between)."""

    model: Model
    request: RouteRequest
    salt: str | None
    public_tokens: int  # shared isolation: leading tokens keyed shared
    arrived: float  # time.monotonic() when keying began
    keyed_s: float  # how long keying took (part of urc_decision_seconds)


class Plan:
    """A routed request as the gateway holds it: the lifecycle's `route`, the model it named,
    and what the access log, the recording and `x-urc-route` say of it."""

    __slots__ = (
        "model",
        "route",
        "decision_s",
        "policy",
        "public_tokens",
        "prefix_cache",
        "arrived",
        "arm",
        "cluster",
        "ttft_s",
    )

    def __init__(
        self,
        model: Model,
        route: Route,
        decision_s: float,
        policy: str,
        arrived: float,
        public_tokens: int = 0,
        prefix_cache: bool = True,
    ) -> None:
        self.model = model
        self.route = route
        self.decision_s = decision_s
        self.policy = policy  # the policy that decided
        self.public_tokens = public_tokens  # shared isolation: leading tokens keyed shared
        self.prefix_cache = prefix_cache  # False: embeddings (no prefix to predict or record)
        self.arrived = arrived  # time.monotonic() when the request was keyed
        self.arm = -1  # a rollout's arm (router/rollout.py), and the conversation's cluster
        self.cluster = 0
        self.ttft_s = math.nan  # to the first byte the client got (proxy.py)

    @property
    def decision(self) -> Decision:
        return self.route.decision

    @property
    def request(self) -> RouteRequest:
        """What the policy saw (shadow policies see the same)."""
        return self.route.decision.request

    def matched(self, worker: str) -> int:
        return self.route.matched(worker)

    def host_matched(self, worker: str) -> int:
        return self.route.host_matched(worker)

    def header(self, worker: str) -> str:
        """The `x-urc-route` header's value for an answer from `worker`."""
        route = self.route
        arm = "" if self.arm < 0 else _ARM_SUFFIXES[self.arm]  # a rollout's
        return (
            f"worker={worker}; matched_tokens={route.matched(worker)}; "
            f"host_tokens={route.host_matched(worker)}; "
            f"prompt_tokens={route.decision.request.prompt_tokens}; "
            f"reason={route.decision.reason}; policy={self.policy}{arm}"
        )

    def ranked(self) -> Iterator[str]:
        return self.route.ranked()


SYSTEM_RENDERS = 1024  # shared isolation: distinct system prompts whose render is kept
_json = msgspec.json.Encoder(order="sorted")


class Router:
    """Prompts to block keys, for the one lifecycle (`routing`) to route."""

    def __init__(self, fleet: Fleet, routing: Routing, policy: Policy) -> None:
        self.fleet = fleet
        self.routing = routing
        self.policy = policy
        # (tokenizer, system messages and tools as JSON) -> their render: shared mode repeats a few
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
        """Key the request and route it now (`keyed`, then `route`)."""
        return self.route(self.keyed(body, chat, salt, public), policy)

    def keyed(self, body: dict[str, Any], chat: bool, salt: str | None, public: bool) -> Keyed:
        """The request as routing sees it: its model, tokens and block keys in `salt`'s
        namespace (`public`: shared isolation's leading system prompt keyed shared)."""
        arrived = time.monotonic()
        t0 = time.perf_counter()
        model = self._serving(body["model"])
        tokens = self.tokens(model, body, chat)
        public_tokens = self.public_tokens(model, body, tokens) if public and chat and salt else 0
        keys = block_keys(tokens, model.block_size, salt, public_tokens // model.block_size)
        request = RouteRequest(
            keys, len(tokens), model.block_size, model.kv_group, model.name, model.adapter
        )
        return Keyed(model, request, salt, public_tokens, arrived, time.perf_counter() - t0)

    def route(self, keyed: Keyed, policy: Policy | None = None, now: float | None = None) -> Plan:
        """Route `keyed` against the loads of `now` (default: when it was keyed; after
        admission, the moment it leaves the queue): the lifecycle's `route` (router/route.py)."""
        t0 = time.perf_counter()
        model = keyed.model
        policy = policy or self.policy
        fleet = self.fleet
        loads = fleet.adapter_loads(model) if model.adapter else fleet.loads(model.kv_group)
        public_blocks = keyed.public_tokens // model.block_size
        at = keyed.arrived if now is None else now
        route = self.routing.route(keyed.request, loads, policy, at, keyed.salt, public_blocks)
        decision_s = keyed.keyed_s + time.perf_counter() - t0
        return Plan(model, route, decision_s, policy.name, keyed.arrived, keyed.public_tokens)

    def plan_embeddings(self, name: str, items: list[Any], policy: Policy) -> Plan:
        """An embeddings request: no prefix cache plays a part, so no block keys; its prompt
        tokens are the load it adds (`policy`: least load)."""
        arrived = time.monotonic()
        t0 = time.perf_counter()
        model = self._serving(name)
        tokenizer = model.tokenizer
        tokens = 0
        for item in items:
            try:
                tokens += len(tokenizer.prompt_ids(item) if isinstance(item, str) else item)
            except ValueError as exc:
                raise bad_request(str(exc), "input") from None
        request = RouteRequest([], tokens, model.block_size, model.kv_group, name)
        route = self.routing.route(request, self.fleet.loads(model.kv_group), policy, arrived)
        decision_s = time.perf_counter() - t0
        return Plan(model, route, decision_s, policy.name, arrived, 0, False)

    def _serving(self, name: str) -> Model:
        """The model `name` names (404: no such model, 503: no worker up serves it)."""
        model = self.fleet.models.get(name)
        if model is None:
            message = f"The model '{name}' does not exist"
            raise APIError(404, message, param="model", code="model_not_found")
        if model.adapter and not self.fleet.adapter_loads(model):
            if not model.lora_path and self.fleet.candidates(model.base_group):
                message = f"the adapter '{name}' is loaded on no worker and has no lora_path"
                raise APIError(404, message, param="model", code="model_not_found")
            message = f"no healthy worker serves the base model of adapter '{name}'"
            raise APIError(503, message, type="service_unavailable", code="no_worker")
        if not model.adapter and not self.fleet.candidates(model.kv_group):
            message = f"no healthy worker serves model '{name}'"
            raise APIError(503, message, type="service_unavailable", code="no_worker")
        return model


class RoutingModes:
    def __init__(
        self, live: Policy, shadows: list[str], prefill_tokens_per_s: float, degraded: bool
    ) -> None:
        self.live = live
        self.fallback = make_policy("least_load")
        self.manual = degraded  # the operator's switch
        self.auto = False  # the index is unhealthy
        self.shadow = ShadowPolicies(shadows, prefill_tokens_per_s)  # as `urc replay --shadow`

    @property
    def degraded(self) -> bool:
        return self.manual or self.auto

    def active(self) -> Policy:
        return self.fallback if self.degraded else self.live

    def describe(self) -> dict[str, object]:
        return {
            "mode": "degraded" if self.degraded else "live",
            "live_policy": self.live.name,
            "active_policy": self.active().name,
            "degraded_by_operator": self.manual,
            "degraded_by_index_health": self.auto,
            "shadows": self.shadow.describe(),
        }
