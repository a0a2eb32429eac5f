"""KV-event ingest of one gateway while it serves requests: how large a fleet one replica follows.

    python bench/kv_ingest.py [--rates 0,25000,50000,100000,200000] [--processes 1,4]

Two "flood" sources (this script, --flood) answer /urc/info like our workers and publish
vLLM-format BlockStored/BlockRemoved batches (16-token blocks, chained, a steady state: as many
removed as stored) at a set rate in a kv_group no request uses; two emulated workers serve a
closed loop of requests through the same gateway (--concurrency 0: none). Per offered rate:
blocks/s the gateway applied (its mirrors' counters), gaps, the requests' rate and p50 against
rate 0, and the gateway's CPU (all its processes'; method: docs/scale-out.md, "Sizing"). With
several --processes values (run one after the other), the CPU per stored block each spends
against the first's: one ingest per host keeps --processes N near 1x, N ingests would cost Nx."""

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from itertools import count, islice

import aiohttp
from aiohttp import web
from harness import cpu_seconds, log

from core.kv_events import BlockRemoved, BlockStored, EventBatch, encode_batch
from core.kv_publisher import KVEventPublisher
from loadgen.workloads import make_workload
from urc.processes import Child, start_gateway, start_worker
from urc.replicas import admin_get, send

BLOCK = 16
STEP_S = 0.01  # a batch per engine step, 100 steps a second
ADMIN = "bench"


def flood(rate: float, publisher: KVEventPublisher, stop: threading.Event) -> None:
    """Publish `rate` blocks/s: conversations of 32 blocks stored, the oldest ones removed."""
    rng = random.Random(0)
    live: deque[list[int]] = deque()
    held = 0
    hashes = count(1)
    per_step = max(1, int(rate * STEP_S))
    next_at = time.monotonic()
    while not stop.is_set():
        stored: list = []
        removed: list = []
        left = per_step
        while left > 0:
            n = min(32, left)
            keys = [next(hashes) for _ in range(n)]
            tokens = [rng.randrange(32_000) for _ in range(n * BLOCK)]
            stored.append(BlockStored(keys, None, tokens, BLOCK))
            live.append(keys)
            held += n
            left -= n
        while held > 50_000:  # the cache is full: evict the oldest
            keys = live.popleft()
            held -= len(keys)
            removed.append(BlockRemoved(keys))
        batch = EventBatch(time.time(), [*stored, *removed])
        publisher.publish_payload(encode_batch(batch, array_like=False))
        next_at += STEP_S
        time.sleep(max(0.0, next_at - time.monotonic()))


def run_flood(rate: float) -> None:
    """--flood: a source of KV events that answers /urc/info and /health like our workers."""
    publisher = KVEventPublisher(topic="kv")
    stop = threading.Event()
    threading.Thread(target=flood, args=(rate, publisher, stop), daemon=True).start()
    events = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
    events["topic"] = "kv"
    model = {"name": "flood", "kv_group": "flood", "kv_events": events}
    info = {"engine": "flood", "incarnation": uuid.uuid4().hex, "models": [model]}
    info |= {"block_size": BLOCK, "kv_events": events}

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/urc/info", lambda _r: web.json_response(info))
        app.router.add_get("/health", lambda _r: web.json_response({"status": "ok"}))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"ready: http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


async def applied_blocks(url: str) -> tuple[int, int]:
    """Blocks stored that the gateway's mirrors of the flood applied (as many are removed:
    the offered rate counts stores too), and gaps."""
    workers = (await admin_get(url, "/admin/workers", ADMIN))["workers"]
    blocks = gaps = 0
    for worker in workers:
        for stream in worker["kv_events"]:
            # a process of --processes N follows the workers (mirror) or the host's leader
            applied = stream["mirror"] or stream.get("followed")
            if stream["kv_group"] == "flood" and applied:
                blocks += applied["blocks_stored"]
                gaps += applied.get("gaps", 0)
    return blocks, gaps


async def serve_load(url: str, seconds: float, concurrency: int) -> list[float]:
    """Requests through the gateway for `seconds`: their latencies."""
    workload = make_workload("system-prompts", groups=8, prefix_tokens=1024, max_tokens=8)
    specs = iter(workload.requests(0, ["emulated"]))
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as http:

        async def lane() -> None:
            for spec in islice(specs, 100_000):
                if time.monotonic() > deadline:
                    return
                outcome = await send(http, url, spec, False)
                if outcome.status == 200:
                    latencies.append(outcome.latency_s)

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return latencies


