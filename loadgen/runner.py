"""The async load engine: specs -> streamed requests on one aiohttp session -> results, in a
closed or an open loop (docs/loadgen.md). Failures are results, never exceptions."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple, TextIO

import aiohttp

from loadgen.client import RequestResult, base_url, stream_request
from loadgen.sessions import SessionQueue
from loadgen.workloads import RequestSpec, with_poisson_arrivals


class KeyRing:
    """API keys by tenant from `KEY` or `TENANT=KEY` entries: other tenants take the plain keys
    in order of first appearance (cycling); no tenant takes the first plain key."""

    def __init__(self, entries: Sequence[str] = ()) -> None:
        self.by_tenant: dict[str, str] = {}
        self.plain: list[str] = []
        for entry in entries:
            tenant, sep, key = entry.partition("=")
            if sep and tenant:
                self.by_tenant[tenant] = key
            else:
                self.plain.append(entry)
        self._assigned: dict[str, str | None] = {}

    def key_for(self, tenant: str | None) -> str | None:
        if tenant is None:
            return self.plain[0] if self.plain else None
        if tenant in self.by_tenant:
            return self.by_tenant[tenant]
        if tenant not in self._assigned:
            n = len(self._assigned)
            self._assigned[tenant] = self.plain[n % len(self.plain)] if self.plain else None
        return self._assigned[tenant]


@dataclass(slots=True)
class BenchConfig:
    target: str
    concurrency: int = 8  # closed loop: requests kept in flight
    rate: float | None = None  # open loop: Poisson arrivals at this many requests/s
    replay_arrivals: bool = False  # open loop on the specs' own arrival_s
    duration_s: float | None = None
    max_requests: int | None = None
    api_keys: KeyRing = field(default_factory=KeyRing)
    timeout_s: float = 600.0  # per request
    grace_s: float = 10.0  # after duration_s, for requests in flight
    max_in_flight: int = 1024  # open loop cap and pool size
    seed: int = 0
    progress: bool = False
    progress_total: int | None = None  # for the progress line, when known

    @property
    def open_loop(self) -> bool:
        return self.rate is not None or self.replay_arrivals

    @property
    def slots(self) -> int:
        return self.max_in_flight if self.open_loop else self.concurrency


class RunResult(NamedTuple):
    results: list[RequestResult]  # by spec index
    wall_s: float  # from the first send to the last answer (or cancellation)
    dropped: int  # session turns never sent because an earlier turn failed


class _Engine:
    def __init__(self, http: aiohttp.ClientSession, config: BenchConfig) -> None:
        self.http = http
        self.config = config
        self.url_v1 = base_url(config.target)
        self.queue = SessionQueue()
        self.results: list[RequestResult] = []
        self.in_flight: set[asyncio.Task[None]] = set()  # for cancellation at the end
        self.active = 0  # requests not yet completed (a task's done-callback runs too late)
        self.wake = asyncio.Event()
        self.stopping = False
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        """End the run as if its duration had passed (Ctrl-C): a partial report, not a trace."""
        self.stopping = True
        self.wake.set()

    def _spawn(self, spec: RequestSpec) -> None:
        result = RequestResult.for_spec(spec, time.perf_counter() - self.t0)
        self.results.append(result)
        task = asyncio.create_task(self._one(spec, result))
        self.active += 1
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def _one(self, spec: RequestSpec, result: RequestResult) -> None:
        key = self.config.api_keys.key_for(spec.tenant)
        try:
            reply = await stream_request(
                self.http, self.url_v1, spec, result, key, self.config.timeout_s
            )
            self.queue.complete(spec, reply)
        finally:
            self.active -= 1
            self.wake.set()

    async def run(self, source: Iterator[RequestSpec]) -> None:
        cfg = self.config
        lookahead = max(64, 4 * cfg.slots)  # turns parked behind their session, at most
        deadline = self.t0 + cfg.duration_s if cfg.duration_s is not None else math.inf
        upcoming = next(source, None) if cfg.open_loop else None  # open loop: not yet arrived
        exhausted = cfg.open_loop and upcoming is None
        while True:
            self.wake.clear()
            now = time.perf_counter()
            if now >= deadline or self.stopping:
                break
            while upcoming is not None and self.t0 + (upcoming.arrival_s or 0.0) <= now:
                self.queue.add(upcoming)
                upcoming = next(source, None)
                exhausted = upcoming is None
            while self.active < cfg.slots:
                spec = self.queue.take()
                if spec is not None:
                    self._spawn(spec)
                    continue
                if cfg.open_loop or exhausted or self.queue.waiting >= lookahead:
                    break
                nxt = next(source, None)  # closed loop: pull the next spec when a slot is free
                if nxt is None:
                    exhausted = True
                else:
                    self.queue.add(nxt)
            if exhausted and self.active == 0 and self.queue.ready == 0:
                break
            wait_s = deadline - now
            if upcoming is not None:
                wait_s = min(wait_s, self.t0 + (upcoming.arrival_s or 0.0) - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s if math.isfinite(wait_s) else None):
                    await self.wake.wait()
        if self.in_flight:
            _, late = await asyncio.wait(set(self.in_flight), timeout=cfg.grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for result in self.results:
            if result.error is None and result.latency_s is None:  # cancelled before it began
                result.error, result.detail = "cancelled", "still in flight when the run ended"

    async def show_progress(self, out: TextIO) -> None:
        try:
            while True:
                await asyncio.sleep(0.25)
                self._write_progress(out)
        finally:  # cancelled at the end of the run: the last line stays
            self._write_progress(out, "\n")

    def _write_progress(self, out: TextIO, end: str = "") -> None:
        elapsed = time.perf_counter() - self.t0
        done = len(self.results) - self.active
        errors = sum(1 for r in self.results if r.error is not None)
        total = self.config.progress_total
        of = f"/{total}" if total is not None else ""
        rate = done / elapsed if elapsed > 0 else 0.0
        out.write(
            f"\r[urc bench] {done}{of} done  {self.active} in flight  {errors} errors  "
            f"{rate:.1f} req/s  {elapsed:.1f}s {end}"
        )
        out.flush()


async def run_bench(
    specs: Iterable[RequestSpec], config: BenchConfig, stop_on_sigint: bool = False
) -> RunResult:
    """Send `specs` as `config` says; with `stop_on_sigint`, Ctrl-C ends the run (grace period)."""
    source: Iterator[RequestSpec] = iter(specs)
    if config.max_requests is not None:
        source = islice(source, config.max_requests)
    if config.rate is not None:
        source = with_poisson_arrivals(source, config.rate, config.seed)
    connector = aiohttp.TCPConnector(limit=config.slots, limit_per_host=0)
    # the per-request deadline is `timeout_s` (asyncio.timeout in stream_request)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as http:
        engine = _Engine(http, config)
        progress = None
        if config.progress:
            progress = asyncio.create_task(engine.show_progress(sys.stderr))
        loop = asyncio.get_running_loop()
        if stop_on_sigint:
            loop.add_signal_handler(signal.SIGINT, engine.stop)
        try:
            await engine.run(source)
        finally:
            if stop_on_sigint:
                loop.remove_signal_handler(signal.SIGINT)
            if progress is not None:
                progress.cancel()
                await asyncio.gather(progress, return_exceptions=True)
        wall_s = time.perf_counter() - engine.t0
    results = sorted(engine.results, key=lambda r: r.index)
    return RunResult(results, wall_s, engine.queue.dropped)
