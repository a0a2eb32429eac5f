"""The admin API (README.md lists its routes), behind the admin key (`Authorization: Bearer
ADMIN_KEY`) and off without one; its scoped invalidation is docs/isolation.md's."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp
from aiohttp import web
from prometheus_client import Counter

from core.blocks import salt_scope
from core.errors import APIError
from router.gateway.config import WorkerConfig
from router.gateway.fleet import Worker
from router.gateway.isolation import session_salt, user_salt
from router.gateway.parsing import bad_request, parse_body, validate
from router.gateway.siblings import scoped
from router.index import UnifiedIndex
from router.index_scopes import SaltTest, invalidate

if TYPE_CHECKING:
    from router.gateway.app import Gateway, Handler


def admin_routes(gateway: Gateway) -> list[tuple[Callable[..., web.RouteDef], str, Handler]]:
    admin = _Admin(gateway)
    auth = admin.authorized
    return [
        (web.get, "/admin/workers", auth(admin.list_workers)),
        (web.post, "/admin/workers", auth(admin.add_worker)),
        (web.delete, "/admin/workers/{name}", auth(admin.remove_worker)),
        (web.post, "/admin/route", auth(admin.dry_run)),
        (web.get, "/admin/mode", auth(admin.get_mode)),
        (web.post, "/admin/mode", auth(admin.set_mode)),
        (web.post, "/admin/invalidate", auth(admin.invalidate)),
        (web.get, "/admin/tenants", auth(admin.list_tenants)),
        # gradual rollout (docs/rollouts.md): its state and actions
        *[(method, path, auth(handler)) for method, path, handler in gateway.canary.routes()],
        # sglang-router's and vllm-router's worker management (docs/migration.md)
        (web.post, "/add_worker", auth(admin.add_worker_url)),
        (web.post, "/remove_worker", auth(admin.remove_worker_url)),
        (web.get, "/list_workers", auth(admin.list_worker_urls)),
    ]


def bearer_matches(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer KEY` names `key` (in constant time, as bytes: any character)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given_bytes, key.encode("utf-8", "surrogateescape"))


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
        "host_cached_blocks": worker.blocks_held(index, host=True),
        "incarnation": worker.incarnation,
        "load": {
            "in_flight": worker.load.in_flight,
            "queued_prefill_tokens": worker.load.queued_prefill_tokens,
            "running_decode": worker.load.running_decode,
        },
        "kv_events": [stream.describe() for stream in worker.streams],
    }


SCOPES = ("tenant", "user", "session", "model", "kv_group", "all")
_RESETS = ("/reset_prefix_cache", "/flush_cache")  # vLLM's, SGLang's
_UNROUTABLE = (
    "this engine cannot drop part of its cache: the gateway no longer routes on these blocks, "
    "but the engine still holds them until it evicts them (scope 'all' resets it)"
)


class Resolved(NamedTuple):
    scope: str
    named: dict[str, str]  # what the scope names, echoed in the answer
    test: SaltTest | None  # on the salts of namespaces; None: every block
    kv_group: str | None  # None: every group
    worker_fields: dict[str, str]  # the body of our workers' POST /urc/invalidate


class _Admin:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        registry = gateway.metrics.registry
        doc = "Admin invalidations by scope"
        self.invalidations = Counter("urc_invalidations", doc, ["scope"], registry=registry)
        doc = "Block residencies dropped from the index by admin invalidations"
        self.invalidated_blocks = Counter("urc_invalidated_blocks", doc, registry=registry)

    def authorized(self, handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            key = self.gateway.config.admin_key
            if not key:
                message = "the admin API is off: start the gateway with --admin-key"
                raise APIError(403, message, type="permission_error", code="admin_disabled")
            if not bearer_matches(request.headers.get("Authorization"), key):
                message = "wrong or missing admin key"
                raise APIError(401, message, type="authentication_error", code="invalid_admin_key")
            response = await handler(request)
            if request.method == "GET" or request.path == "/admin/route":
                return response
            return await self.applied(request, response)

        return wrapped

    async def applied(self, request: web.Request, response: web.StreamResponse) -> web.Response:
        """A change made here: made on the sibling processes too (--processes), and the answer
        says where it was applied (docs/scale-out.md)."""
        assert isinstance(response, web.Response) and isinstance(response.body, bytes)
        siblings = self.gateway.siblings
        if siblings is not None and siblings.sent_by_sibling(request.headers):
            return response
        processes = None
        if siblings is not None and response.status < 300:
            processes = await siblings.fan_out(request, await request.read())
            processes[str(siblings.index)] = response.status
        answer = json.loads(response.body)
        body = scoped(answer, self.gateway.replica, processes)
        return web.Response(body=body, status=response.status, content_type="application/json")

    async def list_workers(self, request: web.Request) -> web.Response:
        gateway = self.gateway
        feed = gateway.load_feed
        workers = gateway.fleet.workers.values()
        body = {
            "workers": [
                {**describe(w, gateway.index), "reported": feed.report(w)} for w in workers
            ],
            "index": gateway.index.stats()._asdict(),
            "tokenizer_parity": gateway.parity.describe(),
            "policy": gateway.config.policy,
            "replica": gateway.replica,
            "pid": os.getpid(),  # this process (of --processes N)
            "kv_ingest": gateway.fleet.ingest.role() if gateway.fleet.ingest else "own",
        }
        return web.json_response(body)

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

    async def add_worker_url(self, request: web.Request) -> web.Response:
        """`POST /add_worker?url=URL`, as sglang-router: our workers are discovered from the URL;
        engines that cannot be asked are described with POST /admin/workers instead."""
        url = _query_url(request)
        try:
            worker = await self.gateway.fleet.add(WorkerConfig(url=url))
        except ValueError as exc:
            raise APIError(409, str(exc), param="url", code="worker_exists") from None
        body = {"status": "ok", "message": f"Successfully added worker: {url}"}
        return web.json_response({**body, "worker": describe(worker, self.gateway.index)})

    async def remove_worker_url(self, request: web.Request) -> web.Response:
        url = _query_url(request)
        names = [w.name for w in self.gateway.fleet.workers.values() if w.url == url]
        if not names or not await self.gateway.fleet.remove(names[0]):
            raise APIError(404, f"no worker at {url!r}", param="url", code="worker_not_found")
        message = f"Successfully removed worker: {url}"
        return web.json_response({"status": "ok", "message": message, "removed": names[0]})

    async def list_worker_urls(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": [w.url for w in self.gateway.fleet.workers.values()]})

    async def dry_run(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read())
        chat = isinstance(body, dict) and "messages" in body
        validate(body, chat)
        tenant_name = request.query.get("tenant")
        tenant = self.gateway.tenants.by_name(tenant_name or "default")
        if tenant is None:
            raise bad_request(f"unknown tenant {tenant_name!r}", "tenant")
        # a copy: a dry run must not move the live policy's state (round robin, routed sizes)
        policy = copy.deepcopy(self.gateway.modes.active())
        scope = tenant.scope(body, request.headers)
        plan = self.gateway.router.plan(body, chat, scope.salt, policy, scope.public)
        answer = {
            "worker": plan.decision.worker,
            "reason": plan.decision.reason,
            "policy": self.gateway.config.policy,
            "model": plan.model.name,
            "kv_group": plan.model.kv_group,
            "prompt_tokens": plan.request.prompt_tokens,
            "blocks": len(plan.request.block_keys),
            "decision_us": round(plan.decision_s * 1e6, 1),
            "candidates": [asdict(s) for s in plan.decision.scores],
        }
        return web.json_response(answer)

    async def list_tenants(self, request: web.Request) -> web.Response:
        tenants = [{"name": t.name, "isolation": t.isolation} for t in self.gateway.tenants.all()]
        return web.json_response({"tenants": tenants})

    async def get_mode(self, request: web.Request) -> web.Response:
        return web.json_response(self.gateway.modes.describe())

    async def set_mode(self, request: web.Request) -> web.Response:
        body = parse_body(await request.read())
        if not isinstance(body, dict) or not isinstance(body.get("degraded"), bool):
            raise bad_request("send {'degraded': true} or {'degraded': false}", "degraded")
        self.gateway.modes.manual = body["degraded"]
        return web.json_response(self.gateway.modes.describe())

    def resolve(self, body: Any) -> Resolved:
        """What an admin body names; OpenAI-style 4xx for what cannot be done."""
        if not isinstance(body, dict) or body.get("scope") not in SCOPES:
            raise bad_request(f"'scope' must be one of {', '.join(SCOPES)}", "scope")
        scope: str = body["scope"]
        named = {k: v for k, v in body.items() if k != "scope"}
        for key, value in named.items():
            if not isinstance(value, str) or not value:
                raise bad_request(f"'{key}' must be a non-empty string", key)
        if scope == "all":
            return Resolved(scope, {}, None, None, {})
        if scope == "kv_group":
            group = _need(body, "kv_group")
            return Resolved(scope, {"kv_group": group}, None, group, {"kv_group": group})
        if scope == "model":
            model = self.gateway.fleet.models.get(_need(body, "model"))
            if model is None:
                raise APIError(404, f"no model named {body['model']!r}", code="model_not_found")
            group = model.kv_group
            named = {"model": model.name, "kv_group": group}
            return Resolved(scope, named, None, group, {"kv_group": group})
        tenant = self.gateway.tenants.by_name(_need(body, "tenant"))
        if tenant is None:
            raise APIError(404, f"no tenant named {body['tenant']!r}", code="tenant_not_found")
        if tenant.salt is None:  # auth off: the one shared tenant holds everything
            if scope != "tenant":
                raise _narrower(scope, tenant.name, "tenant")
            return Resolved(scope, {"tenant": tenant.name}, None, None, {})
        if scope == "tenant":
            test, fields = salt_scope(salt_prefix=tenant.salt), {"salt_prefix": tenant.salt}
            return Resolved(scope, {"tenant": tenant.name}, test, None, fields)
        if tenant.isolation != scope:
            raise _narrower(scope, tenant.name, tenant.isolation)
        value = _need(body, scope)
        derive = user_salt if scope == "user" else session_salt
        salt = derive(tenant.salt, value)
        named = {"tenant": tenant.name, scope: value}
        return Resolved(scope, named, salt_scope(salt), None, {"salt": salt})

    async def invalidate(self, request: web.Request) -> web.Response:
        scope, named, test, kv_group, fields = self.resolve(parse_body(await request.read()))
        self.gateway.routing.invalidated_at = time.monotonic()  # responses under way
        index = self.gateway.index
        dropped = invalidate(index, test, kv_group)
        siblings = self.gateway.siblings
        if siblings is not None and siblings.sent_by_sibling(request.headers):
            # the process the admin asked tells the workers; its siblings drop their index only
            return web.json_response({"scope": scope, **named, "index_blocks_dropped": dropped})
        workers = list(self.gateway.fleet.workers.values())
        answers = await asyncio.gather(*(self._worker(w, scope, fields, kv_group) for w in workers))
        dropped += invalidate(index, test, kv_group)
        self.invalidations.labels(scope).inc()
        self.invalidated_blocks.inc(dropped)
        by_worker = {w.name: a for w, a in zip(workers, answers, strict=True)}
        body = {"scope": scope, **named, "index_blocks_dropped": dropped, "workers": by_worker}
        return web.json_response(body)

    async def _worker(
        self, worker: Worker, scope: str, fields: dict[str, str], kv_group: str | None
    ) -> dict[str, Any]:
        if kv_group is not None and kv_group not in worker.models.values():
            return {"status": "not_serving", "detail": f"serves no model of {kv_group!r}"}
        session = self.gateway.fleet.session
        assert session is not None
        timeout = aiohttp.ClientTimeout(total=self.gateway.config.connect_timeout_s * 5)
        try:
            if worker.incarnation is not None:  # ours: it frees exactly the scope
                url = worker.url + "/urc/invalidate"
                async with session.post(url, json=fields, timeout=timeout) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status != 200:
                        return {"status": "error", "http_status": resp.status, "detail": answer}
                    return {"status": "invalidated", **answer}
            if scope != "all":
                return {"status": "unroutable", "detail": _UNROUTABLE}
            for path in _RESETS:
                async with session.post(worker.url + path, timeout=timeout) as resp:
                    if resp.status < 300:
                        return {"status": "reset", "endpoint": path}
            return {"status": "error", "detail": "no reset endpoint answered"}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return {"status": "error", "detail": f"{exc.__class__.__name__}: {exc}"}


def _query_url(request: web.Request) -> str:
    """The `url` query parameter of sglang-router's endpoints, without a trailing slash."""
    if "api_key" in request.query:
        message = "urc sends workers no API key: run the worker without one, behind the gateway"
        raise bad_request(message, "api_key")
    url = request.query.get("url", "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise bad_request("give the worker as ?url=http://host:port", "url")
    return url


def _need(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise bad_request(f"scope {body['scope']!r} needs '{field}'", field)
    return value


def _narrower(scope: str, tenant: str, isolation: str) -> APIError:
    message = (
        f"tenant {tenant!r} is isolated per {isolation}, so its cache cannot be told apart "
        f"per {scope}: invalidate the whole tenant (scope 'tenant') instead"
    )
    return APIError(409, message, param="scope", code="scope_narrower_than_isolation")
