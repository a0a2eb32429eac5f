"""`GET /v1/models` through the proxy: the endpoint picker answers it itself, with the body
`urc gateway` sends (router/gateway/model_list.py), as an immediate response (docs/epp.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from core.errors import APIError
from router.epp import protocol
from router.gateway.app import Gateway

PATH: Final = "/v1/models"


class ModelsAnswer:
    """The answer to `GET /v1/models` (HEAD too, as aiohttp answers it), after the gateway's
    API-key check. The ImmediateResponse is built once per rendering of the list, so a request
    costs the key check and a comparison."""

    def __init__(self, gateway: Gateway) -> None:
        self.tenants = gateway.tenants
        self.listing = gateway.model_list
        self._body = self.listing.body
        self._answer = protocol.immediate(200, self._body)

    def answer(self, method: str, headers: Mapping[str, str]) -> ext.ProcessingResponse:
        """`headers` by lowercase name. Raises APIError: 405 for another method, 401 for a
        missing or wrong key (where tenants have keys)."""
        if method not in ("GET", "HEAD"):
            raise APIError(405, f"{method} is not allowed on {PATH}", code="method_not_allowed")
        self.tenants.authenticate(headers.get("authorization"))
        body = self.listing.body
        if body is not self._body:  # a worker came up or went down since the last answer
            self._body, self._answer = body, protocol.immediate(200, body)
        return self._answer
