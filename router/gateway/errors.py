"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

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

    def response(self) -> web.Response:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return web.json_response({"error": body}, status=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="no_worker")


def bad_gateway(message: str) -> APIError:
    return APIError(502, message, type="bad_gateway", code="worker_failed")
