"""What one request did, for its access line (logger `urc.access`) and its spans (tracing.py):
noted only while --access-log or --otel-endpoint is on; off, the request path makes no note at
all (docs/operability.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from router.gateway.routing import Plan
    from router.gateway.tracing import Tracing

ACCESS = logging.getLogger("urc.access")
_SPAN_FIELDS = (  # of the access line, as the request span's attributes (urc.NAME)
    "request_id",
    "tenant",
    "model",
    "worker",
    "prompt_tokens",
    "matched_tokens",
    "cached_tokens",
    "reason",
    "attempts",
)
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before its answer


class Observer:
    """Made once per gateway process when the access log or tracing is on."""

    def __init__(self, access_log: bool, otel_endpoint: str) -> None:
        self.access_log = access_log
        self.tracing: Tracing | None = None
        if otel_endpoint:
            from router.gateway.tracing import Tracing  # the otel extra, loaded only when on

            self.tracing = Tracing(otel_endpoint)

    def begin(self, request_id: str, path: str, headers: Mapping[str, str]) -> RequestNote:
        note = RequestNote(self, request_id, path)
        if self.tracing is not None:
            note.span = self.tracing.request_span(headers, path, note.wall_ns)
        return note

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


@dataclass(slots=True, eq=False)
class RequestNote:
    """One request: what is known of it so far; `finish` writes the line and ends the spans."""

    observer: Observer
    request_id: str
    path: str
    started: float = field(default_factory=time.monotonic)
    wall_ns: int = field(default_factory=time.time_ns)  # the spans' clock at `started`
    tenant: str | None = None
    model: str | None = None
    stream: bool | None = None
    plan: Plan | None = None
    worker: str | None = None  # the last worker tried
    attempts: int = 0
    status: int = 0  # 0: no answer yet
    first_byte_at: float = 0.0  # monotonic; non-streamed: the worker's answer head
    cached_tokens: int | None = None
    error: str | None = None
    span: Span | None = None  # the request's, while tracing is on
    upstream: Span | None = None  # the attempt under way

    def _ns(self, monotonic: float) -> int:
        return self.wall_ns + int((monotonic - self.started) * 1e9)

    def parsed(self, tenant: str, body: dict[str, Any]) -> None:
        model = body.get("model")
        self.tenant = tenant
        self.model = model if isinstance(model, str) else None
        self.stream = body.get("stream") is True

    def routed(self, plan: Plan) -> None:
        self.plan = plan
        tracing, span = self.observer.tracing, self.span
        if tracing is not None and span is not None:
            decision = plan.decision
            attributes: dict[str, str | int | bool] = {
                "urc.policy": plan.policy,
                "urc.worker": decision.worker,
                "urc.reason": decision.reason,
                "urc.prompt_tokens": plan.request.prompt_tokens,
                "urc.matched_tokens": plan.matched(decision.worker),
                "urc.candidates": len(decision.candidates),
            }
            start = self._ns(plan.arrived)
            tracing.route_span(span, start, start + int(plan.decision_s * 1e9), attributes)

    def attempt(self, worker: str) -> bytes:
        """An attempt on `worker` begins: the header lines that go with it (traceparent)."""
        self.worker = worker
        self.attempts += 1
        tracing, span = self.observer.tracing, self.span
        if tracing is None or span is None:
            return b""
        self.upstream, lines = tracing.upstream_span(span, worker, self.attempts)
        return lines

    def first_byte(self, at: float) -> None:
        self.first_byte_at = at

    def attempt_ended(self, status: int, error: str | None, cached_tokens: int | None) -> None:
        """The attempt answered `status` (0: none), or failed with `error`."""
        if status:
            self.status = status
            self.cached_tokens = cached_tokens
        upstream, self.upstream = self.upstream, None
        tracing = self.observer.tracing
        if upstream is not None and tracing is not None:
            attributes = {} if cached_tokens is None else {"urc.cached_tokens": cached_tokens}
            tracing.end(upstream, status, error, attributes)

    def answered(self, status: int) -> None:
        """The answer the client got (a worker's 5xx after failover)."""
        self.status = status

    def failed(self, status: int, error: str) -> None:
        """The gateway's own error answer (or 499/500: the client left, a bug)."""
        self.status = status
        self.error = error

    def failed_by(self, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self.failed(CLIENT_CLOSED, "the client closed the connection")
        else:
            self.failed(500, f"internal error: {exc.__class__.__name__}")

    def fields(self, now: float) -> dict[str, Any]:
        plan, worker = self.plan, self.worker
        matched = plan.matched(worker) if plan is not None and worker is not None else None
        ttft = self.first_byte_at - self.started if self.first_byte_at else None
        return {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "stream": self.stream,
            "worker": worker,
            "prompt_tokens": plan.request.prompt_tokens if plan is not None else None,
            "matched_tokens": matched,
            "cached_tokens": self.cached_tokens,
            "status": self.status,
            "ttft_ms": _ms(ttft) if ttft is not None else None,
            "latency_ms": _ms(now - self.started),
            "reason": plan.decision.reason if plan is not None else None,
            "attempts": self.attempts,
            "error": self.error,
        }

    def finish(self) -> None:
        """The request is over: its access line, its spans ended."""
        fields = self.fields(time.monotonic())
        if self.observer.access_log:
            ACCESS.info("POST %s", self.path, extra={"fields": fields})
        if self.upstream is not None:  # cut short (the client left mid-attempt)
            self.attempt_ended(0, self.error or "cancelled", None)
        tracing, span = self.observer.tracing, self.span
        if tracing is not None and span is not None:
            attributes = {f"urc.{k}": fields[k] for k in _SPAN_FIELDS if fields[k] is not None}
            tracing.end(span, self.status, self.error, attributes)
