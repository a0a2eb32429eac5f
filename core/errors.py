"""The OpenAI-style error both the gateway and our workers answer with:
`{"error": {"message", "type", "param", "code"}}` and the right status."""

from __future__ import annotations

import msgspec
from aiohttp import web


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return msgspec.json.encode({"error": error})

    def response(self) -> web.Response:
        return web.Response(body=self.body(), status=self.status, content_type="application/json")
