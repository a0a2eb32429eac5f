"""Request identity and isolation (docs/isolation.md): the API key names the tenant, the tenant
its cache salt, and its isolation level which of its requests may reuse each other's KV."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Gauge

from core.errors import APIError
from router.gateway.config_schema import DEFAULT_TENANT, TenantConfig

SESSION_HEADERS = ("x-urc-session", "x-session-id")
_PUBLIC_ROLES = frozenset({"system", "developer"})


class Scope(NamedTuple):
    salt: str | None  # forwarded as `cache_salt`; None: the shared namespace
    public: bool  # shared isolation: the leading system prompt is keyed in the shared namespace


def _h(value: str) -> str:
    return hashlib.blake2b(value.encode(), digest_size=12).hexdigest()


def user_salt(tenant_salt: str, user: str) -> str:
    return f"{tenant_salt}.u.{_h(user)}"


def session_salt(tenant_salt: str, session: str) -> str:
    return f"{tenant_salt}.s.{_h(session)}"


def public_tokens(tokens: Sequence[int], system_tokens: Sequence[int], block_size: int) -> int:
    """The public prefix: the full render's tokens in common with the system messages' alone,
    in whole blocks."""
    n = 0
    for a, b in zip(tokens, system_tokens, strict=False):
        if a != b:
            break
        n += 1
    return n // block_size * block_size


def leading_system(messages: list[Any]) -> list[Any]:
    """The leading system (or developer) messages of a chat: its public part in shared mode."""
    n = 0
    while n < len(messages) and isinstance(messages[n], dict):
        if messages[n].get("role") not in _PUBLIC_ROLES:
            break
        n += 1
    return messages[:n] if n < len(messages) else []


class Tenant(NamedTuple):
    name: str
    salt: str | None  # forwarded as `cache_salt`; None: the shared namespace
    isolation: str = "tenant"  # shared | tenant | user | session

    def scope(self, body: dict[str, Any], headers: Mapping[str, str]) -> Scope:
        """The salt of one request of this tenant under its isolation level."""
        salt, isolation = self.salt, self.isolation
        if salt is None or isolation == "tenant":
            return Scope(salt, False)
        if isolation == "shared":
            return Scope(salt, True)
        if isolation == "user":
            user = body.get("user")
            if user is not None and not isinstance(user, str):
                raise APIError(400, "'user' must be a string", param="user")
            return Scope(user_salt(salt, user) if user else salt, False)
        session = next((v for h in SESSION_HEADERS if (v := headers.get(h))), None)
        return Scope(session_salt(salt, session) if session else salt, False)


class Tenants:
    def __init__(self, tenants: list[TenantConfig], secret: str) -> None:
        self._by_key: dict[str, Tenant] = {}
        secret_key = secret.encode()[:64]
        for config in tenants:
            name = config.name.encode()
            digest = hashlib.blake2b(name, key=secret_key, digest_size=16).hexdigest()
            tenant = Tenant(config.name, f"urc-{digest}", config.isolation)
            for key in config.api_keys:
                self._by_key[key] = tenant
        self.auth = bool(self._by_key)
        self._shared = Tenant(DEFAULT_TENANT, None)

    def authenticate(self, authorization: str | None) -> Tenant:
        if not self.auth:
            return self._shared
        if not authorization:
            message = "Missing API key: send 'Authorization: Bearer KEY'"
            raise APIError(401, message, type="authentication_error", code="missing_api_key")
        scheme, _, key = authorization.partition(" ")
        tenant = self._by_key.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            message = "Incorrect API key provided"
            raise APIError(401, message, type="authentication_error", code="invalid_api_key")
        return tenant

    def all(self) -> list[Tenant]:
        """Every tenant (the shared one when auth is off), each once."""
        if not self.auth:
            return [self._shared]
        return list({t.name: t for t in self._by_key.values()}.values())

    def export(self, registry: CollectorRegistry) -> None:
        """`urc_tenant_isolation{tenant, isolation} 1` for each tenant."""
        doc = "1 for each tenant's cache isolation level"
        gauge = Gauge("urc_tenant_isolation", doc, ["tenant", "isolation"], registry=registry)
        for tenant in self.all():
            gauge.labels(tenant.name, tenant.isolation).set(1)

    def by_name(self, name: str) -> Tenant | None:
        return next((t for t in self.all() if t.name == name), None)
