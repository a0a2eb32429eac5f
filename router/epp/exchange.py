"""One HTTP request as the endpoint picker sees it: the messages of one ext_proc `Process`
stream, in order, and the answer each gets (docs/epp.md, "The exchange")."""

from __future__ import annotations

from collections.abc import Mapping

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from core.errors import APIError
from router.epp import models, protocol
from router.epp.picker import EndpointPicker, Pick, Refusal
from router.gateway.proxy import usage_of

_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_SERVED = (protocol.LB_NAMESPACE, protocol.SERVED)
Answers = list[ext.ProcessingResponse]


class Exchange:
    """Request headers -> request body (whole, or chunks until end_of_stream) -> the pick;
    then response headers (the status, the endpoint that served) -> response body (usage)."""

    def __init__(
        self, picker: EndpointPicker, listing: models.ModelsAnswer, max_body_bytes: int
    ) -> None:
        self.picker = picker
        self.listing = listing  # GET /v1/models, answered here
        self.max_body_bytes = max_body_bytes
        self.headers: dict[str, str] = {}
        self.subset: set[str] | None = None
        self.duplex_request = False  # FULL_DUPLEX_STREAMED: the headers wait for the body
        self.duplex_response = False
        self.body = bytearray()
        self.pick: Pick | None = None
        self.responded = False  # the response began (its headers, or its first body chunk)
        self.status = 0
        self.endpoint: str | None = None  # the endpoint that answered
        self.cached: int | None = None
        self.output: int | None = None  # the usage's output tokens
        self.done = False

    async def on(self, message: ext.ProcessingRequest) -> Answers:
        """The answers to one message; routing may wait (flow control's queue), so async."""
        phase = message.WhichOneof("request")
        if message.HasField("protocol_config"):  # the first message says the body modes
            config = message.protocol_config
            self.duplex_request = config.request_body_mode == _DUPLEX
            self.duplex_response = config.response_body_mode == _DUPLEX
        metadata = message.metadata_context.filter_metadata
        if phase == "request_headers":
            return await self._request_headers(message.request_headers, metadata)
        if phase == "request_body":
            return await self._request_body(message.request_body)
        if phase == "response_headers":
            return self._response_headers(message.response_headers, metadata)
        if phase == "response_body":
            if not self.responded:  # the proxy skipped the response's headers
                status = protocol.attribute_status(message.attributes)
                self._responded(status, protocol.lb_value(metadata, *_SERVED))
            return self._response_body(message.response_body)
        assert phase is not None, "an empty ProcessingRequest"
        if phase == "request_trailers" and self.pick is None and self.duplex_request:
            return [*await self._route(), protocol.proceed(phase)]  # the body ended with trailers
        return [protocol.proceed(phase)]

    async def _request_headers(
        self, message: ext.HttpHeaders, metadata: Mapping[str, struct_pb2.Struct]
    ) -> Answers:
        self.headers = protocol.header_map(message.headers)
        hint = protocol.lb_value(metadata, protocol.SUBSET_NAMESPACE, protocol.SUBSET)
        if hint is None:
            hint = self.headers.get(protocol.SUBSET)
        if hint is not None:
            self.subset = {e.strip() for e in hint.split(",") if e.strip()}
        if message.end_of_stream:  # no body: nothing to route (a GET, an empty POST)
            return await self._route()
        return [] if self.duplex_request else [protocol.proceed("request_headers")]

    async def _request_body(self, message: ext.HttpBody) -> Answers:
        self.body += message.body
        if len(self.body) > self.max_body_bytes:
            message_ = f"request body too large: over {self.max_body_bytes} bytes"
            return [protocol.error(APIError(413, message_, code="body_too_large"))]
        if not message.end_of_stream:
            return []  # FULL_DUPLEX_STREAMED: chunks until the last (BUFFERED sends one)
        return await self._route()

    async def _route(self) -> Answers:
        h = self.headers
        method, path = h.get(":method", ""), h.get(":path", "")
        try:
            if path.partition("?")[0] == models.PATH:  # nothing to route: the EPP answers
                return [self.listing.answer(method, h)]
            self.pick = await self.picker.pick(method, path, h, bytes(self.body), self.subset)
        except APIError as exc:
            return [protocol.error(exc)]
        except Refusal as refused:  # flow control's 429, with Retry-After and x-ratelimit-*
            return [protocol.immediate(429, refused.body, refused.headers)]
        pick = self.pick
        answer = [(protocol.ROUTE, pick.route), *pick.headers]  # for a proxy that adds them
        return protocol.routed(
            pick.endpoints, pick.body, self.duplex_request, answer, pick.upstream
        )

    def _response_headers(
        self, message: ext.HttpHeaders, metadata: Mapping[str, struct_pb2.Struct]
    ) -> Answers:
        headers = protocol.header_map(message.headers)
        served = protocol.lb_value(metadata, *_SERVED) or headers.get(protocol.SERVED)
        self._responded(int(headers.get(":status", "0") or 0), served)
        if self.pick is None:
            return [protocol.proceed("response_headers")]
        return [protocol.answered(self.pick.route, self.pick.headers)]

    def _responded(self, status: int, served: str | None) -> None:
        """The response began: its status, the endpoint that served; the load moves on."""
        self.status, self.endpoint, self.responded = status, served, True
        if self.pick is None:
            return
        self.pick.load.first_token()
        if self.endpoint is None:  # the proxy did not say: the primary, as it was asked
            self.endpoint = self.pick.endpoints[0]

    def _response_body(self, message: ext.HttpBody) -> Answers:
        usage = usage_of(message.body)
        if usage.cached_tokens is not None:
            self.cached = usage.cached_tokens
        if usage.output_tokens is not None:
            self.output = usage.output_tokens
        if message.end_of_stream:
            self.close()
        if self.duplex_response:
            return [protocol.passed_chunk("response_body", message.body, message.end_of_stream)]
        return [protocol.proceed("response_body")]

    def close(self) -> None:
        """The request ended (or its stream did): its load leaves, a success is recorded."""
        if self.done or self.pick is None:
            return
        self.done = True
        self.pick.load.finish()
        if self.status == 200 and self.endpoint is not None:
            self.picker.served(self.pick, self.endpoint, self.cached)
        self.picker.ended(self.pick, self.output if self.status == 200 else None)
