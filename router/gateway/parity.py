"""Token parity: the gateway's keys are the engine's only if both make the same token ids of a
request. Probes compare the counts, and a kv_group of a worker that disagrees is routed in
approximate mode until one matches again (docs/block-keys.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.gateway.fleet import Fleet, Worker

log = logging.getLogger(__name__)
_TIMEOUT_S = 30.0  # a probe's answer: one output token, behind whatever the worker runs

# Text that tokenizers disagree on: casing, digits, punctuation runs, spacing, non-ASCII.
PROBE_TEXT = (
    "Parity probe: The QUICK brown fox, 1234567 jumps over 89 lazy dogs!!  Tabs\tand\nnewlines; "
    "café naïve façade, 東京 and émoji 🙂 -- the end."
)
PROBE_CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "You are a parity probe. Answer in one word."},
    {"role": "user", "content": PROBE_TEXT},
]
# kind -> (path, the prompt's field, the prompt)
_PROBES: dict[str, tuple[str, str, object]] = {
    "chat": ("/v1/chat/completions", "messages", PROBE_CHAT),
    "completion": ("/v1/completions", "prompt", PROBE_TEXT),
}


@dataclass(slots=True)
class ParityState:
    """The last verdict for one (worker, model)."""

    ok: bool | None = None  # None: never answered
    expected: dict[str, int] | None = None  # the gateway's counts, by "chat"/"completion"
    actual: dict[str, int] | None = None  # the worker's usage.prompt_tokens
    checks: int = 0
    mismatches: int = 0
    errors: int = 0


class ParityProbe(Collector):
    """Probes the fleet's workers (`on_up`: Fleet's hook, `run`: the loop); exports verdicts."""

    def __init__(self, fleet: Fleet, interval_s: float) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        self.states: dict[tuple[str, str], ParityState] = {}
        self.downgraded: set[tuple[str, str]] = set()  # (worker, kv_group)
        self._tasks: set[asyncio.Task[None]] = set()

    def on_up(self, worker: Worker) -> None:
        """A worker came (back) up: its streams were restarted, so downgrades are redone."""
        self.downgraded = {d for d in self.downgraded if d[0] != worker.name}
        task = asyncio.get_running_loop().create_task(self.probe(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            workers = [w for w in self.fleet.workers.values() if w.up]
            await asyncio.gather(*(self.probe(w) for w in workers), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def describe(self) -> list[dict[str, Any]]:
        """The last verdict per (worker, model), for GET /admin/workers."""
        return [
            {"worker": worker, "model": model, **asdict(state)}
            for (worker, model), state in sorted(self.states.items())
        ]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker", "model"]
        doc = "1 if the worker counts the probe's prompt tokens as the gateway does, 0 if not"
        parity = GaugeMetricFamily("urc_tokenizer_parity", doc, labels=labels)
        doc = "Parity probes whose prompt-token counts differed"
        mismatches = CounterMetricFamily("urc_tokenizer_parity_mismatches", doc, labels=labels)
        doc = "Parity probes that got no usable answer"
        errors = CounterMetricFamily("urc_tokenizer_parity_probe_errors", doc, labels=labels)
        fleet = self.fleet.workers
        for (worker, model), state in list(self.states.items()):
            if worker not in fleet:  # removed from the fleet
                continue
            if state.ok is not None:
                parity.add_metric([worker, model], float(state.ok))
            mismatches.add_metric([worker, model], state.mismatches)
            errors.add_metric([worker, model], state.errors)
        yield from (parity, mismatches, errors)

    async def probe(self, worker: Worker) -> None:
        """One probe per kv_group the worker serves (through the first model of the group)."""
        by_group: dict[str, str] = {}
        for name, group in worker.models.items():
            by_group.setdefault(group, name)
        for group, name in by_group.items():
            await self._probe_group(worker, group, name)

    async def _probe_group(self, worker: Worker, group: str, name: str) -> None:
        model = self.fleet.models.get(name)
        if model is None:
            return
        state = self.states.setdefault((worker.name, name), ParityState())
        tokenizer = model.tokenizer
        expected = {"completion": len(tokenizer.encode(PROBE_TEXT))}
        with contextlib.suppress(ValueError):  # no chat template: only completions compare
            expected = {"chat": len(tokenizer.encode_chat(PROBE_CHAT)), **expected}
        actual: dict[str, int] = {}
        for kind in expected:
            count = await self._prompt_tokens(worker, name, kind)
            if count is None:
                state.errors += 1
                return
            actual[kind] = count
        state.checks += 1
        state.expected, state.actual = expected, actual
        ok = expected == actual
        if not ok:
            state.mismatches += 1
            message = (
                "tokenizer parity: worker %s model %s counts %s prompt tokens, the gateway %s: "
                "its kv_group %s is routed in approximate mode"
            )
            log.warning(message, worker.name, name, actual, expected, group)
            await self._downgrade(worker, group)
        elif state.ok is False:
            log.warning("tokenizer parity: worker %s model %s matches again", worker.name, name)
            self._restore(worker, group)
        state.ok = ok

    async def _prompt_tokens(self, worker: Worker, model: str, kind: str) -> int | None:
        """The worker's usage.prompt_tokens for the probe (None: no usable answer)."""
        session = self.fleet.session
        if session is None or not worker.up:
            return None
        path, field, prompt = _PROBES[kind]
        body = {"model": model, "max_tokens": 1, "temperature": 0.0, field: prompt}
        timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
        try:
            async with session.post(worker.url + path, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    log.info("parity probe of %s answered %d", worker.name, resp.status)
                    return None
                data = await resp.json(content_type=None)
            count = data["usage"]["prompt_tokens"]
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            log.info("parity probe of %s failed: %s", worker.name, exc)
            return None
        return count if type(count) is int else None

    async def _downgrade(self, worker: Worker, group: str) -> None:
        if (worker.name, group) in self.downgraded:
            return
        self.downgraded.add((worker.name, group))
        for stream in worker.streams:
            if stream.kv_group == group:
                await stream.stop()
        self.fleet.index.clear(worker.name, group)

    def _restore(self, worker: Worker, group: str) -> None:
        if (worker.name, group) not in self.downgraded:
            return
        self.downgraded.discard((worker.name, group))
        if not worker.up:
            return  # its streams start again when it comes up
        self.fleet.index.clear(worker.name, group)  # the approximate entries make way
        for stream in worker.streams:
            if stream.kv_group == group and not stream.active:
                stream.start(self.fleet.index, worker.name, worker.block_size, self.fleet.ingest)
