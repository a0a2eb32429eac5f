"""The endpoint picker's decision: the one request lifecycle (router/route.py) as the gateway
runs it, up to where the gateway would forward, answered as endpoints instead (docs/epp.md)."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from core.errors import APIError
from router.admission import PROTECT_HEADER, Refused, Ticket
from router.gateway.app import Gateway
from router.gateway.connection import HOT_PATHS
from router.gateway.fleet import Worker
from router.gateway.flow import FlowControl
from router.gateway.parsing import forwarded, parse_embeddings, parse_inference
from router.gateway.reply import Headers
from router.gateway.routing import Plan
from router.route import LoadShare

_PATHS = frozenset(HOT_PATHS.values())


def endpoint_of(worker: Worker) -> str:
    """The `host:port` Envoy connects to for `worker` (its URL's authority)."""
    return urlsplit(worker.url).netloc


class Pick(NamedTuple):
    """Where one request goes: `endpoints[0]`, then the fallbacks in the policy's order."""

    endpoints: list[str]
    body: bytes  # what the worker gets: cache_salt written in
    plan: Plan
    worker: Worker  # the chosen one
    load: LoadShare  # its share of load until the response ends
    route: str  # x-urc-route, as the gateway writes it
    ticket: Ticket | None = None  # flow control's (None: off)
    headers: Headers = []  # for the client's answer: flow control's x-ratelimit-*
    upstream: Headers = []  # for the worker: flow control's protect hint


class Refusal(Exception):
    """Flow control refused the request: the 429 the client gets (docs/flow-control.md)."""

    def __init__(self, headers: Headers, body: bytes) -> None:
        super().__init__("refused")
        self.headers = headers
        self.body = body


class EndpointPicker:
    """Holds a `Gateway` for its fleet, index, tenants and router; serves no HTTP itself."""

    def __init__(self, gateway: Gateway, max_in_flight: int = 0) -> None:
        self.gateway = gateway
        self.fleet = gateway.fleet
        self.max_in_flight = max_in_flight  # per endpoint, beyond it: 429 (0: never shed)

    async def pick(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        raw: bytes,
        subset: Collection[str] | None = None,
    ) -> Pick:
        """Route one request (`headers` by lowercase name). `subset`: the endpoints the proxy
        allows (GIE's subset hint), None: any. Raises APIError with the client's answer, or
        Refusal (flow control's 429); with flow control, a queued request waits here."""
        g = self.gateway
        path = path.partition("?")[0]
        if path not in _PATHS:
            raise APIError(404, f"no such endpoint: {path}", code="not_found")
        if method != "POST":
            raise APIError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
        tenant = g.tenants.authenticate(headers.get("authorization"))
        salt: str | None = None
        public_tokens = 0
        ticket = None
        flow = g.flow
        if path == "/v1/embeddings":  # by load alone, the body as sent (docs/dispatch.md)
            body, items = parse_embeddings(raw)
            plan = g.router.plan_embeddings(body["model"], items, g.modes.fallback)
            if flow is not None:
                ticket = flow.embedding_ticket(tenant.name, plan.request)
                await self._admitted(flow, ticket)
        else:
            body, routed, chat = parse_inference(path, raw)
            scope = tenant.scope(body, headers)
            if flow is None:
                plan = g.router.plan(routed, chat, scope.salt, g.modes.active(), scope.public)
            else:
                keyed = g.router.keyed(routed, chat, scope.salt, scope.public)
                ticket = flow.ticket(tenant, keyed, body, headers)
                await self._admitted(flow, ticket)
                try:
                    plan = g.router.route(keyed, g.modes.active(), time.monotonic())
                except BaseException:
                    flow.done(ticket)
                    raise
            salt, public_tokens = scope.salt, plan.public_tokens
        if plan.model.adapter:  # loaded first where it is not, as the gateway does
            try:
                await self._load_adapter(plan)
            except BaseException:
                if flow is not None and ticket is not None:
                    flow.done(ticket)
                raise
        if ticket is None:
            return self._picked(plan, body, salt, public_tokens, subset)
        assert flow is not None
        try:
            return self._picked(plan, body, salt, public_tokens, subset, flow, ticket)
        except BaseException:
            flow.done(ticket)
            raise

    async def _load_adapter(self, plan: Plan) -> None:
        """Load `plan`'s LoRA adapter on the first worker in the policy's order that can take
        it (docs/adapters.md); the endpoints are then those that have it. None can: 503."""
        loader, workers = self.gateway.proxy.loader, self.fleet.workers
        last = "no worker was up"
        for name in plan.ranked():
            worker = workers.get(name)
            if worker is None or not worker.up:
                continue
            why = await loader.ready(worker, plan.model)
            if why is None:
                return
            last = f"{worker.name}: {why}"
        message = f"no worker could load adapter '{plan.model.adapter}' (last: {last})"
        raise APIError(503, message, type="service_unavailable", code="adapter_load_failed")

    async def _admitted(self, flow: FlowControl, ticket: Ticket) -> None:
        """Flow control lets `ticket` go (it may wait in the queue); Refusal otherwise."""
        try:
            if not flow.enter(ticket):
                await flow.turn(ticket)
        except Refused as exc:
            headers, body = flow.refusal(exc, ticket)
            said = [(k.lower(), v) for k, v in headers if k != "Content-Type"]  # Envoy: lowercase
            raise Refusal(said, body) from None
        except BaseException:  # the stream closed (cancelled) once let go: its grant back
            flow.done(ticket)
            raise

    def _picked(
        self,
        plan: Plan,
        body: dict,
        salt: str | None,
        public_tokens: int,
        subset: Collection[str] | None,
        flow: FlowControl | None = None,
        ticket: Ticket | None = None,
    ) -> Pick:
        """The endpoints for a routed request, the chosen one's load share taken."""
        g = self.gateway
        g.metrics.decision.observe(plan.decision_s)
        g.metrics.reasons[plan.decision.reason] += 1
        workers = self.fleet.workers
        ranked = [w for name in plan.ranked() if (w := workers.get(name)) is not None and w.up]
        if subset is not None:
            ranked = [w for w in ranked if endpoint_of(w) in subset]
        adapter = plan.model.adapter
        if adapter:  # only where it is loaded (_load_adapter): another would refuse its name
            held = self.fleet.adapters.workers
            ranked = [w for w in ranked if w.name in held and adapter in held[w.name].loaded]
        if not ranked:
            message = f"no eligible endpoint for model '{plan.model.name}'"
            raise APIError(503, message, type="service_unavailable", code="no_endpoint")
        limit = self.max_in_flight
        if limit and all(w.load.in_flight >= limit for w in ranked):  # shed, not queue
            message = f"every endpoint has {limit} requests in flight: retry later"
            raise APIError(429, message, type="rate_limit_error", code="overloaded")
        chosen = ranked[0]
        group = chosen.kv_group_of(plan.model)
        exact = chosen.exact_for(plan.model, group)
        load = plan.route.attempt(chosen.name, group, exact, chosen.load, plan.arrived)
        if adapter:  # its slot's last use, a request in flight on it until `ended`
            self.fleet.adapters.use(chosen.name, adapter, plan.arrived)
        header = plan.header(chosen.name)
        payload = forwarded(body, salt, public_tokens)
        extra: Headers = []
        upstream: Headers = []
        if flow is not None and ticket is not None:
            prioritized, extra, hint = flow.forwarded(ticket, body, salt, plan)
            if prioritized is not None and chosen.takes_priority:
                payload = prioritized
            if hint is not None:
                upstream = [(PROTECT_HEADER, str(hint))]
        endpoints = [endpoint_of(w) for w in ranked]
        return Pick(endpoints, payload, plan, chosen, load, header, ticket, extra, upstream)

    def worker_at(self, endpoint: str) -> Worker | None:
        for worker in self.fleet.workers.values():
            if endpoint_of(worker) == endpoint:
                return worker
        return None

    def ended(self, pick: Pick, output_tokens: int | None) -> None:
        """The request ended, however (flow control settles its tenant's budget)."""
        flow, ticket = self.gateway.flow, pick.ticket
        if pick.plan.model.adapter:
            self.fleet.adapters.finish(pick.worker.name, pick.plan.model.adapter)
        if flow is not None and ticket is not None:
            flow.used(ticket, output_tokens)
            flow.done(ticket)

    def served(self, pick: Pick, endpoint: str, cached: int | None) -> None:
        """After a 200: residency for workers without KV events, predicted vs actual."""
        worker = self.worker_at(endpoint)
        plan = pick.plan
        if worker is None or not plan.prefix_cache:  # embeddings: nothing cached
            return
        group = worker.kv_group_of(plan.model)
        plan.route.done(worker.name, group, worker.exact_for(plan.model, group), time.monotonic())
        series = self.gateway.metrics.series[plan.model.name, worker.name]
        try:
            predicted, host = plan.matched(worker.name), plan.host_matched(worker.name)
        except KeyError:  # not a candidate when routed (it came up since)
            predicted = host = 0
        series.prediction(plan.request.prompt_tokens, predicted, cached, host)  # as the gateway's
