"""The worker's JSON in and out: OpenAI-shaped errors (never a 500 for bad input) and the
checked request parameters."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from core.errors import APIError
from core.strict_json import BodyError, decode_object

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        headers=headers,
        content_type="application/json",
    )


_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, "invalid_request")
        return APIError(exc.status, exc.reason, code=code).response()
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return APIError(500, "internal error", type="server_error").response()


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (400 when it is not one, 413 when too large)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, exc.text or "request body too large", code="request_too_large") from exc
    try:
        return decode_object(raw)
    except BodyError as exc:
        raise APIError(400, str(exc), code="invalid_json") from exc


def int_param(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise APIError(400, f"'{name}' must be an integer >= {minimum}", param=name)
    return value


def bool_param(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean", param=name)
    return value


def public_param(body: dict[str, Any]) -> int:
    """Our `urc_public_tokens` (the gateway's, for a tenant in shared isolation): how many
    leading prompt tokens are keyed in the shared namespace before the salt (needs one)."""
    value = body.get("urc_public_tokens", 0)
    if type(value) is not int or value < 0:
        raise APIError(
            400, "'urc_public_tokens' must be an integer >= 0", param="urc_public_tokens"
        )
    return value


def salt_param(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt`: a non-empty string, or absent."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise APIError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
    return salt
