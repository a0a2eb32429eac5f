"""How fast the emulated engine runs in virtual time (the simulator's inner loop).

    python bench/emulated_engine_bench.py [--requests N] [--block-size 512]

Event-driven vs step-by-step on a synthetic workload and the trace (docs/benchmarks.md)."""

import argparse
import json
import random
import time
from pathlib import Path

from harness import SHARED_TRACE

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request
from core.blocks import block_keys

_FILL = list(range(1000, 1510))  # a hash id's 512-token block: two tokens of id, then filler


def synthetic(n: int, seed: int = 0) -> list[Request]:
    """Chat-like: 50 system prompts of 200-4000 tokens, unique tails, Poisson arrivals."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(200, 4000))] for _ in range(50)]
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(30.0)
        tail = [rng.randrange(256) for _ in range(rng.randrange(10, 200))]
        reqs.append(Request(i, prefixes[rng.randrange(50)] + tail, rng.randrange(1, 300), None, t))
    return reqs


def mooncake(path: Path) -> list[Request]:
    reqs = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        tokens: list[int] = []
        for h in row["hash_ids"]:
            tokens += [h & 0xFFFF, h >> 16] + _FILL
        prompt = tokens[: row["input_length"]]
        reqs.append(Request(i, prompt, max(1, row["output_length"]), None, row["timestamp"] / 1e3))
    return reqs


def run(reqs: list[Request], fine: bool, block_size: int, events: bool) -> tuple[float, int]:
    """Seconds of wall time and step calls to serve `reqs` in virtual time."""
    cfg = EngineConfig(block_size=block_size, report_tokens=fine, emit_events=events)
    engine = EmulatedEngine(cfg)
    for r in reqs:
        r.keys = r.keys or block_keys(r.prompt, block_size, r.cache_salt)
    fresh = [Request(r.rid, r.prompt, r.max_tokens, r.cache_salt, r.arrival, r.keys) for r in reqs]
    next_time = engine.next_step_time if fine else engine.next_time
    i = calls = 0
    start = time.perf_counter()
    while True:
        t = next_time()
        if i < len(fresh) and (t is None or fresh[i].arrival <= t):
            engine.submit(fresh[i])
            i += 1
        elif t is None:
            break
        else:
            engine.step(t)
            calls += 1
    return time.perf_counter() - start, calls


def report(name: str, reqs: list[Request], block_size: int, events: bool) -> None:
    coarse, coarse_calls = run(reqs, False, block_size, events)
    fine, fine_calls = run(reqs, True, block_size, events)
    n = len(reqs)
    print(
        f"{name:>10}: {n} requests  event-driven {n / coarse:9.0f} req/s ({coarse_calls} steps)"
        f"  step-by-step {n / fine:9.0f} req/s ({fine_calls} steps)  x{fine / coarse:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--trace", type=Path, default=SHARED_TRACE)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-events", action="store_true", help="emit no KV events")
    args = parser.parse_args()
    print(f"block_size {args.block_size}, KV events {'off' if args.no_events else 'on'}")
    report("synthetic", synthetic(args.requests), args.block_size, not args.no_events)
    if args.trace.exists():
        report("mooncake", mooncake(args.trace), args.block_size, not args.no_events)


if __name__ == "__main__":
    main()
