"""Adapter-aware placement against the same policy blind to adapters (docs/adapters.md): the
`lora` workload (100 adapters, Zipf popularity) replayed on 8 emulated workers with 4 adapter
slots each, each load counted in its request's TTFT, cache_aware with and without its adapter
terms in one run.

    python bench/lora_placement.py [--requests 20000] [--rate 40] [--zipf-s 1.0]

Prints per run: adapter loads and unloads, hit rate, exact predictions, TTFT p50/p99/mean (ms),
how many workers served the hottest adapter, the next 9 and the rest (mean), then the ratios
aware / blind (acceptance: fewer loads, a lower TTFT p99)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from backends.emulated.config import EngineConfig
from loadgen.report import percentile
from router.policies import make_policy
from simulation.compare import build_params, run_policy
from simulation.replay import FleetConfig, RunResult
from simulation.report import format_table
from simulation.requests import SimRequest
from simulation.workloads import workload_requests

RUNS = {"aware": True, "blind": False}


def numbers(result: RunResult, requests: list[SimRequest]) -> dict[str, Any]:
    ttft = sorted(t for t in result.ttft_s if not math.isnan(t))
    prompt = sum(len(r.prompt) for r in requests)
    pairs = zip(result.predicted_tokens, result.cached_tokens, strict=True)
    return {
        "adapter_loads": result.adapters["loads"],
        "adapter_evictions": result.adapters["evictions"],
        "adapter_unloads": result.adapters["unloads"],
        "hit_rate": sum(result.cached_tokens) / prompt,
        "exact_predictions": sum(p == c for p, c in pairs) / len(requests),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": math.fsum(ttft) / len(ttft),
        "ok": sum(result.ok),
        **spread(result, requests),
    }


def spread(result: RunResult, requests: list[SimRequest]) -> dict[str, float]:
    """Workers that served each adapter: the hottest one, the next 9, the rest (mean)."""
    served: dict[str, set[int]] = {}
    for r in requests:
        served.setdefault(r.route.adapter, set()).add(result.worker[r.index])
    by_heat = sorted(served, key=lambda a: int(a.rpartition("-")[2]))  # lora-0 is the hottest
    counts = [len(served[a]) for a in by_heat]
    tail = counts[10:] or [0]
    return {
        "workers_hottest": counts[0],
        "workers_next_9": math.fsum(counts[1:10]) / max(1, len(counts[1:10])),
        "workers_rest": math.fsum(tail) / len(tail),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rate", type=float, default=40.0, help="requests per second (Poisson)")
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=4, help="adapter slots per worker")
    p.add_argument("--size-mb", type=float, default=84.0, help="each adapter's size")
    p.add_argument("--load-gbps", type=float, default=1.0, help="an activation's copy rate")
    p.add_argument("--load-s", type=float, default=0.05, help="the gateway's load call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the numbers here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    params = {"adapters": args.adapters, "zipf_s": args.zipf_s}
    requests = workload_requests(
        "lora", args.requests, seed=args.seed, models=["emulated"], rate=args.rate, params=params
    )
    engine = EngineConfig(
        max_loras=args.max_loras, lora_load_gbps=args.load_gbps, lora_default_mb=args.size_mb
    )
    fleet = FleetConfig(workers=args.workers, engine=engine, adapter_load_s=args.load_s)
    print(
        f"lora: {len(requests)} requests at {args.rate}/s over {args.adapters} adapters "
        f"(Zipf s={args.zipf_s}); {args.workers} workers x {args.max_loras} slots; a load "
        f"{args.load_s * 1e3:.0f} ms, an activation {args.size_mb:.0f} MB at {args.load_gbps} GB/s"
    )
    out: dict[str, Any] = {"config": vars(args), "runs": {}}
    rows = [
        [
            "cache_aware",
            "loads",
            "evictions",
            "unloads",
            "hit",
            "exact",
            "p50 ms",
            "p99 ms",
            "mean ms",
        ]
    ]
    rows[0] += ["workers: hottest", "next 9", "rest"]
    for name, aware in RUNS.items():
        policy = make_policy(
            "cache_aware", build_params("cache_aware", {}, fleet, args.seed), adapter_aware=aware
        )
        n = out["runs"][name] = numbers(run_policy(name, requests, policy, fleet).result, requests)
        rows.append(
            [
                name,
                *(f"{n[k]:,}" for k in ("adapter_loads", "adapter_evictions", "adapter_unloads")),
                f"{n['hit_rate'] * 100:.1f}%",
                f"{n['exact_predictions'] * 100:.2f}%",
                *(f"{n[k] * 1e3:,.0f}" for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s")),
                f"{n['workers_hottest']}",
                *(f"{n[k]:.1f}" for k in ("workers_next_9", "workers_rest")),
            ]
        )
    print(format_table(rows))
    aware, blind = out["runs"]["aware"], out["runs"]["blind"]
    ratios = {
        k: aware[k] / blind[k] for k in ("adapter_loads", "ttft_p50_s", "ttft_p99_s", "hit_rate")
    }
    out["ratios"] = ratios
    print("aware / blind: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    met = ratios["adapter_loads"] < 1 and ratios["ttft_p99_s"] < 1
    print("acceptance (fewer loads, lower TTFT p99):", "met" if met else "NOT met")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
