"""Isolation levels (docs/isolation.md): which requests of a tenant may reuse each other's KV.

The level decides the `cache_salt` a request is keyed and forwarded with. Salts are
structured, so every scope of invalidation is a test on the salt alone (no state to keep):

    tenant    T                    T = "urc-" + blake2b(tenant name, salt_secret)
    user      T.u.<h(user)>        the request's `user` field (tenant salt when absent)
    session   T.s.<h(session)>     the `x-urc-session` (or `x-session-id`) header
    shared    T, and the leading system prompt keyed in the shared namespace, so tenants in
              `shared` mode reuse a common system prompt while the rest stays the tenant's

A shared-mode request carries `urc_public_tokens` (a whole number of blocks): our workers key
those tokens in the shared namespace and mix the salt in after them (core/blocks.py). vLLM
and SGLang ignore the field and salt the whole prompt: isolation first, no sharing there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Gauge

from router.gateway.errors import bad_request

SESSION_HEADERS = ("x-urc-session", "x-session-id")
_PUBLIC_ROLES = frozenset({"system", "developer"})


class Scope(NamedTuple):
    salt: str | None  # forwarded as `cache_salt`; None: the shared namespace
    public: bool  # shared isolation: the leading system prompt is keyed in the shared namespace


def export_levels(registry: CollectorRegistry, levels: Iterable[tuple[str, str]]) -> None:
    """`urc_tenant_isolation{tenant, isolation} 1` for each (tenant, level)."""
    gauge = Gauge(
        "urc_tenant_isolation",
        "1 for each tenant's cache isolation level",
        ["tenant", "isolation"],
        registry=registry,
    )
    for tenant, level in levels:
        gauge.labels(tenant, level).set(1)


def _h(value: str) -> str:
    return hashlib.blake2b(value.encode(), digest_size=12).hexdigest()


def user_salt(tenant_salt: str, user: str) -> str:
    return f"{tenant_salt}.u.{_h(user)}"


def session_salt(tenant_salt: str, session: str) -> str:
    return f"{tenant_salt}.s.{_h(session)}"


def request_scope(
    isolation: str, tenant_salt: str | None, body: dict[str, Any], headers: Mapping[str, str]
) -> Scope:
    """The salt of one request under its tenant's isolation level."""
    if tenant_salt is None or isolation == "tenant":
        return Scope(tenant_salt, False)
    if isolation == "shared":
        return Scope(tenant_salt, True)
    if isolation == "user":
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise bad_request("'user' must be a string", "user")
        return Scope(user_salt(tenant_salt, user) if user else tenant_salt, False)
    session = next((v for h in SESSION_HEADERS if (v := headers.get(h))), None)
    return Scope(session_salt(tenant_salt, session) if session else tenant_salt, False)


def public_tokens(tokens: Sequence[int], system_tokens: Sequence[int], block_size: int) -> int:
    """The tokens of the public prefix: what the render of the leading system messages alone
    has in common with the full render, cut down to whole blocks."""
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
