"""The ext_proc answers of an endpoint picker (docs/epp.md), free of I/O: header and body
mutations, the `envoy.lb` dynamic metadata, immediate (error) responses."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from core.errors import APIError
from router.admission import PRIORITY_HEADER
from router.gateway.isolation import SESSION_HEADERS

DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
SUBSET: Final = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
ROUTE: Final = "x-urc-route"
Headers = Sequence[tuple[str, str]]
# the request headers the picker reads (the tenant's key, the isolation session, flow control's
# priority, the subset hint): a proxy may send only these (Envoy's forward_rules)
READ_HEADERS: Final = (
    ":method",
    ":path",
    "authorization",
    *SESSION_HEADERS,
    PRIORITY_HEADER,
    SUBSET,
)
# A proxy that skips the response's headers message sends its status as an attribute of the
# first body message, and adds the EPP's headers for the answer from this dynamic metadata
# namespace (docs/epp.md, "Envoy"): x-urc-route, and flow control's x-ratelimit-* (as
# FlowControl.headers names them)
ATTRIBUTES: Final = "envoy.filters.http.ext_proc"  # the filter's name keys its attributes
STATUS_ATTRIBUTE: Final = "response.code"
ANSWER_NAMESPACE: Final = "urc.answer"
ANSWER_HEADERS: Final = (
    ROUTE,
    *(
        f"x-ratelimit-{part}-{unit}"
        for unit in ("requests", "tokens")
        for part in ("limit", "remaining", "reset")
    ),
)


def attribute_status(attributes: Mapping[str, struct_pb2.Struct]) -> int:
    """The response's status from the attributes (0: not sent)."""
    if ATTRIBUTES not in attributes:
        return 0
    value = attributes[ATTRIBUTES].fields.get(STATUS_ATTRIBUTE)
    if value is None:
        return 0
    if value.HasField("number_value"):
        return int(value.number_value)
    return int(value.string_value or 0)


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Envoy's headers by lowercase name (it sends `raw_value` bytes, older ones `value`)."""
    return {
        h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
        for h in headers.headers
    }


def _mutation(set_headers: Headers, remove: Iterable[str] = ()) -> ext.HeaderMutation:
    return ext.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def destination_metadata(
    endpoints: Sequence[str], answer: Headers | None = None
) -> struct_pb2.Struct:
    """`envoy.lb` -> {x-gateway-destination-endpoint: "primary,fallback,..."}; with `answer`,
    `urc.answer` -> the headers the proxy adds to the response (ANSWER_HEADERS)."""
    metadata = struct_pb2.Struct()
    namespaces: dict[str, dict[str, str]] = {LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}}
    if answer is not None:
        namespaces[ANSWER_NAMESPACE] = dict(answer)
    metadata.update(namespaces)
    return metadata


def routed(
    endpoints: Sequence[str],
    body: bytes,
    streamed: bool,
    answer: Headers | None = None,
    upstream: Headers = (),
) -> list[ext.ProcessingResponse]:
    """The answers that send a buffered request to `endpoints[0]` (the rest: fallbacks) with
    its rewritten `body` and `upstream` headers added. BUFFERED: one body response carrying it
    all. FULL_DUPLEX_STREAMED: the headers response (Envoy held the headers until now), then
    the body as one chunk. `answer`: the response's headers, for a proxy that skips the
    response headers message."""
    headers = [(DESTINATION, endpoints[0]), ("content-length", str(len(body))), *upstream]
    common = ext.CommonResponse(header_mutation=_mutation(headers), clear_route_cache=True)
    metadata = destination_metadata(endpoints, answer)
    if not streamed:
        common.body_mutation.body = body
        return [
            ext.ProcessingResponse(
                request_body=ext.BodyResponse(response=common), dynamic_metadata=metadata
            )
        ]
    chunk = ext.StreamedBodyResponse(body=body, end_of_stream=True)
    mutation = ext.BodyMutation(streamed_response=chunk)
    return [
        ext.ProcessingResponse(
            request_headers=ext.HeadersResponse(response=common), dynamic_metadata=metadata
        ),
        ext.ProcessingResponse(
            request_body=ext.BodyResponse(response=ext.CommonResponse(body_mutation=mutation))
        ),
    ]


def answered(route: str, extra: Headers = ()) -> ext.ProcessingResponse:
    """The response's headers on their way to the client, `x-urc-route` (and `extra`: flow
    control's x-ratelimit-*) added."""
    common = ext.CommonResponse(header_mutation=_mutation([(ROUTE, route), *extra]))
    return ext.ProcessingResponse(response_headers=ext.HeadersResponse(response=common))


def proceed(phase: str) -> ext.ProcessingResponse:
    """Go on unchanged: `phase` is the ProcessingRequest field answered."""
    if phase in ("request_headers", "response_headers"):
        return ext.ProcessingResponse(**{phase: ext.HeadersResponse()})
    if phase in ("request_body", "response_body"):
        return ext.ProcessingResponse(**{phase: ext.BodyResponse()})
    return ext.ProcessingResponse(**{phase: ext.TrailersResponse()})


def passed_chunk(phase: str, chunk: bytes, end: bool) -> ext.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: a body chunk handed back as it came."""
    sent = ext.StreamedBodyResponse(body=chunk, end_of_stream=end)
    common = ext.CommonResponse(body_mutation=ext.BodyMutation(streamed_response=sent))
    return ext.ProcessingResponse(**{phase: ext.BodyResponse(response=common)})


def immediate(status: int, body: bytes, headers: Headers = ()) -> ext.ProcessingResponse:
    """Envoy answers the client itself: nothing goes upstream."""
    all_headers = [("content-type", "application/json"), *headers]
    answer = ext.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=_mutation(all_headers),
        body=body,
        details=f"urc_epp_{status}",
    )
    return ext.ProcessingResponse(immediate_response=answer)


def error(exc: APIError, headers: Headers = ()) -> ext.ProcessingResponse:
    """An OpenAI-style JSON error, as the gateway would answer it."""
    return immediate(exc.status, exc.body(), headers)


def lb_value(metadata: Mapping[str, struct_pb2.Struct], namespace: str, key: str) -> str | None:
    """A string the proxy put in its filter metadata (the subset hint, the served endpoint)."""
    fields = metadata.get(namespace)
    if fields is None or key not in fields.fields:
        return None
    value = fields.fields[key]
    if value.HasField("string_value"):
        return value.string_value
    if value.HasField("list_value"):  # some gateways send the subset as a list
        return ",".join(v.string_value for v in value.list_value.values)
    return None
