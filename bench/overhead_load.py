"""The load of bench/gateway_overhead.py: prompts sharing prefixes per group, requests timed
per target (paired blocks for latency, closed loops for throughput), CPU per process role."""

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from harness import cpu_seconds, log, machine_cpu_seconds, percentile

from core.text import filler
from urc.processes import JSON_HEADERS

MODEL = "emulated"


@dataclass(slots=True)
class Prompt:
    group: int
    tokens: int
    bodies: tuple[bytes, bytes]  # (non-streamed, streamed) request bodies


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a > 0 and b > 0 else "n/a"  # NaN compares false: n/a too


def build_prompts(args: argparse.Namespace) -> list[Prompt]:
    """A group's prefix + a unique suffix of 16..prefix tokens (one ASCII byte = one token)."""
    rng = random.Random(args.seed)
    key = f"overhead/{args.seed}"
    prefixes = [
        f"group {g}: " + filler(args.prefix_tokens, f"{key}/{g}") for g in range(args.groups)
    ]
    prompts = []
    for i in range(args.prompts):
        group = i % args.groups
        suffix = f" request {i}: " + filler(rng.randint(16, args.prefix_tokens), f"{key}/r{i}")
        base: dict[str, Any] = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0}
        if args.api == "chat":
            base["messages"] = [
                {"role": "system", "content": prefixes[group]},
                {"role": "user", "content": suffix},
            ]
        else:
            base["prompt"] = prefixes[group] + suffix
        bodies = (json.dumps(base).encode(), json.dumps({**base, "stream": True}).encode())
        prompts.append(Prompt(group, len(prefixes[group]) + len(suffix), bodies))
    return prompts


@dataclass(slots=True)
class Sample:
    ok: bool
    total_s: float
    ttfb_s: float  # time to the first body byte (non-streamed: the whole response)


@dataclass(slots=True)
class Target:
    """Where requests go: straight to the workers (by group) or to one router."""

    name: str
    urls: list[str]
    path: str
    pid: int | None  # the router process (None: direct)

    async def send(self, session: aiohttp.ClientSession, prompt: Prompt, stream: bool) -> Sample:
        url = self.urls[prompt.group % len(self.urls)] + self.path
        t0 = time.perf_counter()
        first = math.nan
        try:
            async with session.post(url, data=prompt.bodies[stream], headers=JSON_HEADERS) as resp:
                if stream:
                    tail = b""
                    async for chunk in resp.content.iter_any():
                        if first != first:  # NaN: this is the first chunk
                            first = time.perf_counter()
                        tail = (tail + chunk)[-32:]
                    ok = resp.status == 200 and tail.rstrip().endswith(b"[DONE]")
                else:
                    data = await resp.read()
                    first = time.perf_counter()
                    ok = resp.status == 200 and data.startswith(b"{")
        except (aiohttp.ClientError, TimeoutError):
            return Sample(False, math.nan, math.nan)
        end = time.perf_counter()
        return Sample(ok, end - t0, first - t0)


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds of every process of the run while a target is measured (wall too)."""

    pids: dict[str, list[int]]  # role -> pids; "loadgen" (this process), "machine" (all CPUs)
    spent: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # target -> role -> s
    wall: dict[str, float] = field(default_factory=dict)

    def snapshot(self) -> tuple[float, dict[str, list[float]]]:
        now = {"loadgen": [time.process_time()]}
        now.update((role, [cpu_seconds(p) for p in pids]) for role, pids in self.pids.items())
        now["machine"] = [machine_cpu_seconds()]
        return time.perf_counter(), now

    def add(self, target: str, before: tuple[float, dict[str, list[float]]]) -> float:
        """Adds what was spent since `before` (a snapshot); returns the wall seconds."""
        wall, after = self.snapshot()
        spent = self.spent.setdefault(target, {})
        for role, values in after.items():
            old = spent.get(role, [0.0] * len(values))
            spent[role] = [s + a - b for s, a, b in zip(old, values, before[1][role], strict=True)]
        self.wall[target] = self.wall.get(target, 0.0) + wall - before[0]
        return wall - before[0]


async def lanes(
    session: aiohttp.ClientSession,
    target: Target,
    prompts: Iterable[Prompt],
    concurrency: int,
    stream: bool,
    seconds: float = math.inf,
) -> list[Sample]:
    """Send `prompts` with `concurrency` in flight until they run out or `seconds` have passed;
    samples in prompt order."""
    samples: dict[int, Sample] = {}
    todo = enumerate(prompts)
    deadline = time.perf_counter() + seconds

    async def lane() -> None:
        for i, prompt in todo:
            if time.perf_counter() >= deadline:
                return
            samples[i] = await target.send(session, prompt, stream)

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return [samples[i] for i in sorted(samples)]


@dataclass(slots=True)
class LatencyRow:
    metric: str  # "non-streamed total", "streamed TTFB", "streamed total"
    concurrency: int
    pairs: int
    direct_p50_ms: float
    direct_p99_ms: float
    added_p50_ms: dict[str, float]  # router -> p50 of (router - direct)
    added_p99_ms: dict[str, float]
    added_mean_ms: dict[str, float]  # at equal throughput, Little's law fixes the mean
    failed: dict[str, int]


@dataclass(slots=True)
class ThroughputRow:
    metric: str
    concurrency: int
    rps: dict[str, float]  # target -> median requests/s over rounds
    rounds: dict[str, list[float]]
    failed: dict[str, int]
    cpu_us_per_request: dict[str, dict[str, float]]  # target -> role -> CPU µs per request
    busy_cores: dict[str, dict[str, float]]  # target -> role -> cores busy on average
    worker_split: dict[str, list[float]]  # target -> share of worker CPU per worker


@dataclass(slots=True)
class Result:
    latency: list[LatencyRow]
    throughput: list[ThroughputRow]
    measure_s: float


def rotated(targets: list[Target], r: int) -> list[Target]:
    """Round `r`'s order: each target leads in turn, so slow noise hits all of them alike."""
    return targets[r % len(targets) :] + targets[: r % len(targets)]


