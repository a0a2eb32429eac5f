"""The admin API, behind the admin key (`Authorization: Bearer ADMIN_KEY`); off without one.

GET    /admin/workers              the fleet: health, mode, load, models, event streams, parity
POST   /admin/workers              add a worker: {"url", "name"?, "models"?, "kv_events"?, ...}
DELETE /admin/workers/{name}       remove a worker (its residency leaves the index)
POST   /admin/route?tenant=NAME    dry-run: the routing decision for a request body, explained
GET    /admin/tenants              tenants and their isolation levels
POST   /admin/invalidate           drop cached prefixes of a tenant, user, session, model, kv_group
                                   or all, from the index and the workers (invalidation.py)
"""

from __future__ import annotations

import copy
import hmac
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from core.errors import APIError
from router.gateway.config import WorkerConfig
from router.gateway.errors import Handler, bad_request, json_errors
from router.gateway.fleet import Worker
from router.gateway.invalidation import Invalidator
from router.gateway.request_body import parse_body, validate
from router.index import UnifiedIndex

if TYPE_CHECKING:
    from router.gateway.app import Gateway


def add_admin_routes(app: web.Application, gateway: Gateway) -> None:
    admin = _Admin(gateway)
    routes: list[tuple[Callable[..., web.RouteDef], str, Handler]] = [
        (web.get, "/admin/workers", admin.list_workers),
        (web.post, "/admin/workers", admin.add_worker),
        (web.delete, "/admin/workers/{name}", admin.remove_worker),
        (web.post, "/admin/route", admin.dry_run),
        (web.get, "/admin/mode", admin.get_mode),
        (web.post, "/admin/mode", admin.set_mode),
        (web.post, "/admin/invalidate", admin.invalidate),
        (web.get, "/admin/tenants", admin.list_tenants),
    ]
    app.add_routes([route(path, json_errors(admin.authorized(h))) for route, path, h in routes])


def bearer_matches(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer KEY` names `key` (compared in constant time, as bytes: a header
    may hold any character)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape")
    )


def describe(worker: Worker, index: UnifiedIndex) -> dict[str, Any]:
    return {
        "name": worker.name,
        "url": worker.url,
        "up": worker.up,
        "failures": worker.failures,  # failed checks or requests in a row (not 5xx answers)
        "mode": worker.mode,
        "models": worker.models,
        "block_size": worker.block_size,
        "cached_blocks": worker.blocks_held(index),
        "incarnation": worker.incarnation,
        "load": {
            "in_flight": worker.load.in_flight,
            "queued_prefill_tokens": worker.load.queued_prefill_tokens,
            "running_decode": worker.load.running_decode,
        },
        "kv_events": [stream.describe() for stream in worker.streams],
    }


class _Admin:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.invalidator = Invalidator(gateway)

    def authorized(self, handler: Handler) -> Handler:
        """`handler` behind the admin key."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            key = self.gateway.config.admin_key
            if not key:
                message = "the admin API is off: start the gateway with --admin-key"
                raise APIError(403, message, type="permission_error", code="admin_disabled")
            if not bearer_matches(request.headers.get("Authorization"), key):
                message = "wrong or missing admin key"
                raise APIError(401, message, type="authentication_error", code="invalid_admin_key")
            return await handler(request)

        return wrapped

    async def list_workers(self, request: web.Request) -> web.Response:
        fleet = self.gateway.fleet
        return web.json_response(
            {
                "workers": [describe(w, self.gateway.index) for w in fleet.workers.values()],
                "index": self.gateway.index.stats()._asdict(),
                "tokenizer_parity": self.gateway.parity.describe(),
                "policy": self.gateway.config.policy,
            }
        )

    async def add_worker(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read())
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise bad_request("a worker needs at least {'url': 'http://host:port'}", "url")
        try:
            config = WorkerConfig(**body)
        except TypeError as exc:
            raise bad_request(f"bad worker description: {exc}") from None
        if not config.url.startswith(("http://", "https://")):
            raise bad_request("the worker URL must start with http:// or https://", "url")
        try:
            worker = await self.gateway.fleet.add(config)
        except ValueError as exc:
            raise APIError(409, str(exc), code="worker_exists") from None
        return web.json_response(describe(worker, self.gateway.index), status=201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not await self.gateway.fleet.remove(name):
            raise APIError(404, f"no worker named {name!r}", code="worker_not_found")
        return web.json_response({"removed": name})

    async def dry_run(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read())
        chat = isinstance(body, dict) and "messages" in body
        validate(body, chat)
        tenant_name = request.query.get("tenant")
        tenants = self.gateway.tenants
        tenant = tenants.by_name(tenant_name) if tenant_name else tenants.by_name("default")
        if tenant is None:
            raise bad_request(f"unknown tenant {tenant_name!r}", "tenant")
        # a copy: a dry run must not move the live policy's state (round robin, routed sizes)
        policy = copy.deepcopy(self.gateway.modes.active())
        scope = tenant.scope(body, request.headers)
        plan = self.gateway.router.plan(body, chat, scope.salt, policy, scope.public)
        return web.json_response(
            {
                "worker": plan.decision.worker,
                "reason": plan.decision.reason,
                "policy": self.gateway.config.policy,
                "model": plan.model.name,
                "kv_group": plan.model.kv_group,
                "prompt_tokens": plan.prompt_tokens,
                "blocks": len(plan.keys),
                "decision_us": round(plan.decision_s * 1e6, 1),
                "candidates": [asdict(s) for s in plan.decision.scores],
            }
        )

    async def list_tenants(self, request: web.Request) -> web.Response:
        tenants = [{"name": t.name, "isolation": t.isolation} for t in self.gateway.tenants.all()]
        return web.json_response({"tenants": tenants})

    async def invalidate(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read())
        return web.json_response(await self.invalidator.run(body))

    async def get_mode(self, request: web.Request) -> web.Response:
        return web.json_response(self.gateway.modes.describe())

    async def set_mode(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read())
        if not isinstance(body, dict) or not isinstance(body.get("degraded"), bool):
            raise bad_request("send {'degraded': true} or {'degraded': false}", "degraded")
        self.gateway.modes.manual = body["degraded"]
        return web.json_response(self.gateway.modes.describe())
