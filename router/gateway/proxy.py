"""Forwarding to the planned worker, failover while nothing has reached the client, SSE passed
through as it arrives, and the load ledger of each attempt (docs/dispatch.md, 3 and 5)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import NamedTuple

from core.errors import APIError
from core.logs import REQUEST_ID_HEADER
from router.gateway.access import RequestNote
from router.gateway.adapter_loader import AdapterLoader
from router.gateway.deadlines import Deadlines
from router.gateway.fleet import Fleet, Worker
from router.gateway.metrics import GatewayMetrics
from router.gateway.reply import Headers, Reply, request_id_line
from router.gateway.routing import Plan
from router.gateway.upstream import UpstreamError, UpstreamResponse
from router.route import LoadShare

# usage as chat and completions report it, or as the Responses API does (output_tokens)
_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_OUTPUT_RE = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
# not passed on to the client: hop-by-hop, and the request id (the reply sends the gateway's)
_DROPPED_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "content-encoding",
    REQUEST_ID_HEADER,
}


class Usage(NamedTuple):
    """What the worker reported of one request (None: not reported)."""

    cached_tokens: int | None
    output_tokens: int | None


def usage_of(body: bytes) -> Usage:
    """The usage a response body or an SSE chunk reports (None: it says nothing of it)."""
    cached = _CACHED_RE.search(body)
    output = _OUTPUT_RE.search(body)
    return Usage(int(cached.group(1)) if cached else None, int(output.group(1)) if output else None)


class _Failover(Exception):
    """The worker failed before the first byte reached the client. `answer`: it answered
    (status, headers, body) with a 5xx; None: it could not be reached or broke the exchange."""

    def __init__(self, message: str, answer: tuple[int, Headers, bytes] | None = None) -> None:
        super().__init__(message)
        self.answer = answer

    def status(self) -> int:
        return self.answer[0] if self.answer is not None else 0


class Proxy:
    def __init__(self, fleet: Fleet, metrics: GatewayMetrics, prefill_tokens_per_s: float):
        self.fleet = fleet
        self.metrics = metrics
        self.s_per_token = 1.0 / prefill_tokens_per_s
        self.request_timeout_s = fleet.config.request_timeout_s
        self.ttfb_timeout_s = fleet.config.ttfb_timeout_s
        self.deadlines = Deadlines()
        self.loader = AdapterLoader(fleet)  # LoRA adapters, loaded on demand
        self.on_load: Callable[[], None] | None = None  # flow control's pump: a load moved
        fleet.on_down.append(self.abandon)

    def abandon(self, worker: Worker) -> None:
        """`worker` left the fleet: its attempts that sent nothing to the client fail over now
        (unless it drains: then they finish there)."""
        if worker.draining:
            return
        for task in list(worker.waiting):
            self.deadlines.expire(task)

    async def forward(
        self,
        reply: Reply,
        path: str,
        payload: bytes,
        plan: Plan,
        stream: bool,
        on_success: Callable[[Plan, Worker, Usage], None],
        note: RequestNote | None = None,
        prioritized: bytes | None = None,
        extra: Headers | None = None,
        lines: bytes = b"",
    ) -> None:
        """Send the request on; the answer (or the last worker's error) goes to `reply`. A
        worker's 5xx counts against no worker's health and gets one other worker tried.
        `note`: the access log's and tracing's (None: both off). Flow control's `prioritized`
        body goes to workers that take a priority, its `extra` headers to the client, its header
        `lines` (the protect hint) to every worker."""
        t0 = time.monotonic()
        request_id = request_id_line(reply.request_id) + lines
        last_error = "no worker was up"
        answered: tuple[int, Headers, bytes] | None = None  # the first 5xx a worker answered
        workers = self.fleet.workers
        adapter = plan.model.adapter  # a LoRA adapter's: loaded first where it is not
        tried = False
        for name in plan.ranked():
            worker = workers.get(name)
            if worker is None or not worker.up:
                continue
            if adapter and (why := await self.loader.ready(worker, plan.model)) is not None:
                last_error = f"{worker.name}: adapter '{adapter}' {why}"
                continue
            tried = True
            attempt = _Attempt(self, reply, plan, worker, t0, note)
            attempt.extra = extra
            body = prioritized if prioritized is not None and worker.takes_priority else payload
            headers = request_id if note is None else request_id + note.attempt(worker.name)
            try:
                status, usage = await attempt.settled(path, body, stream, headers)
            except _Failover as failed:
                last_error = f"{worker.name}: {failed}"
                self._failed(worker, failed, note)
                if failed.answer is None:
                    continue
                if answered is not None:  # a second worker answered 5xx too: the request's
                    break
                answered = failed.answer
                continue
            attempt.answered(status, usage)
            if usage is not None:
                on_success(plan, worker, usage)
            return
        if answered is not None:
            if note is not None:
                note.answered(answered[0])
            reply.whole(*answered)
            return
        if adapter and not tried:
            message = f"no worker could load adapter '{adapter}' (last: {last_error})"
            raise APIError(503, message, type="service_unavailable", code="adapter_load_failed")
        message = f"every worker failed for model '{plan.model.name}' (last: {last_error})"
        raise APIError(502, message, type="bad_gateway", code="worker_failed")

    def _failed(self, worker: Worker, failed: _Failover, note: RequestNote | None) -> None:
        """An attempt failed over: counted; against the worker's health unless it answered."""
        if note is not None:
            note.attempt_ended(failed.status(), str(failed), None)
        self.metrics.failovers[worker.name] += 1
        if failed.answer is None:
            self.fleet.failed(worker)

    def _estimated_first_token(self, worker: Worker, load: LoadShare) -> asyncio.TimerHandle:
        """A non-streamed answer shows no first byte: its prefill leaves the ledger's queue
        when the gateway's estimate says it is done (docs/dispatch.md, 3)."""
        delay = worker.load.queued_prefill_tokens * self.s_per_token
        if self.on_load is None:
            return self.deadlines.loop().call_later(delay, load.first_token)
        return self.deadlines.loop().call_later(delay, self._first_token, load)

    def _first_token(self, load: LoadShare) -> None:
        load.first_token()
        if self.on_load is not None:
            self.on_load()


class _Attempt:
    """One try of a request on one worker, answered to `reply`."""

    def __init__(
        self,
        proxy: Proxy,
        reply: Reply,
        plan: Plan,
        worker: Worker,
        t0: float,
        note: RequestNote | None,
    ) -> None:
        self.proxy = proxy
        self.reply = reply
        self.plan = plan
        self.worker = worker
        self.kv_group = group = worker.kv_group_of(plan.model)
        model = plan.model  # an adapter's blocks come on its base's stream (Worker.exact_for)
        self.exact = worker.exact(model.base_group if model.adapter else group)
        # the lifecycle's attempt (router/route.py): this try's share of the worker's load
        self.load = plan.route.attempt(worker.name, group, self.exact, worker.load, t0)
        if plan.model.adapter:  # its slot's last use, and a request in flight on it
            proxy.fleet.adapters.use(worker.name, plan.model.adapter, t0)
        self.t0 = t0  # when the request's forwarding began
        self.note = note
        self.extra: Headers | None = None  # flow control's headers for the client

    async def settled(
        self, path: str, payload: bytes, stream: bool, headers: bytes
    ) -> tuple[int, Usage | None]:
        """`run`, its load share settled however it ends (a non-streamed answer's first token
        estimated meanwhile), and flow control told the load moved."""
        proxy = self.proxy
        timer = None if stream else proxy._estimated_first_token(self.worker, self.load)
        try:
            return await self.run(path, payload, stream, headers)
        finally:
            if timer is not None:
                timer.cancel()
            self.load.finish()
            if self.plan.model.adapter:
                proxy.fleet.adapters.finish(self.worker.name, self.plan.model.adapter)
            if proxy.on_load is not None:
                proxy.on_load()

    async def run(
        self, path: str, payload: bytes, stream: bool, headers: bytes
    ) -> tuple[int, Usage | None]:
        proxy, worker = self.proxy, self.worker
        total = proxy.request_timeout_s - (time.monotonic() - self.t0)
        ttfb = proxy.ttfb_timeout_s
        due = ttfb if ttfb < total else total
        task = proxy.deadlines.enter(due, None if stream else self.renew)
        worker.waiting.add(task)
        try:
            try:
                upstream = await worker.pool.post(path, payload, headers)
            except UpstreamError as exc:
                raise _Failover(str(exc)) from None
            now = time.monotonic()
            proxy.fleet.alive(worker, now)
            if not stream and self.note is not None:  # a whole answer's TTFT: its head
                self.note.first_byte(now)
            try:
                if stream and upstream.status == 200:
                    return 200, await self._stream(upstream, task)
                return await self._whole(upstream)
            finally:
                upstream.release()
        except asyncio.CancelledError:
            if not proxy.deadlines.expired(task):
                raise
            if self.reply.started:  # the client has part of a stream: it ends here, cut
                return 200, None
            if not worker.up:
                raise _Failover("taken out of the fleet while the request waited") from None
            raise _Failover(f"nothing came within {ttfb} s") from None
        finally:
            worker.waiting.discard(task)
            proxy.deadlines.leave(task)

    def renew(self, now: float) -> float:
        """A non-streamed answer comes whole, after the generation: it waits on while its
        worker shows signs of life (answers, health checks) within the time to first byte."""
        return now + self.worker.alive_at + self.proxy.ttfb_timeout_s - time.monotonic()

    def _first_byte(self) -> float:
        """The first byte goes to the client: the ledger and the TTFT metric; its time."""
        self.load.first_token()
        if self.proxy.on_load is not None:
            self.proxy.on_load()
        series = self.proxy.metrics.series[self.plan.model.name, self.worker.name]
        now = time.monotonic()
        series.ttft.observe(now - self.t0)
        self.plan.ttft_s = now - self.t0
        return now

    def _headers(self, upstream: UpstreamResponse) -> Headers:
        """The worker's headers for the client: hop-by-hop ones out, `x-urc-route` in."""
        plan, name = self.plan, self.worker.name
        headers = [(k, v) for k, v in upstream.headers if k.lower() not in _DROPPED_HEADERS]
        headers.append(("x-urc-route", plan.header(name)))
        return headers + self.extra if self.extra else headers  # flow control's, if any

    async def _whole(self, upstream: UpstreamResponse) -> tuple[int, Usage | None]:
        """A non-streamed answer, checked before anything reaches the client."""
        try:
            body = await upstream.read()
        except UpstreamError as exc:
            raise _Failover(str(exc)) from None
        status = upstream.status
        if status >= 500:  # nothing reached the client yet: the next worker may serve it
            self.proxy.metrics.statuses[self.plan.model.name, self.worker.name, status] += 1
            raise _Failover(f"answered {status}", (status, self._headers(upstream), body))
        stripped = body.strip()  # a cheap sanity check (the client parses the body)
        if status == 200 and not (stripped[:1] == b"{" and stripped[-1:] == b"}"):
            raise _Failover("answered 200 with a body that is not a JSON object")
        self._first_byte()
        usage = None
        if status == 200:
            usage = usage_of(body)
            if usage.cached_tokens is None:
                usage = Usage(_header_int(upstream), usage.output_tokens)
        self.reply.whole(status, self._headers(upstream), body)
        return status, usage

    async def _stream(self, upstream: UpstreamResponse, task: asyncio.Task[object]) -> Usage | None:
        """Pass the SSE stream through as it comes; usage (None: the client left early)."""
        reply = self.reply
        headers = self._headers(upstream)
        cached = _header_int(upstream)
        output: int | None = None
        events = 0
        first = True
        try:
            while (chunk := await upstream.next_chunk()) is not None:
                if first:
                    if not chunk.lstrip().startswith((b"data:", b":", b"event:")):
                        raise _Failover("answered 200 with a stream that is not SSE")
                    first = False
                    # the first byte goes to the client: no failover from here, only the total
                    self.worker.waiting.discard(task)
                    total = self.proxy.request_timeout_s - (time.monotonic() - self.t0)
                    self.proxy.deadlines.rearm(task, total)
                    at = self._first_byte()
                    if self.note is not None:
                        self.note.first_byte(at)
                    await reply.start(upstream.status, headers)
                events += chunk.count(b"data:")
                if b'"usage"' in chunk:
                    said = usage_of(chunk)
                    if said.cached_tokens is not None:
                        cached = said.cached_tokens
                    if said.output_tokens is not None:
                        output = said.output_tokens
                if not await reply.send(chunk):
                    return None  # the client went away: stop reading, free the worker
        except UpstreamError as exc:
            if first:  # not a byte reached the client: the next worker may serve it
                raise _Failover(f"{exc.__class__.__name__}: {exc}") from None
            return None  # the client has a partial stream; nothing more can be done
        if first:
            await reply.start(upstream.status, headers)
        if not await reply.end():
            return None
        # without a usage chunk, one content event per token less the closing [DONE]
        return Usage(cached, output if output is not None else max(events - 1, 0))

    def answered(self, status: int, usage: Usage | None) -> None:
        """The answer went to the client: the worker's health and the metrics."""
        now = time.monotonic()
        plan, worker = self.plan, self.worker
        self.proxy.fleet.answered(worker, status, now)
        self.proxy.metrics.statuses[plan.model.name, worker.name, status] += 1
        series = self.proxy.metrics.series[plan.model.name, worker.name]
        series.latency.observe(now - self.t0)
        if self.note is not None:
            self.note.attempt_ended(status, None, usage.cached_tokens if usage else None)
        if usage is not None:
            plan.route.done(worker.name, self.kv_group, self.exact, now)
        if usage is not None and plan.prefix_cache:
            predicted, host = plan.matched(worker.name), plan.host_matched(worker.name)
            series.prediction(plan.request.prompt_tokens, predicted, usage.cached_tokens, host)


def _header_int(upstream: UpstreamResponse) -> int | None:
    value = upstream.header("x-urc-cached-tokens")
    return int(value) if value is not None and value.isdigit() else None