def session_for(concurrency: int, targets: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=concurrency * targets, limit_per_host=concurrency, force_close=False
    )
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))


async def latency_rows(
    targets: list[Target], prompts: list[Prompt], concurrency: int, requests: int
) -> list[LatencyRow]:
    size = max(8, concurrency * 2)  # short blocks, many rounds: slow noise hits all alike
    rounds = max(1, math.ceil(requests / size))
    rows = []
    async with session_for(concurrency, len(targets)) as session:
        for stream in (False, True):
            got: dict[str, list[Sample]] = {t.name: [] for t in targets}
            for r in range(rounds):
                chunk = [prompts[(r * size + i) % len(prompts)] for i in range(size)]
                for target in rotated(targets, r):
                    got[target.name] += await lanes(session, target, chunk, concurrency, stream)
            metrics = [("streamed TTFB", "ttfb_s"), ("streamed total", "total_s")]
            for metric, attr in metrics if stream else [("non-streamed total", "total_s")]:
                rows.append(paired_row(metric, attr, concurrency, targets, got))
    return rows


def paired_row(
    metric: str, attr: str, concurrency: int, targets: list[Target], got: dict[str, list[Sample]]
) -> LatencyRow:
    """Each router's i-th sample minus direct's i-th (`attr` of both), where both succeeded."""
    base = got[targets[0].name]
    ok_direct = [getattr(s, attr) for s in base if s.ok]
    direct_ms = [percentile(ok_direct, q) * 1e3 for q in (0.5, 0.99)]
    failed = {t.name: sum(not s.ok for s in got[t.name]) for t in targets}
    row = LatencyRow(metric, concurrency, 0, *direct_ms, {}, {}, {}, failed)
    for router in targets[1:]:
        diffs = [
            getattr(t, attr) - getattr(d, attr)
            for d, t in zip(base, got[router.name], strict=True)
            if d.ok and t.ok
        ]
        row.pairs = len(diffs)
        row.added_p50_ms[router.name] = percentile(diffs, 0.5) * 1e3
        row.added_p99_ms[router.name] = percentile(diffs, 0.99) * 1e3
        row.added_mean_ms[router.name] = sum(diffs) / len(diffs) * 1e3 if diffs else math.nan
    return row


async def throughput_row(
    targets: list[Target],
    prompts: list[Prompt],
    args: argparse.Namespace,
    stream: bool,
    meter: CpuMeter,
) -> ThroughputRow:
    """`args.rounds` rounds of closed loops over the targets, `args.duration` per target."""
    metric = "streamed" if stream else "non-streamed"
    concurrency, rounds = args.throughput_concurrency, args.rounds
    seconds = args.duration / rounds  # per target and round
    log(f"  throughput at concurrency {concurrency} ({metric}) ...")
    row = ThroughputRow(metric, concurrency, {}, {t.name: [] for t in targets}, {}, {}, {}, {})
    done: dict[str, int] = {t.name: 0 for t in targets}
    async with session_for(concurrency, len(targets)) as session:
        for r in range(rounds):
            for target in rotated(targets, r):
                looped = itertools.islice(itertools.cycle(prompts), r * 997, None)  # closed loop
                before = meter.snapshot()
                samples = await lanes(session, target, looped, concurrency, stream, seconds)
                elapsed = meter.add(target.name, before)
                ok = sum(s.ok for s in samples)
                row.rounds[target.name].append(ok / elapsed)
                row.failed[target.name] = row.failed.get(target.name, 0) + len(samples) - ok
                done[target.name] += ok
    for t in targets:
        row.rps[t.name] = percentile(row.rounds[t.name], 0.5)
        n = max(done[t.name], 1)
        spent = {role: sum(s) for role, s in meter.spent[t.name].items()}
        machine = spent.pop("machine")
        spent["others"] = max(0.0, machine - sum(spent.values()))  # not ours: noise to note
        spent["machine"] = machine
        row.cpu_us_per_request[t.name] = {role: s / n * 1e6 for role, s in spent.items()}
        row.busy_cores[t.name] = {role: s / meter.wall[t.name] for role, s in spent.items()}
        per_worker = meter.spent[t.name]["workers"]
        row.worker_split[t.name] = [w / (sum(per_worker) or 1.0) for w in per_worker]
    return row


async def measure(
    args: argparse.Namespace,
    targets: list[Target],
    prompts: list[Prompt],
    pids: dict[str, list[int]],
) -> Result:
    warm = prompts[: 8 * args.groups]
    async with session_for(8, len(targets)) as session:
        for target, stream in itertools.product(targets, (False, True)):
            samples = await lanes(session, target, warm, 8, stream)
            if bad := sum(not s.ok for s in samples):
                raise RuntimeError(f"{target.name}: {bad} of {len(samples)} warm-ups failed")
    started = time.perf_counter()
    rows: list[LatencyRow] = []
    for concurrency in args.concurrency:
        log(f"  latency at concurrency {concurrency} ...")
        rows += await latency_rows(targets, prompts, concurrency, args.requests)
    rows.sort(key=lambda row: (row.metric != "non-streamed total", row.metric, row.concurrency))
    streams = (False, True) if args.stream_throughput else (False,)
    throughput = [
        await throughput_row(targets, prompts, args, stream, CpuMeter(pids)) for stream in streams
    ]
    return Result(rows, throughput, time.perf_counter() - started)
