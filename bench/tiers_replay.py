"""The host tier's acceptance replay (docs/tiers.md): the shared trace on 8 workers x 400k GPU
tokens, without and with a host tier each, under cache_aware, sglang and round_robin.

    python bench/tiers_replay.py [--requests N] [--host-tokens 1600000] [--copy-tps 400000]

Prints one table: hit rate (total, GPU, host), TTFT mean and p99 per setting and policy, and
beside each its zero-queue floor (every request alone on an idle worker, with the hits that run
got: its uncached tokens at the prefill rate, one step's base per chunk, its promotion copy),
plus the floor with an infinite cache; then cache_aware's two ratios, tier / no tier."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import SHARED_TRACE

from backends.emulated.config import EngineConfig
from core.hardware import DEFAULT_HOST_COPY_TOKENS_PER_S
from loadgen.report import percentile
from router.policies import make_policy
from simulation.compare import build_params, run_policy
from simulation.replay import FleetConfig, RunResult
from simulation.report import format_table
from simulation.requests import SimRequest
from simulation.traces import read_trace, trace_requests

POLICIES = ("cache_aware", "sglang", "round_robin")
HIT_RATIO = 1.25  # cache_aware with the tier / without: at least
TTFT_RATIO = 0.8  # at most


def alone_ttft(prompt: int, cached: int, host: int, fleet: FleetConfig) -> float:
    """A request's TTFT on an idle worker: its chunks' steps, its host copy."""
    uncached = prompt - cached
    engine = fleet.engine
    steps = max(1, math.ceil(uncached / engine.chunk_tokens))
    return (
        steps * engine.decode_base_s
        + uncached / engine.prefill_tokens_per_s
        + host / engine.host_copy_tokens_per_s
    )


def floor(result: RunResult, requests: Sequence[SimRequest], fleet: FleetConfig) -> list[float]:
    """The zero-queue floor of a run: each completed request alone, with the hits it got."""
    return [
        alone_ttft(len(requests[i].prompt), result.cached_tokens[i], result.host_tokens[i], fleet)
        for i, ok in enumerate(result.ok)
        if ok
    ]


def infinite_floor(requests: Sequence[SimRequest], fleet: FleetConfig) -> tuple[float, list[float]]:
    """One worker that never evicts (simulation/compare.py's bound), each request alone."""
    seen: set[int] = set()
    prompt = cached = 0
    ttfts = []
    for req in requests:
        keys, n, bs = req.keys, len(req.prompt), req.route.block_size
        cap = min(len(keys), (n - 1) // bs)
        hit = 0
        while hit < cap and keys[hit] in seen:
            hit += 1
        prompt += n
        cached += hit * bs
        seen.update(keys)
        seen.update(req.tail_keys)
        ttfts.append(alone_ttft(n, hit * bs, 0, fleet))
    return cached / prompt, ttfts


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


_HITS = ("hit_rate", "gpu_hit_rate", "host_hit_rate")


def numbers(summary: dict[str, Any], floor_s: list[float]) -> dict[str, Any]:
    """A run's hit rates, TTFTs and zero-queue floor (seconds), as --json writes them."""
    run = {k: summary[k] for k in (*_HITS, "ttft_mean_s", "ttft_p99_s")}
    return {**run, "floor_mean_s": mean(floor_s), "floor_p99_s": percentile(floor_s, 99)}


def row(name: str, n: dict[str, Any]) -> list[str]:
    times = [n["ttft_mean_s"], n["ttft_p99_s"], n["floor_mean_s"], n["floor_p99_s"] or 0.0]
    return [name, *(f"{n[k] * 100:.1f}%" for k in _HITS), *(f"{t * 1e3:,.0f}" for t in times)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(SHARED_TRACE))
    p.add_argument("--requests", type=int, help="the first N requests (default: all)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--gpu-tokens", type=int, default=400_000, help="each worker's GPU KV")
    p.add_argument("--host-tokens", type=int, default=1_600_000, help="each worker's host tier")
    p.add_argument("--copy-tps", type=float, default=DEFAULT_HOST_COPY_TOKENS_PER_S)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", help="write the numbers here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    trace = read_trace(args.trace)
    requests = trace_requests(trace, limit=args.requests)
    settings = {"no tier": 0, "host tier": args.host_tokens}
    print(
        f"{Path(args.trace).name}: {len(requests)} requests, blocks of {trace.block_size}; "
        f"{args.workers} workers x {args.gpu_tokens:,} GPU tokens, host tier "
        f"{args.host_tokens:,} tokens copied at {args.copy_tps:,.0f} tokens/s (TTFT in ms)"
    )
    header = ["setting / policy", "hit", "GPU hit", "host hit", "TTFT mean", "TTFT p99"]
    rows = [header + ["floor mean", "floor p99"]]
    out: dict[str, Any] = {"config": vars(args), "runs": {}}
    fleet = FleetConfig()
    for setting, host in settings.items():
        fleet = FleetConfig(
            workers=args.workers,
            engine=EngineConfig(
                block_size=trace.block_size,
                capacity_tokens=args.gpu_tokens,
                host_capacity_tokens=host,
                host_copy_tokens_per_s=args.copy_tps,
            ),
        )
        for name in args.policies.split(","):
            policy = make_policy(name, build_params(name, {}, fleet, 0))
            run = run_policy(name, requests, policy, fleet)
            got = out["runs"][f"{setting}/{name}"] = numbers(
                run.summary, floor(run.result, requests, fleet)
            )
            rows.append(row(f"{setting} / {name}", got))
    bound, inf = infinite_floor(requests, fleet)
    rows.append(["infinite cache", f"{bound * 100:.1f}%", "-", "-", "-", "-"])
    rows[-1] += [f"{mean(inf) * 1e3:,.0f}", f"{(percentile(inf, 99) or 0.0) * 1e3:,.0f}"]
    out["infinite"] = {"hit_rate": bound, "floor_mean_s": mean(inf)}
    print(format_table(rows))
    runs = out["runs"]
    if "no tier/cache_aware" in runs and "host tier/cache_aware" in runs:
        off, on = runs["no tier/cache_aware"], runs["host tier/cache_aware"]
        hit = on["hit_rate"] / off["hit_rate"]
        ttft = on["ttft_mean_s"] / off["ttft_mean_s"]
        out["ratios"] = {"hit_rate": hit, "ttft_mean": ttft}
        print(
            f"cache_aware, tier / no tier: hit rate {hit:.2f}x (want >= {HIT_RATIO}), "
            f"TTFT mean {ttft:.2f}x (want <= {TTFT_RATIO})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
