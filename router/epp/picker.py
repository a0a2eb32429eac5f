"""The endpoint picker's decision: the one request lifecycle (router/route.py) as the gateway
runs it, up to where the gateway would forward, answered as endpoints instead (docs/epp.md)."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from core.errors import APIError
from router.gateway.app import Gateway
from router.gateway.connection import HOT_PATHS
from router.gateway.fleet import Worker
from router.gateway.parsing import forwarded, parse_embeddings, parse_request, parse_responses
from router.gateway.proxy import usage_of
from router.gateway.routing import Plan
from router.route import LoadShare

_PATHS = frozenset(HOT_PATHS.values())


def endpoint_of(worker: Worker) -> str:
    """The `host:port` Envoy connects to for `worker` (its URL's authority)."""
    return urlsplit(worker.url).netloc


def cached_tokens(chunk: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` in a response body or SSE chunk."""
    return usage_of(chunk).cached_tokens


class Pick(NamedTuple):
    """Where one request goes: `endpoints[0]`, then the fallbacks in the policy's order."""

    endpoints: list[str]
    body: bytes  # what the worker gets: cache_salt written in
    plan: Plan
    worker: Worker  # the chosen one
    load: LoadShare  # its share of load until the response ends
    route: str  # x-urc-route, as the gateway writes it


class EndpointPicker:
    """Holds a `Gateway` for its fleet, index, tenants and router; serves no HTTP itself."""

    def __init__(self, gateway: Gateway, max_in_flight: int = 0) -> None:
        self.gateway = gateway
        self.fleet = gateway.fleet
        self.max_in_flight = max_in_flight  # per endpoint, beyond it: 429 (0: never shed)

    def pick(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        raw: bytes,
        subset: Collection[str] | None = None,
    ) -> Pick:
        """Route one request (`headers` by lowercase name). `subset`: the endpoints the proxy
        allows (GIE's subset hint), None: any. Raises APIError with the client's answer."""
        g = self.gateway
        path = path.partition("?")[0]
        if path not in _PATHS:
            raise APIError(404, f"no such endpoint: {path}", code="not_found")
        if method != "POST":
            raise APIError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
        tenant = g.tenants.authenticate(headers.get("authorization"))
        salt: str | None = None
        public_tokens = 0
        if path == "/v1/embeddings":  # by load alone, the body as sent (docs/dispatch.md)
            body, items = parse_embeddings(raw)
            plan = g.router.plan_embeddings(body["model"], items, g.modes.fallback)
        else:
            chat = path != "/v1/completions"
            if path == "/v1/responses":  # routed as the chat its input renders as
                body, routed = parse_responses(raw)
            else:
                body = routed = parse_request(raw, chat)
            scope = tenant.scope(body, headers)
            plan = g.router.plan(routed, chat, scope.salt, g.modes.active(), scope.public)
            salt, public_tokens = scope.salt, plan.public_tokens
        g.metrics.decision.observe(plan.decision_s)
        g.metrics.reasons[plan.decision.reason] += 1
        workers = self.fleet.workers
        ranked = [w for name in plan.ranked() if (w := workers.get(name)) is not None and w.up]
        if subset is not None:
            ranked = [w for w in ranked if endpoint_of(w) in subset]
        if not ranked:
            message = f"no eligible endpoint for model '{plan.model.name}'"
            raise APIError(503, message, type="service_unavailable", code="no_endpoint")
        limit = self.max_in_flight
        if limit and all(w.load.in_flight >= limit for w in ranked):  # shed, not queue
            message = f"every endpoint has {limit} requests in flight: retry later"
            raise APIError(429, message, type="rate_limit_error", code="overloaded")
        chosen = ranked[0]
        group = chosen.kv_group_of(plan.model)
        exact = chosen.exact(group)
        load = plan.route.attempt(chosen.name, group, exact, chosen.load, plan.arrived)
        header = plan.header(chosen.name)
        payload = forwarded(body, salt, public_tokens)
        return Pick([endpoint_of(w) for w in ranked], payload, plan, chosen, load, header)

    def worker_at(self, endpoint: str) -> Worker | None:
        for worker in self.fleet.workers.values():
            if endpoint_of(worker) == endpoint:
                return worker
        return None

    def served(self, pick: Pick, endpoint: str, cached: int | None) -> None:
        """After a 200: residency for workers without KV events, predicted vs actual."""
        worker = self.worker_at(endpoint)
        plan = pick.plan
        if worker is None or not plan.prefix_cache:  # embeddings: nothing cached
            return
        group = worker.kv_group_of(plan.model)
        plan.route.done(worker.name, group, worker.exact(group), time.monotonic())
        series = self.gateway.metrics.series[plan.model.name, worker.name]
        try:
            predicted, host = plan.matched(worker.name), plan.host_matched(worker.name)
        except KeyError:  # not a candidate when routed (it came up since)
            predicted = host = 0
        series.prediction(plan.request.prompt_tokens, predicted, cached, host)  # as the gateway's
