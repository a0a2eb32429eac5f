"""OpenTelemetry (docs/operability.md, "Tracing"): with --otel-endpoint, a real gateway sends
`urc.request` with its `urc.route` and `urc.upstream` children to an OTLP/HTTP collector (a tiny
one here, on 127.0.0.1), in the client's trace, and the worker gets the upstream span as its
`traceparent`."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web

from core.ports import free_port
from tests.gateway import all_exact
from tests.logs import access_line, text_lines
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker

trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2", reason="the otel extra"
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """OTLP/HTTP traces in protobuf, decoded; `spans` by name."""

    def __init__(self) -> None:
        self.spans: list = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _traces(self, request: web.Request) -> web.Response:
        export = trace_service.ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        reply = trace_service.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> Collector:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def named(self, name: str) -> list:
        return [s for s in list(self.spans) if s.name == name]


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector().start()
    yield c
    c.stop()


def test_a_request_is_a_span_with_its_route_and_upstream_in_the_clients_trace(collector):
    worker = start_worker("--log-level", "debug")  # it logs the traceparent it got
    endpoint = f"http://127.0.0.1:{collector.port}"
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s rather than 5
    gateway = start_gateway(
        [worker.url], "--otel-endpoint", endpoint, "--admin-key", "admin-secret", env=env
    )
    try:
        assert wait_for(lambda: all_exact(gateway.url, 1), 20)
        model = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": "trace me " * 30, "max_tokens": 3}
        headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "traced-1"}
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 200
        untraced = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
        assert untraced.status_code == 200
        assert wait_for(lambda: len(collector.named("urc.request")) >= 2, 10)
        assert wait_for(lambda: len(collector.named("urc.upstream")) >= 2, 10)
    finally:
        gateway.stop()
        worker.stop()
    requests = [s for s in collector.named("urc.request") if s.trace_id.hex() == TRACE_ID]
    assert len(requests) == 1
    request = requests[0]
    assert request.parent_span_id.hex() == CLIENT_SPAN
    attributes = _attributes(request)
    assert attributes["urc.request_id"] == "traced-1"
    assert attributes["urc.model"] == model and attributes["urc.tenant"] == "default"
    assert attributes["http.response.status_code"] == 200
    assert attributes["urc.prompt_tokens"] > 0 and "urc.cached_tokens" in attributes
    assert attributes["urc.worker"] == worker.url.removeprefix("http://")
    children = [
        s for s in collector.spans if s.trace_id.hex() == TRACE_ID and s.name != "urc.request"
    ]
    assert sorted(s.name for s in children) == ["urc.route", "urc.upstream"]
    assert all(s.parent_span_id == request.span_id for s in children)
    upstream = next(s for s in children if s.name == "urc.upstream")
    assert _attributes(upstream)["urc.attempt"] == 1
    # the worker was asked with the upstream span as its parent, in the client's trace
    sent = f"00-{TRACE_ID}-{upstream.span_id.hex()}-01"
    lines = text_lines(worker, "backends.http.openai_api")
    assert any(line.get("traceparent") == sent for line in lines), lines[-3:]
    # a request without a traceparent starts a trace of its own
    other = [s for s in collector.named("urc.request") if s.trace_id.hex() != TRACE_ID]
    assert other and not other[0].parent_span_id


def test_a_failover_is_one_upstream_span_per_attempt(collector):
    workers = [start_worker() for _ in range(2)]
    endpoint = f"http://127.0.0.1:{collector.port}"
    flags = ("--otel-endpoint", endpoint, "--access-log", "--admin-key", "admin-secret")
    flags += ("--policy", "round_robin", "--ttfb-timeout", "1")
    gateway = start_gateway(
        [w.url for w in workers], *flags, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}
    )
    victim = workers[0]
    try:
        assert wait_for(lambda: all_exact(gateway.url, 2), 20)
        model = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": "fail me over", "max_tokens": 2}
        victim.popen.send_signal(signal.SIGSTOP)  # it answers nothing, health checks neither
        ids = [f"failover-{i}" for i in range(2)]  # round robin: one of them goes to the victim
        for request_id in ids:
            headers = {"x-request-id": request_id}
            response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers)
            assert response.status_code == 200
        lines = [access_line(gateway, request_id) for request_id in ids]
        assert wait_for(lambda: len(collector.named("urc.request")) >= 2, 10)
    finally:
        victim.popen.send_signal(signal.SIGCONT)
        gateway.stop()
        for w in workers:
            w.stop()
    tried_twice = [line for line in lines if line["attempts"] == "2"]
    assert len(tried_twice) == 1, lines
    failed_over = next(
        s
        for s in collector.named("urc.request")
        if _attributes(s)["urc.request_id"] == tried_twice[0]["request_id"]
    )
    upstream = [s for s in collector.named("urc.upstream") if s.trace_id == failed_over.trace_id]
    assert sorted(_attributes(s)["urc.attempt"] for s in upstream) == [1, 2]
    first = next(s for s in upstream if _attributes(s)["urc.attempt"] == 1)
    assert _attributes(first)["urc.worker"] == victim.url.removeprefix("http://")
    assert first.status.code == first.status.STATUS_CODE_ERROR
    assert _attributes(failed_over)["urc.worker"] == tried_twice[0]["worker"]
