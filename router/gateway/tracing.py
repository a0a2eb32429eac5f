"""OpenTelemetry spans of the gateway's requests (docs/operability.md, "Tracing"): `urc.request`
(a child of the client's W3C `traceparent` when it sends one), `urc.route` and one `urc.upstream`
per attempt, whose context reaches the worker as its `traceparent`. Imported only with
--otel-endpoint (the otel extra): with tracing off, no OpenTelemetry module is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Attributes = Mapping[str, str | int | bool]


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base (http://collector:4318) gets the traces path; a full URL is kept."""
    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


class Tracing:
    """One tracer provider of this gateway process, exporting in batches from its own thread."""

    def __init__(self, endpoint: str, service: str = "urc-gateway") -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("urc.gateway")
        self.propagator = TraceContextTextMapPropagator()

    def request_span(self, headers: Mapping[str, str], path: str, start_ns: int) -> Span:
        """The request's span, a child of the client's trace context if it sent one."""
        parent = self.propagator.extract(headers) if "traceparent" in headers else None
        attributes = {"http.request.method": "POST", "url.path": path}
        return self.tracer.start_span(
            "urc.request", parent, SpanKind.SERVER, attributes, start_time=start_ns
        )

    def route_span(self, parent: Span, start_ns: int, end_ns: int, attributes: Attributes) -> None:
        """The routing step, recorded once it is over (its times are the plan's)."""
        context = trace.set_span_in_context(parent)
        span = self.tracer.start_span(
            "urc.route", context, attributes=attributes, start_time=start_ns
        )
        span.end(end_time=end_ns)

    def upstream_span(self, parent: Span, worker: str, attempt: int) -> tuple[Span, bytes]:
        """One attempt on a worker, and the header lines that carry its context there."""
        attributes: dict[str, str | int] = {"urc.worker": worker, "urc.attempt": attempt}
        context = trace.set_span_in_context(parent)
        span = self.tracer.start_span("urc.upstream", context, SpanKind.CLIENT, attributes)
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, trace.set_span_in_context(span))
        lines = "".join(f"{key}: {value}\r\n" for key, value in carrier.items())
        return span, lines.encode("latin-1")

    @staticmethod
    def end(span: Span, status: int, error: str | None, attributes: Attributes) -> None:
        if status:
            span.set_attribute("http.response.status_code", status)
        span.set_attributes(attributes)
        if error is not None or status >= 500:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def close(self) -> None:
        """Send what is buffered (at shutdown)."""
        self.provider.shutdown()