def measure(args: argparse.Namespace, rate: float, processes: int) -> dict:
    workers = [
        start_worker("--prefill-tokens-per-s", "1e9", "--decode-base-ms", "1") for _ in range(2)
    ]
    argv = [sys.executable, __file__, "--flood", str(rate / 2)]
    floods = [Child("flood", argv, "ready: ").wait_announced() for _ in range(2 if rate else 0)]
    urls = [c.url for c in workers + floods]
    flags = ["--admin-key", ADMIN, "--processes", str(processes), *args.gateway_arg]
    gateway = start_gateway(urls, *flags)
    try:
        time.sleep(1.0)  # subscribed, first batches in
        before, gaps0 = asyncio.run(applied_blocks(gateway.url))
        cpu0, t0 = cpu_seconds(gateway.pid), time.monotonic()
        if args.concurrency > 0:
            latencies = asyncio.run(serve_load(gateway.url, args.seconds, args.concurrency))
        else:  # events alone: what a core of the gateway applies
            time.sleep(args.seconds)
            latencies = []
        elapsed = time.monotonic() - t0
        after, gaps1 = asyncio.run(applied_blocks(gateway.url))
        cpu = cpu_seconds(gateway.pid) - cpu0
    finally:
        for child in [gateway, *floods, *workers]:
            child.stop()
    return {
        "processes": processes,
        "offered_blocks_per_s": rate,
        "applied_blocks_per_s": (after - before) / elapsed,
        "gaps": gaps1 - gaps0,
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3 if latencies else float("nan"),
        "gateway_cores": cpu / elapsed,
    }


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"  # NaN compares false: "-" too


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--flood":
        run_flood(float(sys.argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0,25000,50000,100000,200000", help="blocks/s")
    parser.add_argument("--processes", default="1", help="the gateway's --processes, a list")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=16, help="0: no requests")
    parser.add_argument("--gateway-arg", action="append", default=[], help="a gateway flag")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for processes in (int(p) for p in args.processes.split(",")):
        for rate in (float(r) for r in args.rates.split(",")):
            log(f"--processes {processes}: offered {rate:.0f} blocks/s ...")
            rows.append(measure(args, rate, processes))
    for processes in dict.fromkeys(r["processes"] for r in rows):
        table([r for r in rows if r["processes"] == processes])
    if len({r["processes"] for r in rows}) > 1:
        per_block(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def table(rows: list[dict]) -> None:
    base = rows[0]
    print(f"one gateway (--processes {base['processes']}) ingesting KV events while serving")
    print(f"{'offered/s':>10} {'applied/s':>10} {'applied %':>9} {'gaps':>5} {'req/s':>7}", end="")
    print(f" {'x rate 0':>8} {'p50 ms':>7} {'x rate 0':>8} {'cores':>6} {'applied/core':>12}")
    for r in rows:
        offered = r["offered_blocks_per_s"]
        share = r["applied_blocks_per_s"] / offered if offered else 1.0
        rps, p50 = r["requests_per_s"], r["p50_ms"]
        print(
            f"{offered:10.0f} {r['applied_blocks_per_s']:10.0f} {share:9.1%}"
            f" {r['gaps']:5d} {rps:7.1f} {ratio(rps, base['requests_per_s']):>8s}"
            f" {p50:7.1f} {ratio(p50, base['p50_ms']):>8s} {r['gateway_cores']:6.2f}"
            f" {r['applied_blocks_per_s'] / max(r['gateway_cores'], 1e-9):12.0f}"
        )


def per_block(rows: list[dict]) -> None:
    """Gateway CPU per stored block applied, by --processes, against the first's at that rate;
    with rate 0 measured, also what the events add over it (the idle processes' own CPU out)."""
    first = rows[0]["processes"]
    idle = {r["processes"]: r["gateway_cores"] for r in rows if not r["offered_blocks_per_s"]}
    print("gateway CPU (all processes) per stored block applied, us: total | over rate 0")
    for rate in dict.fromkeys(r["offered_blocks_per_s"] for r in rows):
        if not rate:
            continue
        at = {r["processes"]: r for r in rows if r["offered_blocks_per_s"] == rate}
        cells = []
        for extra in (False, True):
            if extra and len(idle) < len(at):
                continue
            us = {
                p: (r["gateway_cores"] - (idle[p] if extra else 0.0))
                / max(r["applied_blocks_per_s"], 1e-9)
                * 1e6
                for p, r in at.items()
            }
            cells.append(
                "  ".join(f"p{p} {v:5.2f} ({ratio(v, us[first])}x)" for p, v in us.items())
            )
        print(f"{rate:8.0f}/s  " + "  |  ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
