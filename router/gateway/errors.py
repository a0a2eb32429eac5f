"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from core.errors import APIError

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def json_errors(handler: Handler) -> Handler:
    """Every error of `handler` leaves as OpenAI-style JSON with its status, never a 500 page."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return exc.response()
        except web.HTTPRequestEntityTooLarge as exc:
            message = f"request body too large: {exc.text}"
            return APIError(413, message, code="body_too_large").response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return APIError(exc.status, exc.reason).response()
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            return APIError(500, "internal error in the gateway", type="server_error").response()

    return wrapped


def add_fallback_route(app: web.Application) -> None:
    """Unknown paths and wrong methods get JSON errors too (add it after every other route)."""
    known = {r.canonical for r in app.router.resources()}

    async def fallback(request: web.Request) -> web.Response:
        if request.path in known:
            message = f"{request.method} is not allowed on {request.path}"
            return APIError(405, message, code="method_not_allowed").response()
        return APIError(404, f"no such endpoint: {request.path}", code="not_found").response()

    app.router.add_route("*", "/{tail:.*}", fallback)
