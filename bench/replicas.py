"""Gateway replicas behind Envoy against one gateway, in the same run (docs/scale-out.md).

    python bench/replicas.py [--replicas 3] [--requests 900] [--concurrency 48]

4 emulated workers; a shared-prefix workload with a hot prefix, a third of it streamed. Rows:
one gateway (behind Envoy too), N replicas, one gateway with --processes N; and, when asked, N
replicas where a spare joins and one is SIGKILLed mid-run (--churn). Ratios are against the
single gateway's row."""

import argparse
import asyncio
import json
import signal
from itertools import islice

import harness  # noqa: F401  (puts the repository root on sys.path)
from harness import log

from loadgen.workloads import make_workload
from urc.replicas import Fleet, closed_loop, start_fleet, start_replica, summary


def specs(args: argparse.Namespace) -> list:
    workload = make_workload(
        "system-prompts",
        groups=args.groups,
        prefix_tokens=args.prefix_tokens,
        hot_share=args.hot_share,
        max_tokens=args.max_tokens,
    )
    return list(islice(workload.requests(args.seed, ["emulated"]), args.requests))


def run(args: argparse.Namespace, replicas: int, processes: int, churn: bool) -> dict:
    worker_args = ["--capacity-tokens", str(args.capacity_tokens)]
    fleet: Fleet = start_fleet(
        4, replicas, processes, spare=1 if churn else 0, worker_args=worker_args
    )
    at = {}
    if churn:
        spare = fleet.gateway_ports[-1]
        at[args.requests // 3] = lambda: start_replica(fleet, spare)
        at[2 * args.requests // 3] = lambda: fleet.gateways[1].stop(signal.SIGKILL)
    try:
        assert fleet.envoy is not None
        stream_every = 3
        outcomes = asyncio.run(
            closed_loop(fleet.envoy.url, specs(args), args.concurrency, stream_every, at)
        )
        return summary(outcomes)
    finally:
        fleet.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=900)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--hot-share", type=float, default=0.4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--capacity-tokens", type=int, default=60_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--churn", action="store_true", help="also: a replica joins, one is killed")
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    n = args.replicas
    rows = {"1 gateway": (1, 1, False), f"{n} replicas": (n, 1, False)}
    rows[f"--processes {n}"] = (1, n, False)
    if args.churn:
        rows[f"{n} replicas, +1 joins, 1 killed"] = (n, 1, True)
    results = {}
    for name, (replicas, processes, churn) in rows.items():
        log(f"{name} ...")
        results[name] = run(args, replicas, processes, churn)
    base = results["1 gateway"]
    head = f"{'':34s}{'hit rate':>10s}{'affinity':>10s}{'busiest':>9s}{'p50 ms':>9s}"
    print(head + f"{'p99 ms':>9s}{'p99 x':>7s}{'failed':>8s}{'(non-str.)':>11s}")
    for name, r in results.items():
        p99x = r["latency_p99_s"] / base["latency_p99_s"] if base["latency_p99_s"] else 0.0
        print(
            f"{name:34s}{r['hit_rate']:10.1%}{r['affinity']:10.1%}{r['busiest_share']:9.1%}"
            f"{r['latency_p50_s'] * 1e3:9.0f}{r['latency_p99_s'] * 1e3:9.0f}{p99x:7.2f}"
            f"{r['failed']:8d}{r['failed_non_streamed']:11d}  {r['errors'] or ''}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
