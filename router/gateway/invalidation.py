"""`POST /admin/invalidate`: drop a scope of cached prefixes (a tenant, user, session, model,
kv_group or all) from the index and the workers; docs/isolation.md, "Scoped invalidation".

The index drops the scope before the workers are asked and again once they answered (events
consumed meanwhile); vLLM and SGLang can only reset their whole cache (scope "all").
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp
from prometheus_client import Counter

from core.blocks import salt_scope
from core.errors import APIError
from router.gateway.errors import bad_request
from router.gateway.fleet import Worker
from router.gateway.isolation import session_salt, user_salt
from router.index_scopes import SaltTest, invalidate

if TYPE_CHECKING:
    from router.gateway.app import Gateway

SCOPES = ("tenant", "user", "session", "model", "kv_group", "all")
_RESETS = ("/reset_prefix_cache", "/flush_cache")  # vLLM's, SGLang's


class Resolved(NamedTuple):
    scope: str
    named: dict[str, str]  # what the scope names, echoed in the answer
    test: SaltTest | None  # on the salts of namespaces; None: every block
    kv_group: str | None  # None: every group
    worker_fields: dict[str, str]  # the body of our workers' POST /urc/invalidate


class Invalidator:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        registry = gateway.metrics.registry
        self.calls = Counter(
            "urc_invalidations", "Admin invalidations by scope", ["scope"], registry=registry
        )
        doc = "Block residencies dropped from the index by admin invalidations"
        self.blocks = Counter("urc_invalidated_blocks", doc, registry=registry)

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
            model = self.gateway.fleet.model(_need(body, "model"))
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
            test = salt_scope(salt_prefix=tenant.salt)
            return Resolved(
                scope, {"tenant": tenant.name}, test, None, {"salt_prefix": tenant.salt}
            )
        if tenant.isolation != scope:
            raise _narrower(scope, tenant.name, tenant.isolation)
        value = _need(body, scope)
        derive = user_salt if scope == "user" else session_salt
        salt = derive(tenant.salt, value)
        named = {"tenant": tenant.name, scope: value}
        return Resolved(scope, named, salt_scope(salt), None, {"salt": salt})

    async def run(self, body: Any) -> dict[str, Any]:
        scope, named, test, kv_group, fields = self.resolve(body)
        self.gateway.residency.invalidated_at = time.monotonic()  # responses under way
        index = self.gateway.index
        dropped = invalidate(index, test, kv_group)
        workers = list(self.gateway.fleet.workers.values())
        answers = await asyncio.gather(*(self._worker(w, scope, fields, kv_group) for w in workers))
        dropped += invalidate(index, test, kv_group)
        self.calls.labels(scope).inc()
        self.blocks.inc(dropped)
        return {
            "scope": scope,
            **named,
            "index_blocks_dropped": dropped,
            "workers": {w.name: a for w, a in zip(workers, answers, strict=True)},
        }

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
                async with session.post(
                    worker.url + "/urc/invalidate", json=fields, timeout=timeout
                ) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status != 200:
                        return {"status": "error", "http_status": resp.status, "detail": answer}
                    return {"status": "invalidated", **answer}
            if scope != "all":
                return {
                    "status": "unroutable",
                    "detail": "this engine cannot drop part of its cache: the gateway no longer "
                    "routes on these blocks, but the engine still holds them until it evicts "
                    "them (scope 'all' resets it)",
                }
            for path in _RESETS:
                async with session.post(worker.url + path, timeout=timeout) as resp:
                    if resp.status < 300:
                        return {"status": "reset", "endpoint": path}
            return {"status": "error", "detail": "no reset endpoint answered"}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return {"status": "error", "detail": f"{exc.__class__.__name__}: {exc}"}


def _need(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise bad_request(f"scope {body['scope']!r} needs '{field}'", field)
    return value


def _narrower(scope: str, tenant: str, isolation: str) -> APIError:
    return APIError(
        409,
        f"tenant {tenant!r} is isolated per {isolation}, so its cache cannot be told apart "
        f"per {scope}: invalidate the whole tenant (scope 'tenant') instead",
        param="scope",
        code="scope_narrower_than_isolation",
    )
