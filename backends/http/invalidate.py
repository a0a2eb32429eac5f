"""`POST /urc/invalidate`: an operator (through the gateway) drops part of a worker's cache.

Body: `{"salt": S}` (that namespace only), `{"salt_prefix": T}` (T and every salt below it:
a tenant's users and sessions), or `{}` (everything); `"kv_group"` narrows it to one group.
Answer: `{"freed_blocks", "locked_blocks"}`: blocks freed now, and blocks running requests
hold, which no request can match any more and which are freed once released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from backends.http.errors import ApiError
from core.blocks import salt_scope


class InvalidateRequest(NamedTuple):
    scope: Callable[[str], bool] | None  # a test on salts; None: every block
    kv_group: str | None  # None: every group


def parse_invalidate(body: Any) -> InvalidateRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for field in ("salt", "salt_prefix", "kv_group"):
        value = body.get(field)
        if value is not None and (not isinstance(value, str) or not value):
            raise ApiError(400, f"'{field}' must be a non-empty string", param=field)
    salt, prefix = body.get("salt"), body.get("salt_prefix")
    if salt is not None and prefix is not None:
        raise ApiError(400, "send 'salt' or 'salt_prefix', not both", param="salt")
    scope = None if salt is None and prefix is None else salt_scope(salt, prefix)
    return InvalidateRequest(scope, body.get("kv_group"))
