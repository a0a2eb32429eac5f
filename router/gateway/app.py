"""The gateway's HTTP surface: OpenAI endpoints, health, metrics (admin routes: admin.py); the
steps of a request are docs/README.md's "A request through the gateway"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Mapping
from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from core.errors import APIError
from core.logs import REQUEST_ID_HEADER, RequestIds
from router.gateway.access import Observer, RequestNote
from router.gateway.admin import admin_routes, bearer_matches
from router.gateway.config import ConfigError, GatewayConfig, load_config
from router.gateway.connection import HOT_PATHS
from router.gateway.fleet import Fleet, Worker
from router.gateway.flow import FlowControl, Ticket, protect_line
from router.gateway.isolation import Tenants
from router.gateway.load_feed import LoadFeed
from router.gateway.metrics import GatewayMetrics
from router.gateway.model_list import ModelList
from router.gateway.parity import ParityProbe
from router.gateway.parsing import forwarded, parse_embeddings, parse_inference
from router.gateway.proxy import Proxy, Usage
from router.gateway.recorder import Recorder
from router.gateway.reply import (
    JSON_HEADERS,
    AiohttpReply,
    Reply,
    add_fallback_route,
    error_response,
    json_errors,
)
from router.gateway.rollout import Canary
from router.gateway.routing import Plan, Router, RoutingModes
from router.gateway.siblings import Siblings
from router.gateway.stalls import Stalls
from router.index import UnifiedIndex
from router.policies import make_policy
from router.policies.cache_aware import CacheAwarePolicy
from router.route import Routing

if TYPE_CHECKING:
    from router.gateway.discovery import PodDiscovery

log = logging.getLogger(__name__)
_BUSY_HEADERS = [*JSON_HEADERS, ("Retry-After", "1")]
_BUSY_BODY = APIError(
    429,
    "too many requests in flight on this gateway (--max-concurrent-requests); retry shortly",
    type="rate_limit_error",
    code="rate_limit_exceeded",
).body()


class Gateway:
    """Everything one gateway process holds; `app` is its aiohttp application."""

    def __init__(self, config: GatewayConfig, siblings: Siblings | None = None) -> None:
        self.config = config
        self.siblings = siblings  # the other processes of --processes N
        process = f"/{siblings.index}" if siblings is not None else ""
        self.replica = f"{socket.gethostname()}{process}"  # in answers that say what changed
        max_blocks = config.index_max_blocks
        self.index = UnifiedIndex(max_blocks, config.approx_ttl_s, config.pending_ttl_s)
        self.fleet = Fleet(config, self.index, siblings)
        told = {"prefill_tokens_per_s": config.prefill_tokens_per_s}  # one knob (docs/policies.md)
        self.policy = make_policy(config.policy, told, **config.policy_params)
        # the one request lifecycle (router/route.py): admin invalidations mark when they begin
        self.routing = Routing(self.index, self.fleet.adapters)
        self.router = Router(self.fleet, self.routing, self.policy)
        if isinstance(self.policy, CacheAwarePolicy) and (
            "host_copy_tokens_per_s" not in config.policy_params
        ):  # not configured: the rate the workers report (docs/tiers.md)
            self.fleet.on_up.append(self._measured_host_copies)
        self.modes = RoutingModes(
            self.policy, config.shadow_policies, config.prefill_tokens_per_s, config.degraded
        )
        if not config.salt_secret and config.tenants:
            log.warning(
                "no salt_secret set: tenants' cache salts are keyed with a random secret of "
                "this process (replicas in front of one fleet must share one: --salt-secret)"
            )
        self.tenants = Tenants(config.tenants, config.salt_secret or secrets.token_hex(32))
        self.draining = False  # SIGTERM: /health says so, and the front server drains
        self.max_concurrent = config.max_concurrent_requests  # 0: no limit
        self.in_flight = 0  # inference requests of this process under way
        self.metrics_keys = [k for k in (config.metrics_key, config.admin_key) if k]
        self.metrics = GatewayMetrics(self.fleet, self.index, self.modes, config.policy)
        self.tenants.export(self.metrics.registry)
        self.parity = ParityProbe(self.fleet, config.parity_interval_s)
        if config.parity_interval_s > 0:
            self.fleet.on_up.append(self.parity.on_up)
            self.metrics.registry.register(self.parity)
        self.proxy = Proxy(self.fleet, self.metrics, config.prefill_tokens_per_s)
        self.metrics.registry.register(self.proxy.loader)  # LoRA adapters' loads and slots
        # gradual rollout (docs/rollouts.md): off (`on` False) until configured or started
        self.canary = Canary(config.rollout, config.prefill_tokens_per_s, self.metrics.registry)
        if config.rollout.configured:
            self.canary.start(config.rollout, time.monotonic())
        self.flow: FlowControl | None = None  # flow control (docs/flow-control.md); None: off
        if config.flow_control:
            share = config.flow_budget_share / (siblings.count if siblings is not None else 1)
            self.flow = FlowControl(config, self.fleet, self.routing, share)
            self.metrics.registry.register(self.flow.metrics)
            self.proxy.on_load = self.flow.pump_soon
        self.model_list = ModelList(self.fleet)  # GET /v1/models, here and in urc epp
        self.load_feed = LoadFeed(self.fleet, config.load_interval_s)  # the workers' own load
        if self.flow is not None:
            self.load_feed.on_merge = self.flow.pump_soon
        self.metrics.registry.register(self.load_feed)
        self.stalls = Stalls()  # GC pauses and the loop's lag (docs/metrics.md)
        self.metrics.registry.register(self.stalls)
        self.recorder = Recorder(config.record, config.policy) if config.record else None
        self.request_ids = RequestIds()
        # the access log and tracing (docs/operability.md); None: both off, nothing is noted
        self.observer: Observer | None = None
        if config.access_log or config.otel_endpoint:
            self.observer = Observer(config.access_log, config.otel_endpoint)
        self._tasks: list[asyncio.Task[None]] = []
        self.discovery: PodDiscovery | None = None  # --discover k8s
        self.app = self._application()

    def _application(self) -> web.Application:
        """The aiohttp side: every route but the hot paths' fast lane (server.py). JSON errors
        per handler (json_errors), not a middleware: it costs every request a wrapper."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
        via_aiohttp = self._via_aiohttp
        routes = [web.post(p, json_errors(partial(via_aiohttp, p))) for p in HOT_PATHS.values()]
        routes.append(web.get("/v1/models", json_errors(self.list_models)))
        routes.append(web.get("/health", self.health))
        routes.append(web.get("/health/live", self.live))
        routes.append(web.get("/metrics", self.metrics_endpoint))
        routes += [route(path, json_errors(h)) for route, path, h in admin_routes(self)]
        app.add_routes(routes)
        add_fallback_route(app)
        app.on_response_prepare.append(self._close_when_draining)
        app.on_response_prepare.append(self._with_request_id)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self.stalls.start()
        await self.fleet.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.fleet.health_loop()))
        self._tasks.append(loop.create_task(self._watch_index_health()))
        self._tasks.append(loop.create_task(self.canary.run()))
        if self.config.parity_interval_s > 0:
            self._tasks.append(loop.create_task(self.parity.run()))
        if self.config.load_interval_s > 0:
            self._tasks.append(loop.create_task(self.load_feed.run()))
        if self.config.discover == "k8s":
            from router.gateway.discovery import PodDiscovery  # lightkube: the k8s extra

            self.discovery = PodDiscovery(self.fleet, self.config)
            await self.discovery.start()

    async def _watch_index_health(self) -> None:
        """Each health interval: expired residency out of the index; degrade while every
        KV-event stream is lost, recover when one is back."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            self.routing.expire(time.monotonic())
            lost = self.fleet.events_lost()
            if lost != self.modes.auto:
                self.modes.auto = lost
                routing = "degraded to least load" if lost else "restored"
                log.warning("KV event streams %s: routing %s", "lost" if lost else "back", routing)

    def _measured_host_copies(self, worker: Worker) -> None:
        """A worker came up: price host-tier hits at the slowest copy rate the fleet reports."""
        rate = self.fleet.host_copy_tokens_per_s()
        policy = self.policy
        if rate > 0 and isinstance(policy, CacheAwarePolicy):
            if rate != policy.host_copy_tokens_per_s:
                log.info("host-tier hits priced at %.0f tokens/s (the workers' copy rate)", rate)
            policy.price_host_copies(rate)

    def reload(self, path: str) -> None:
        """SIGHUP: read the config file again for what can change at runtime."""
        try:
            fresh = load_config(path)
        except ConfigError as exc:
            log.error("config reload failed, nothing changed: %s", exc)
            return
        self.modes.manual = fresh.degraded
        log.warning("config reloaded: routing %s", "degraded" if fresh.degraded else "live")

    async def _stop(self, _app: web.Application) -> None:
        self.stalls.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.load_feed.close()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.parity.close()
        await self.proxy.deadlines.close()
        if self.flow is not None:
            await self.flow.close()
        await self.fleet.close()
        if self.recorder is not None:
            self.recorder.close()
        if self.observer is not None:
            await asyncio.to_thread(self.observer.close)  # the spans still buffered go out

    async def _via_aiohttp(self, path: str, request: web.Request) -> web.StreamResponse:
        """`path` on a connection aiohttp holds (server.py says when)."""
        reply = AiohttpReply(request)
        await self.serve(reply, path, request.headers, await request.read())
        assert reply.response is not None
        return reply.response

    async def serve(self, reply: Reply, path: str, headers: Mapping[str, str], raw: bytes) -> None:
        """One inference request, whichever server took it (`headers` by lowercase name); past
        `max_concurrent_requests` in flight, a 429."""
        reply.request_id = self.request_ids.of(headers.get(REQUEST_ID_HEADER))
        observer = self.observer
        note = None if observer is None else observer.begin(reply.request_id, path, headers)
        limit = self.max_concurrent
        if limit and self.in_flight >= limit:
            self.metrics.rejected["max_concurrent_requests"] += 1
            if note is not None:
                note.failed(429, "max_concurrent_requests")
                note.finish()
            reply.whole(429, _BUSY_HEADERS, _BUSY_BODY)
            return
        self.in_flight += 1
        plan: Plan | None = None  # once routed: a rollout's arm counts its failures
        try:
            tenant = self.tenants.authenticate(headers.get("authorization"))
            if path == "/v1/embeddings":
                await self._embed(reply, raw, tenant.name, note)
                return
            body, routed, chat = parse_inference(path, raw)
            if note is not None:
                note.parsed(tenant.name, body)
            scope = tenant.scope(body, headers)
            flow = self.flow
            canary = self.canary
            if flow is None and not canary.on:
                plan = self.router.plan(routed, chat, scope.salt, self.modes.active(), scope.public)
                await self._forward(reply, path, body, plan, scope.salt, tenant.name, note)
                return
            # a rollout's arm first: it may name the model (docs/rollouts.md)
            keyed, at = canary.keyed(self.router, tenant.name, headers, body, routed, chat, scope)
            if flow is None:
                plan = canary.routed(self.router, self.modes, keyed, at, None)
                await self._forward(reply, path, body, plan, scope.salt, tenant.name, note)
                canary.answered(plan)
                return
            ticket = flow.ticket(tenant, keyed, body, headers)
            try:
                if flow.arrive(ticket, reply, note) or await flow.wait(ticket, reply, note):
                    plan = canary.routed(self.router, self.modes, keyed, at, time.monotonic())
                    salt = scope.salt
                    await self._forward(reply, path, body, plan, salt, tenant.name, note, ticket)
                    canary.answered(plan)
            finally:
                flow.done(ticket)
        except APIError as exc:
            if plan is not None and exc.status >= 500:
                self.canary.failed(plan)
            if note is not None:
                note.failed(exc.status, exc.message)
            if reply.started:
                raise
            reply.whole(exc.status, JSON_HEADERS, exc.body())
        except BaseException as exc:  # the client left (cancelled), or a bug (a 500)
            if note is not None:
                note.failed_by(exc)
            raise
        finally:
            self.in_flight -= 1
            if note is not None:
                note.finish()

    def _forward(
        self,
        reply: Reply,
        path: str,
        body: dict,
        plan: Plan,
        salt: str | None,
        tenant: str,
        note: RequestNote | None,
        ticket: Ticket | None = None,
    ) -> Awaitable[None]:
        """A routed request to its worker, to await (no coroutine frame of its own); `ticket`:
        flow control's, whose engine priority our workers get, its budgets' headers the client."""
        if note is not None:
            note.routed(plan)
        shadow = self.modes.shadow
        if shadow.policies:  # they choose among the same candidates
            shadow.watch(plan.request, plan.decision.candidates, plan.decision.worker)
        self.metrics.decision.observe(plan.decision_s)
        self.metrics.reasons[plan.decision.reason] += 1
        payload = forwarded(body, salt, plan.public_tokens)
        on_success = partial(self._served, tenant=tenant, ticket=ticket)
        stream = body.get("stream") is True
        forward = self.proxy.forward
        if ticket is not None and self.flow is not None:
            prioritized, extra, hint = self.flow.forwarded(ticket, body, salt, plan)
            lines = protect_line(hint)
            return forward(
                reply, path, payload, plan, stream, on_success, note, prioritized, extra, lines
            )
        return forward(reply, path, payload, plan, stream, on_success, note)

    async def _embed(self, reply: Reply, raw: bytes, tenant: str, note: RequestNote | None) -> None:
        """`/v1/embeddings`: to the least loaded worker serving the model, the body as sent
        (no prefix cache plays a part: docs/dispatch.md, "Other endpoints"); with flow control,
        its tenant's budgets apply (never queued: an embedding is no prefill to wait for)."""
        body, items = parse_embeddings(raw)
        if note is not None:
            note.parsed(tenant, body)
        plan = self.router.plan_embeddings(body["model"], items, self.modes.fallback)
        flow = self.flow
        if flow is None:
            await self._forward(reply, "/v1/embeddings", body, plan, None, tenant, note)
            return
        ticket = flow.embedding_ticket(tenant, plan.request)
        try:
            if flow.arrive(ticket, reply, note):
                await self._forward(reply, "/v1/embeddings", body, plan, None, tenant, note, ticket)
        finally:
            flow.done(ticket)

    def _served(
        self, plan: Plan, worker: Worker, usage: Usage, tenant: str, ticket: Ticket | None
    ) -> None:
        """After a success: the recording (embeddings: nothing cached, nothing to replay), and
        flow control's settlement of the tenant's tokens."""
        if ticket is not None and self.flow is not None:
            self.flow.used(ticket, usage.output_tokens)
        if plan.arm >= 0:
            self.canary.served(plan, worker, usage)
        if self.recorder is not None and plan.prefix_cache:
            self.recorder.record(plan, worker, tenant, usage)

    async def list_models(self, request: web.Request) -> web.Response:
        self.tenants.authenticate(request.headers.get("Authorization"))
        return web.Response(body=self.model_list.body, content_type="application/json")

    async def health(self, _request: web.Request) -> web.Response:
        up = sum(w.up for w in self.fleet.workers.values())
        status = 200 if up and not self.draining else 503
        word = "draining" if self.draining else "ok" if up else "no healthy worker"
        body = {"status": word, "workers_up": up, "workers": len(self.fleet.workers)}
        return web.json_response(body, status=status)

    async def live(self, _request: web.Request) -> web.Response:
        """Liveness: 200 while the process serves, draining included. The workers play no
        part, so a fleet that is down never gets its gateways restarted."""
        return web.json_response({"status": "alive"})

    async def _with_request_id(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer of the aiohttp side has an x-request-id (inference ones: the reply's)."""
        if REQUEST_ID_HEADER not in response.headers:
            sent = request.headers.get(REQUEST_ID_HEADER)
            response.headers[REQUEST_ID_HEADER] = self.request_ids.of(sent)

    async def _close_when_draining(
        self, _request: web.Request, response: web.StreamResponse
    ) -> None:
        """The aiohttp side of a drain: its answers say `Connection: close` too (server.py)."""
        if self.draining:
            response.force_close()

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        """On the API port: behind the metrics or admin key (README.md, "GET /metrics")."""
        keys = self.metrics_keys
        siblings = self.siblings
        if siblings is not None and siblings.sent_by_sibling(request.headers):
            return self.local_scrape()
        if self.config.metrics_key or self.tenants.auth:
            if not keys:
                message = "metrics are off on the API port: set --metrics-key or --metrics-port"
                return error_response(APIError(403, message, type="permission_error"))
            if not any(bearer_matches(request.headers.get("Authorization"), k) for k in keys):
                message = "wrong or missing metrics key"
                return error_response(APIError(401, message, type="authentication_error"))
        return await self.scrape(request)

    async def scrape(self, request: web.Request) -> web.Response:
        """This process's metrics, and with --processes every sibling's (label `replica`)."""
        if self.siblings is None:
            return self.local_scrape()
        own = generate_latest(self.metrics.registry)
        body = await self.siblings.scrape_all(own, request.headers)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def local_scrape(self) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
