"""Gateway overhead: the latency urc adds over going straight to a worker, and its throughput.

    python bench/gateway_overhead.py [--workers 2] [--requests 3000] [--duration 6]
        [--policy cache_aware] [--api completions|chat] [--sglang-router BIN] [--json OUT]

Starts K emulated workers whose modelled GPU time is negligible and deterministic (prefill
1e9 tokens/s, a 0.01 ms decode step, 8 output tokens), so what remains is HTTP and the
router's own work; then `urc gateway` in front of them and, when sglang-router is installed
(in this environment, or at `--sglang-router BIN`, e.g. `/tmp/sgr/bin/sglang-router`), SGLang's
router in front of the SAME workers. Prompts are 1-2k tokens (byte tokenizer: one ASCII byte
per token) sharing a 1k-token prefix within a few groups, so tokenize + keys + match run on
realistic input. "direct" sends each group to a fixed worker (group mod K).

Latency rows (concurrency 1 and 32, non-streamed total, streamed time to first byte and total):
each round sends the same block of prompts to direct, urc and sglang-router in rotating order;
the i-th request of a router's block is paired with the i-th of direct's, and the table gives
p50 and p99 of (through router - direct). Throughput: closed loop at concurrency 64 for
`--duration` seconds per target, split over rounds in rotating order; median requests/s.
Ratios are urc / sglang-router (goal: <= 1 for added latency, >= 1 for requests/s).

Everything shares this machine's CPUs, the load generator too: the CPU section says how busy
each process was, so a row bound by the load generator or the workers shows as such.
Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from harness import (
    JSON_HEADERS,
    Child,
    cpu_seconds,
    free_port,
    machine_cpu_seconds,
    percentile,
)

MODEL = "emulated"
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# sglang-router has fewer policies; the nearest one for each of ours
SGLANG_POLICY = {
    "cache_aware": "cache_aware",
    "sglang": "cache_aware",
    "round_robin": "round_robin",
    "power_of_two": "power_of_two",
}


# -- processes ---------------------------------------------------------------------------------


def sglang_command(spec: str | None) -> list[str] | None:
    """How to launch sglang-router: BIN's Python (from its shebang) with `-m
    sglang_router.launch_router`, BIN itself with `launch`, or this environment's copy."""
    if spec:
        path = Path(spec)
        if not path.exists():
            raise SystemExit(f"--sglang-router: {spec} does not exist")
        with open(path, "rb") as f:
            first = f.readline(200)
        if first.startswith(b"#!") and b"python" in first:
            return [first[2:].decode().strip().split()[0], "-m", "sglang_router.launch_router"]
        return [str(path), "launch"]
    import importlib.util

    if importlib.util.find_spec("sglang_router") is not None:
        return [sys.executable, "-m", "sglang_router.launch_router"]
    return None


# -- prompts -----------------------------------------------------------------------------------

_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "cache prefix block token radix worker gateway route model prompt decode prefill kernel"
)
WORDS = _VOCABULARY.split()


def text(rng: random.Random, n: int) -> str:
    """`n` ASCII bytes of words (the byte tokenizer makes that `n` tokens)."""
    out: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n]


@dataclass(slots=True)
class Prompt:
    group: int
    tokens: int
    bodies: tuple[bytes, bytes]  # (non-streamed, streamed) request bodies


def build_prompts(args: argparse.Namespace) -> list[Prompt]:
    rng = random.Random(args.seed)
    prefixes = [f"group {g}: " + text(rng, args.prefix_tokens) for g in range(args.groups)]
    prompts = []
    for i in range(args.prompts):
        group = i % args.groups
        suffix = f" request {i}: " + text(rng, rng.randint(16, args.prefix_tokens))
        prompt = prefixes[group] + suffix
        base: dict[str, Any] = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0}
        if args.api == "chat":
            base["messages"] = [
                {"role": "system", "content": prefixes[group]},
                {"role": "user", "content": suffix},
            ]
        else:
            base["prompt"] = prompt
        bodies = (json.dumps(base).encode(), json.dumps({**base, "stream": True}).encode())
        prompts.append(Prompt(group, len(prompt), bodies))
    return prompts


# -- targets and requests ----------------------------------------------------------------------


@dataclass(slots=True)
class Target:
    """Where requests go: straight to the workers (by group) or to one router."""

    name: str
    urls: list[str]
    path: str
    pid: int | None  # the router process (None: direct)

    def url(self, prompt: Prompt) -> str:
        return self.urls[prompt.group % len(self.urls)] + self.path


@dataclass(slots=True)
class Sample:
    ok: bool
    total_s: float
    ttfb_s: float  # time to the first body byte (non-streamed: the whole response)


async def send(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> Sample:
    t0 = time.perf_counter()
    first = math.nan
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
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
    spent: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> role -> s
    per_worker: dict[str, list[float]] = field(default_factory=dict)  # target -> s per worker
    wall: dict[str, float] = field(default_factory=dict)

    def snapshot(self) -> tuple[float, dict[str, list[float]]]:
        now = {"loadgen": [time.process_time()]}
        now.update((role, [cpu_seconds(p) for p in pids]) for role, pids in self.pids.items())
        now["machine"] = [machine_cpu_seconds()]
        return time.perf_counter(), now

    def add(self, target: str, before: tuple[float, dict[str, list[float]]]) -> None:
        wall, after = self.snapshot()
        spent = self.spent.setdefault(target, {})
        for role, values in after.items():
            deltas = [a - b for a, b in zip(values, before[1][role], strict=True)]
            spent[role] = spent.get(role, 0.0) + sum(deltas)
            if role == "workers":
                acc = self.per_worker.setdefault(target, [0.0] * len(deltas))
                self.per_worker[target] = [x + d for x, d in zip(acc, deltas, strict=True)]
        self.wall[target] = self.wall.get(target, 0.0) + wall - before[0]


async def block(
    session: aiohttp.ClientSession,
    target: Target,
    prompts: list[Prompt],
    concurrency: int,
    stream: bool,
) -> list[Sample]:
    """Send `prompts` with `concurrency` in flight; samples in prompt order."""
    samples: list[Sample | None] = [None] * len(prompts)
    todo = iter(enumerate(prompts))

    async def lane() -> None:
        for i, prompt in todo:
            samples[i] = await send(session, target.url(prompt), prompt.bodies[stream], stream)

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return [s for s in samples if s is not None]


async def closed_loop(
    session: aiohttp.ClientSession,
    target: Target,
    prompts: list[Prompt],
    concurrency: int,
    stream: bool,
    seconds: float,
    start: int,
) -> tuple[int, int, float]:
    """As many requests as `concurrency` lanes complete in `seconds`: (ok, failed, elapsed)."""
    counts = [0, 0]
    nxt = [start]
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def lane() -> None:
        while time.perf_counter() < deadline:
            prompt = prompts[nxt[0] % len(prompts)]
            nxt[0] += 1
            sample = await send(session, target.url(prompt), prompt.bodies[stream], stream)
            counts[0 if sample.ok else 1] += 1

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return counts[0], counts[1], time.perf_counter() - t0


# -- measurement -------------------------------------------------------------------------------


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


def session_for(concurrency: int, targets: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=concurrency * targets, limit_per_host=concurrency, force_close=False
    )
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))


async def latency_rows(
    targets: list[Target], prompts: list[Prompt], concurrency: int, requests: int
) -> list[LatencyRow]:
    direct, routers = targets[0], targets[1:]
    size = max(8, concurrency * 2)  # short blocks, many rounds: slow noise hits all alike
    rounds = max(1, math.ceil(requests / size))
    rows = []
    async with session_for(concurrency, len(targets)) as session:
        for stream in (False, True):
            got: dict[str, list[Sample]] = {t.name: [] for t in targets}
            for r in range(rounds):
                chunk = [prompts[(r * size + i) % len(prompts)] for i in range(size)]
                for k in range(len(targets)):
                    target = targets[(r + k) % len(targets)]
                    got[target.name] += await block(session, target, chunk, concurrency, stream)
            metrics = [("streamed TTFB", "ttfb_s"), ("streamed total", "total_s")]
            for metric, attr in metrics if stream else [("non-streamed total", "total_s")]:
                base = got[direct.name]
                row = LatencyRow(metric, concurrency, 0, math.nan, math.nan, {}, {}, {}, {})
                ok_direct = [getattr(s, attr) for s in base if s.ok]
                row.direct_p50_ms = percentile(ok_direct, 0.5) * 1e3
                row.direct_p99_ms = percentile(ok_direct, 0.99) * 1e3
                row.failed[direct.name] = sum(not s.ok for s in base)
                for router in routers:
                    through = got[router.name]
                    diffs = [
                        getattr(t, attr) - getattr(d, attr)
                        for d, t in zip(base, through, strict=True)
                        if d.ok and t.ok
                    ]
                    row.pairs = len(diffs)
                    row.added_p50_ms[router.name] = percentile(diffs, 0.5) * 1e3
                    row.added_p99_ms[router.name] = percentile(diffs, 0.99) * 1e3
                    row.added_mean_ms[router.name] = (
                        sum(diffs) / len(diffs) * 1e3 if diffs else math.nan
                    )
                    row.failed[router.name] = sum(not s.ok for s in through)
                rows.append(row)
    return rows


async def throughput_row(
    targets: list[Target],
    prompts: list[Prompt],
    concurrency: int,
    seconds: float,
    rounds: int,
    stream: bool,
    meter: CpuMeter,
) -> ThroughputRow:
    metric = "streamed" if stream else "non-streamed"
    row = ThroughputRow(metric, concurrency, {}, {t.name: [] for t in targets}, {}, {}, {}, {})
    done: dict[str, int] = {t.name: 0 for t in targets}
    async with session_for(concurrency, len(targets)) as session:
        for r in range(rounds):
            for k in range(len(targets)):
                target = targets[(r + k) % len(targets)]
                before = meter.snapshot()
                ok, failed, elapsed = await closed_loop(
                    session, target, prompts, concurrency, stream, seconds / rounds, r * 997
                )
                meter.add(target.name, before)
                row.rounds[target.name].append(ok / elapsed)
                row.failed[target.name] = row.failed.get(target.name, 0) + failed
                done[target.name] += ok
    for t in targets:
        row.rps[t.name] = percentile(row.rounds[t.name], 0.5)
        n = max(done[t.name], 1)
        spent = dict(meter.spent[t.name])
        machine = spent.pop("machine")
        spent["others"] = max(0.0, machine - sum(spent.values()))  # not ours: noise to note
        spent["machine"] = machine
        row.cpu_us_per_request[t.name] = {role: s / n * 1e6 for role, s in spent.items()}
        row.busy_cores[t.name] = {role: s / meter.wall[t.name] for role, s in spent.items()}
        total = sum(meter.per_worker[t.name]) or 1.0
        row.worker_split[t.name] = [w / total for w in meter.per_worker[t.name]]
    return row


async def measure(
    args: argparse.Namespace,
    targets: list[Target],
    prompts: list[Prompt],
    pids: dict[str, list[int]],
) -> dict[str, Any]:
    warm = prompts[: min(len(prompts), 8 * args.groups)]
    async with session_for(8, len(targets)) as session:
        for target in targets:
            for stream in (False, True):
                samples = await block(session, target, warm, 8, stream)
                bad = sum(not s.ok for s in samples)
                if bad:
                    raise RuntimeError(f"{target.name}: {bad} of {len(samples)} warm-ups failed")
    started = time.perf_counter()
    rows: list[LatencyRow] = []
    for concurrency in args.concurrency:
        print(f"  latency at concurrency {concurrency} ...", file=sys.stderr, flush=True)
        rows += await latency_rows(targets, prompts, concurrency, args.requests)
    rows.sort(key=lambda row: (row.metric != "non-streamed total", row.metric, row.concurrency))
    throughput = []
    for stream in (False, True) if args.stream_throughput else (False,):
        print(
            f"  throughput at concurrency {args.throughput_concurrency} "
            f"({'streamed' if stream else 'non-streamed'}) ...",
            file=sys.stderr,
            flush=True,
        )
        meter = CpuMeter(pids)
        throughput.append(
            await throughput_row(
                targets,
                prompts,
                args.throughput_concurrency,
                args.duration,
                args.rounds,
                stream,
                meter,
            )
        )
    return {
        "latency": rows,
        "throughput": throughput,
        "measure_s": time.perf_counter() - started,
    }


# -- report ------------------------------------------------------------------------------------


def ratio(a: float, b: float) -> str:
    if not (a > 0 and b > 0) or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}"


def fmt(x: float, digits: int = 2) -> str:
    return "nan" if math.isnan(x) else f"{x:.{digits}f}"


def report(result: dict[str, Any], names: list[str], header: str) -> str:
    routers = names[1:]
    sgl = "sglang-router" in routers
    out = [header, ""]
    out.append("added latency = through router - direct, paired per request, in ms")
    cols = f"{'row':<20} {'c':>3} {'pairs':>6} {'direct p50':>10} {'p99':>7}"
    for name in routers:
        cols += f" {name + ' +p50':>{len(name) + 6}} {'+p99':>7} {'+mean':>7}"
    if sgl:
        cols += f" {'urc/sgl p50':>11} {'p99':>6} {'mean':>6}"
    out.append(cols)
    for row in result["latency"]:
        line = (
            f"{row.metric:<20} {row.concurrency:>3} {row.pairs:>6} "
            f"{fmt(row.direct_p50_ms):>10} {fmt(row.direct_p99_ms):>7}"
        )
        for name in routers:
            line += (
                f" {fmt(row.added_p50_ms[name]):>{len(name) + 6}} {fmt(row.added_p99_ms[name]):>7}"
                f" {fmt(row.added_mean_ms[name]):>7}"
            )
        if sgl:
            line += (
                f" {ratio(row.added_p50_ms['urc'], row.added_p50_ms['sglang-router']):>11}"
                f" {ratio(row.added_p99_ms['urc'], row.added_p99_ms['sglang-router']):>6}"
                f" {ratio(row.added_mean_ms['urc'], row.added_mean_ms['sglang-router']):>6}"
            )
        failed = {k: v for k, v in row.failed.items() if v}
        if failed:
            line += f"  failed {failed}"
        out.append(line)
    for row in result["throughput"]:
        out.append("")
        out.append(
            f"throughput, {row.metric}, concurrency {row.concurrency}: requests/s "
            f"(median of {len(row.rounds[names[0]])} rounds)"
        )
        line = "  ".join(f"{name} {row.rps[name]:.0f}" for name in names)
        line += f"   urc/direct {ratio(row.rps['urc'], row.rps['direct'])}"
        if sgl:
            line += f"   urc/sglang-router {ratio(row.rps['urc'], row.rps['sglang-router'])}"
        failed = {k: v for k, v in row.failed.items() if v}
        if failed:
            line += f"   failed {failed}"
        out.append("  " + line)
        out.append("  CPU per request in µs (cores busy on average) while each target ran:")
        for name in names:
            cpu = row.cpu_us_per_request[name]
            busy = row.busy_cores[name]
            parts = [f"{role} {cpu[role]:.0f} ({busy[role]:.2f})" for role in cpu]
            split = "/".join(f"{share * 100:.0f}" for share in row.worker_split[name])
            out.append(f"    {name:<14} " + ", ".join(parts) + f"; worker CPU split {split}%")
            if busy["loadgen"] >= 0.9:
                out.append(f"      ^ the load generator used ~a core: {name} may be bound by it")
            if busy["machine"] >= 0.95 * (os.cpu_count() or 1):
                out.append("      ^ every CPU was busy: compare CPU per request, not requests/s")
    if sgl and any(
        30 < row.added_p50_ms["sglang-router"] < 60
        for row in result["latency"]
        if row.metric.startswith("streamed")
    ):
        out.append("")
        out.append(
            "note: sglang-router's streamed rows add ~40 ms: on a kept-alive connection its "
            "first SSE chunk waits for the ACK of the headers (Nagle on its client socket vs "
            "the client's delayed ACK), a TCP artifact rather than routing work."
        )
    out.append("")
    out.append(
        "ratios urc/sglang-router: <= 1 is as good or better for added latency, >= 1 for "
        "requests/s; 'n/a' when a side's added latency is <= 0 (within noise)."
    )
    return "\n".join(out)


def _no_nan(value: Any) -> Any:
    """JSON has no NaN: null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def to_json(result: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return _no_nan(
        {
            "config": config,
            "latency": [asdict(row) for row in result["latency"]],
            "throughput": [asdict(row) for row in result["throughput"]],
            "measure_s": result["measure_s"],
        }
    )


# -- main --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Latency urc's gateway adds over direct requests, and its throughput, "
        "optionally against sglang-router in front of the same emulated workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=2, help="emulated workers (K)")
    parser.add_argument("--policy", default="cache_aware", help="urc's routing policy")
    parser.add_argument(
        "--sglang-router",
        metavar="BIN",
        default=None,
        help="sglang-router console script (e.g. /tmp/sgr/bin/sglang-router); default: the "
        "sglang_router package of this environment, if installed",
    )
    parser.add_argument("--sglang-policy", default=None, help="default: nearest to --policy")
    parser.add_argument("--no-sglang", action="store_true", help="measure urc only")
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument(
        "--requests",
        type=int,
        default=3000,
        # p99 of 1000 pairs is their 10th worst: one scheduling hiccup on a shared machine
        # moves it; of 3000, the 30th (~3 min for the whole bench)
        help="requests per target per latency row",
    )
    parser.add_argument(
        "--duration", type=float, default=6.0, help="seconds per target for throughput"
    )
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (rotating order)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--throughput-concurrency", type=int, default=64)
    parser.add_argument(
        "--stream-throughput",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure streamed requests/s too",
    )
    parser.add_argument("--groups", type=int, default=8, help="shared-prefix groups")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="shared prefix per group")
    parser.add_argument("--prompts", type=int, default=512, help="distinct prompts")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument(
        "--decode-step-ms", type=float, default=0.01, help="the workers' modelled decode step"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", help="write the table as JSON")
    return parser


def start_fleet(
    args: argparse.Namespace, sglang: list[str] | None, probe: bytes, children: list[Child]
) -> tuple[list[Target], dict[str, list[int]]]:
    """Workers, then urc (and sglang-router) in front of them; every child joins `children` as
    soon as it exists, so the caller can stop it whatever happens next."""
    py = sys.executable
    for i in range(args.workers):
        cmd = [py, "-m", "backends.emulated.server", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--model", MODEL, "--prefill-tps", "1e9", "--decode-per-request-ms", "0"]
        cmd += ["--decode-base-ms", str(args.decode_step_ms)]
        children.append(Child(f"worker {i}", cmd, "ready: "))
    for child in children:
        child.wait_announced(60)
    workers = [child.url for child in children]
    pids = {"workers": [child.pid for child in children]}
    cmd = [py, "-m", "urc.cli", "gateway", "--host", "127.0.0.1"]
    cmd += ["--port", str(free_port()), "--policy", args.policy]
    for url in workers:
        cmd += ["--worker", url]
    urc = Child("urc gateway", cmd, "gateway: ")
    children.append(urc)
    urc.wait_announced(60)
    path = PATHS[args.api]
    urc.wait_serving(path, probe, 30)
    targets = [Target("direct", workers, path, None), Target("urc", [urc.url], path, urc.pid)]
    pids["urc"] = [urc.pid]
    if sglang is not None:
        port = free_port()
        cmd = [*sglang, "--host", "127.0.0.1", "--port", str(port), "--policy", args.sglang_policy]
        cmd += ["--worker-urls", *workers, "--log-level", "warn"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        sgl = Child("sglang-router", cmd, None, url=f"http://127.0.0.1:{port}")
        children.append(sgl)
        sgl.wait_serving(path, probe, 60)
        targets.append(Target("sglang-router", [sgl.url], path, sgl.pid))
        pids["sglang-router"] = [sgl.pid]
    return targets, pids


def describe(args: argparse.Namespace, prompts: list[Prompt], sglang: bool) -> str:
    lengths = [p.tokens for p in prompts]
    routers = f"urc policy {args.policy}; " + (
        f"sglang-router policy {args.sglang_policy}" if sglang else "no sglang-router"
    )
    return (
        f"gateway overhead: {args.workers} emulated workers (prefill 1e9 tokens/s, decode step "
        f"{args.decode_step_ms} ms, max_tokens {args.max_tokens}); {PATHS[args.api]}; prompts "
        f"{min(lengths)}-{max(lengths)} tokens in {args.groups} prefix groups; {routers}\n"
        f"machine: {os.cpu_count()} CPUs shared by the load generator, the workers, the routers "
        "and anything else running (see the CPU lines)"
    )


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.requests < 1 or args.duration <= 0 or args.rounds < 1:
        raise SystemExit("need --workers >= 1, --requests >= 1, --duration > 0, --rounds >= 1")
    sglang = None if args.no_sglang else sglang_command(args.sglang_router)
    args.sglang_policy = args.sglang_policy or SGLANG_POLICY.get(args.policy, "cache_aware")
    prompts = build_prompts(args)
    header = describe(args, prompts, sglang is not None)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in background
    signal.signal(signal.SIGTERM, _raise_interrupt)  # stop the children on `kill` too
    children: list[Child] = []
    try:
        targets, pids = start_fleet(args, sglang, prompts[0].bodies[0], children)
        print(header.splitlines()[0], file=sys.stderr, flush=True)
        result = asyncio.run(measure(args, targets, prompts, pids))
    except KeyboardInterrupt:
        print("interrupted: stopping the processes", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"gateway_overhead: {exc}", file=sys.stderr)
        return 1
    finally:
        for child in reversed(children):
            child.stop()
    print(report(result, [t.name for t in targets], header))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config["cpus"] = os.cpu_count()
        Path(args.json).write_text(json.dumps(to_json(result, config), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
