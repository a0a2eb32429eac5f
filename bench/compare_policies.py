"""The main job (`make run`): a local cluster, one workload, several policies, side by side.

    python bench/compare_policies.py [--policies a,b] [--out out/run]

`urc cluster` + `urc bench` per policy, then one table (docs/benchmarks.md)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import harness  # noqa: F401  (puts the repository root on sys.path)

from urc.processes import Child, free_port

ROWS = [
    ("hit rate (tokens)", lambda s: s["hit_rate"], "{:.1%}"),
    ("TTFT p50 (ms)", lambda s: s["ttft_s"]["p50"] * 1e3, "{:.0f}"),
    ("TTFT p99 (ms)", lambda s: s["ttft_s"]["p99"] * 1e3, "{:.0f}"),
    ("latency p50 (ms)", lambda s: s["latency_s"]["p50"] * 1e3, "{:.0f}"),
    ("throughput (req/s)", lambda s: s["throughput"]["requests_per_s"], "{:.1f}"),
    ("output tok/s", lambda s: s["throughput"]["output_tokens_per_s"], "{:.0f}"),
    ("errors", lambda s: s["counts"]["failed"], "{:d}"),
    ("prediction error (% prompt)", lambda s: (s["prediction"] or {}).get("mae_pct"), "{:.2f}"),
]


def run_policy(policy: str, args: argparse.Namespace, out: Path) -> dict:
    capacity = f"--worker-arg=--capacity-tokens={args.capacity_tokens}"
    cluster = [sys.executable, "-m", "urc.cli", "cluster", "--workers", str(args.workers), capacity]
    cluster += ["--policy", policy, "--port", str(free_port())]
    child = Child(f"the {policy} cluster", cluster, "gateway: ").wait_announced(120)
    report = out / f"{policy}.json"
    bench = [sys.executable, "-m", "urc.cli", "bench", "--target", child.url]
    bench += ["--workload", args.workload]
    bench += ["--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    bench += ["--seed", str(args.seed), "--json", str(report), "--no-progress"]
    try:
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
    finally:
        child.stop()
    return json.loads(report.read_text())


def table(results: dict[str, dict]) -> str:
    names = list(results)
    width = max(12, *(len(n) for n in names))
    lines = [f"{'':30s}" + "".join(f"{n:>{width + 2}s}" for n in names)]
    for label, get, fmt in ROWS:
        cells = []
        for name in names:
            try:
                value = get(results[name])
                cells.append(fmt.format(value) if value is not None else "-")
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"{label:30s}" + "".join(f"{c:>{width + 2}s}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--workers", type=int, default=4)
    capacity_help = "KV capacity per worker: small, so placement matters"
    parser.add_argument("--capacity-tokens", type=int, default=30_000, help=capacity_help)
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    running = f"running {args.workload} x {args.requests} through {args.workers} workers"
    for policy in args.policies.split(","):
        print(f"{running} with {policy} ...", flush=True)
        results[policy] = run_policy(policy, args, out)
    text = table(results)
    print("\n" + text)
    (out / "report.txt").write_text(text + "\n")
    print(f"\nreports: {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
