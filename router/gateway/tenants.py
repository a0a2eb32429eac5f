"""Request identity (docs/isolation.md): the API key names the tenant, the tenant its cache salt.

With no keys configured auth is off and every request belongs to one shared tenant whose
prompts are keyed in the shared namespace. Salts are derived with a keyed hash, so a client
cannot name another tenant's salt, and every gateway replica derives the same ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from core.errors import APIError
from router.gateway.config import TenantConfig
from router.gateway.isolation import Scope, request_scope

SHARED_TENANT = "default"


class Tenant(NamedTuple):
    name: str
    salt: str | None  # forwarded as `cache_salt`; None: the shared namespace
    isolation: str = "tenant"  # shared | tenant | user | session (router/gateway/isolation.py)

    def scope(self, body: dict[str, Any], headers: Mapping[str, str]) -> Scope:
        """The salt of one request of this tenant under its isolation level."""
        return request_scope(self.isolation, self.salt, body, headers)


class Tenants:
    def __init__(self, tenants: list[TenantConfig], secret: str) -> None:
        self._by_key: dict[str, Tenant] = {}
        for config in tenants:
            digest = hashlib.blake2b(
                config.name.encode(), key=secret.encode()[:64], digest_size=16
            ).hexdigest()
            tenant = Tenant(config.name, f"urc-{digest}", config.isolation)
            for key in config.api_keys:
                self._by_key[key] = tenant
        self.auth = bool(self._by_key)
        self._shared = Tenant(SHARED_TENANT, None)

    def authenticate(self, authorization: str | None) -> Tenant:
        if not self.auth:
            return self._shared
        if not authorization:
            raise APIError(
                401,
                "Missing API key: send 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="missing_api_key",
            )
        scheme, _, key = authorization.partition(" ")
        tenant = self._by_key.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(
                401,
                "Incorrect API key provided",
                type="authentication_error",
                code="invalid_api_key",
            )
        return tenant

    def all(self) -> list[Tenant]:
        """Every tenant (the shared one when auth is off), each once."""
        if not self.auth:
            return [self._shared]
        return list({t.name: t for t in self._by_key.values()}.values())

    def by_name(self, name: str) -> Tenant | None:
        if not self.auth and name == SHARED_TENANT:
            return self._shared
        return next((t for t in self._by_key.values() if t.name == name), None)
