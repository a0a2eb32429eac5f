"""The load feed: each up worker's own load merged into its ledger, so gateway replicas in front
of one fleet, and clients that bypass them, see one load picture (docs/dispatch.md, "Load the
workers report"). Ours push it (a ZMQ subscription to `load_events` of /urc/info); the others
are sampled every `load_interval_s` (`GET /urc/load`; vLLM and SGLang: `GET /metrics`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.gateway.fleet import Fleet, Worker
from router.gateway.load_report import (
    Reported,
    Sample,
    forget,
    merge,
    missed,
    parse_prometheus,
    parse_urc,
)

log = logging.getLogger(__name__)
_PROMETHEUS_ENGINES = ("vllm", "sglang")
_SILENCE_S = 1.5  # a pushing worker sends a heartbeat each second: longer silence is a miss


def first_source(worker: Worker) -> str:
    """Where a worker's load is read first: vLLM and SGLang export Prometheus gauges; anything
    else is asked `/urc/load`, falling back to `/metrics` on a 404."""
    return "prometheus" if worker.config.engine in _PROMETHEUS_ENGINES else "urc"


class LoadFeed(Collector):
    """One task (`run`) for the whole fleet; a Prometheus collector of what the workers said."""

    def __init__(self, fleet: Fleet, interval_s: float) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        # a sample that takes longer is missed: it would be stale when it came
        self.timeout = aiohttp.ClientTimeout(total=max(0.25, 4 * interval_s))
        self.reported: dict[Worker, Reported] = {}
        self.pushed: dict[Worker, asyncio.Task[None]] = {}  # its subscription, per worker
        self._ctx = zmq.asyncio.Context.instance()
        self.on_merge: Callable[[], None] | None = None  # flow control's pump: a load came

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.sample_all()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - began)))

    async def sample_all(self) -> None:
        """One round: every up worker sampled at once; those gone or down drop their part."""
        workers = self.fleet.workers.values()
        for worker in [w for w in self.reported if self.fleet.workers.get(w.name) is not w]:
            del self.reported[worker]
            self._unsubscribe(worker)
        due: list[tuple[Worker, Reported]] = []
        for worker in workers:
            reported = self.reported.get(worker)
            if reported is None:
                reported = self.reported[worker] = Reported(first_source(worker))
            if not worker.up:  # it may come back another process: ask afresh then
                self._unsubscribe(worker)
                forget(worker.load, reported)
                reported.source, reported.sample = first_source(worker), None
            elif worker.load_endpoint and reported.source in ("urc", "push"):
                if worker not in self.pushed:
                    reported.source = "push"
                    task = asyncio.get_running_loop().create_task(self._subscribe(worker, reported))
                    self.pushed[worker] = task
            elif reported.source != "none":
                due.append((worker, reported))
        if due:
            await asyncio.gather(*(self._sample(w, r) for w, r in due))

    async def _subscribe(self, worker: Worker, reported: Reported) -> None:
        """Merge each load the worker pushes as it comes; silence past a heartbeat is a miss."""
        assert worker.load_endpoint is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 16)
        sub.setsockopt(zmq.CONFLATE, 1)  # only the newest load matters
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(worker.load_endpoint)
        try:
            while True:
                if not await sub.poll(_SILENCE_S * 1000, zmq.POLLIN):
                    missed(worker.load, reported)
                    continue
                try:
                    sample = parse_urc(await sub.recv())
                except ValueError as exc:
                    log.debug("bad load from %s: %s", worker.name, exc)
                    continue
                merge(worker.load, reported, sample, time.monotonic())
                self._lora(worker, sample)
                if self.on_merge is not None:
                    self.on_merge()
        finally:
            sub.close(linger=0)

    def _unsubscribe(self, worker: Worker) -> None:
        task = self.pushed.pop(worker, None)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        for worker in list(self.pushed):
            self._unsubscribe(worker)

    async def _sample(self, worker: Worker, reported: Reported) -> None:
        try:
            sample = await self._fetch(worker, reported)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.debug("load sample of %s failed: %s", worker.name, exc)
            missed(worker.load, reported)
            return
        if sample is None:
            log.warning("worker %s reports no load (/urc/load, /metrics): no feed", worker.name)
            reported.source = "none"
            forget(worker.load, reported)
            return
        merge(worker.load, reported, sample, time.monotonic())
        self._lora(worker, sample)
        if self.on_merge is not None:
            self.on_merge()

    def _lora(self, worker: Worker, sample: Sample) -> None:
        """Its active LoRA adapters and slots, where it says them (docs/adapters.md)."""
        if sample.lora is not None:
            self.fleet.adapters.observe_active(worker.name, *sample.lora)

    async def _fetch(self, worker: Worker, reported: Reported) -> Sample | None:
        """The worker's sample; None when it has none to give (its source becomes "none")."""
        session = self.fleet.session
        assert session is not None
        if reported.source == "urc":
            async with session.get(worker.url + "/urc/load", timeout=self.timeout) as resp:
                if resp.status == 200:
                    return parse_urc(await resp.read())
                if resp.status != 404:
                    raise ValueError(f"/urc/load answered {resp.status}")
            reported.source = "prometheus"  # not ours after all (or an older worker of ours)
        async with session.get(worker.url + "/metrics", timeout=self.timeout) as resp:
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise ValueError(f"/metrics answered {resp.status}")
            return parse_prometheus(await resp.read())

    def report(self, worker: Worker) -> dict[str, Any] | None:
        """`/admin/workers`' "reported": the last sample, its age, and the others' share."""
        reported = self.reported.get(worker)
        if reported is None or reported.sample is None:
            return None if reported is None else {"source": reported.source, "sample": None}
        return {
            "source": reported.source,
            **reported.sample._asdict(),
            "age_s": round(time.monotonic() - reported.at, 3),
            "missed": reported.missed,
            "others": {
                "in_flight": reported.others_in_flight,
                "queued_prefill_tokens": reported.others_queued,
                "running_decode": reported.others_running,
            },
        }

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = partial(GaugeMetricFamily, labels=["worker"])
        waiting = gauge("urc_worker_reported_waiting", "Requests queued, as the worker says")
        running = gauge("urc_worker_reported_running", "Requests running, as the worker says")
        doc = "Prefill tokens queued, as the worker says (or estimated from its waiting requests)"
        queued = gauge("urc_worker_reported_queued_prefill_tokens", doc)
        usage = gauge("urc_worker_reported_kv_usage", "Share of its KV pool in use, 0..1")
        age = gauge("urc_worker_reported_age_seconds", "Seconds since its last load sample")
        doc = "Requests in flight there that this gateway did not send (from its last sample)"
        others = gauge("urc_worker_others_in_flight", doc)
        now = time.monotonic()
        for worker, reported in list(self.reported.items()):
            sample = reported.sample
            if sample is None:
                continue
            name = [worker.name]
            waiting.add_metric(name, sample.waiting)
            running.add_metric(name, sample.running)
            if sample.queued_prefill_tokens is not None:
                queued.add_metric(name, sample.queued_prefill_tokens)
            usage.add_metric(name, sample.kv_usage)
            age.add_metric(name, now - reported.at)
            others.add_metric(name, reported.others_in_flight)
        yield from (waiting, running, queued, usage, age, others)
