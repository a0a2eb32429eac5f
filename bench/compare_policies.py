"""The main job (`make run`): a local cluster, one workload, several policies, side by side.

    python bench/compare_policies.py [--policies a,b] [--out out/run]

`urc cluster` + `urc bench` per policy, then one table, two plots and report.md
(docs/benchmarks.md)."""

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import harness  # noqa: F401  (puts the repository root on sys.path)
import run_report

from core.ports import free_port
from urc.processes import Child

ROWS = [
    ("hit rate (tokens)", lambda s: s["hit_rate"], "{:.1%}"),
    ("TTFT p50 (ms)", lambda s: s["ttft_s"]["p50"] * 1e3, "{:.0f}"),
    ("TTFT p99 (ms)", lambda s: s["ttft_s"]["p99"] * 1e3, "{:.0f}"),
    ("TTFT mean (ms)", lambda s: s["ttft_s"]["mean"] * 1e3, "{:.0f}"),
    ("TTFT max (ms)", lambda s: s["ttft_s"]["max"] * 1e3, "{:.0f}"),
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
    if args.flow_control == "on":
        cluster += ["--flow-control", f"--flow-saturation-ms={args.flow_saturation_ms}"]
    child = Child(f"the {policy} cluster", cluster, "gateway: ").wait_announced(120)
    report = out / f"{policy}.json"
    bench = [sys.executable, "-m", "urc.cli", "bench", "--target", child.url]
    bench += ["--workload", args.workload]
    bench += ["--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    bench += ["--seed", str(args.seed), "--json", str(report), "--json-requests"]
    bench += ["--no-progress"]
    try:
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        flow = flow_outcomes(child.url) if args.flow_control == "on" else {}
    finally:
        child.stop()
    summary = json.loads(report.read_text())
    summary["flow"] = flow
    return summary


def flow_outcomes(url: str) -> dict[str, int]:
    """The gateway's flow-control outcomes (`urc_flow_requests_total`), all tenants together."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counts: dict[str, int] = {}
    for labels, value in re.findall(r"^urc_flow_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        outcome = re.search(r'outcome="(\w+)"', labels)
        if outcome:
            counts[outcome.group(1)] = counts.get(outcome.group(1), 0) + int(float(value))
    return counts


def rows(results: dict[str, dict]) -> list[list[str]]:
    """The table: a header, then one row per measure with a cell per policy."""
    out = [["", *results]]
    for label, get, fmt in ROWS:
        cells = [label]
        for summary in results.values():
            try:
                value = get(summary)
                cells.append(fmt.format(value) if value is not None else "-")
            except (KeyError, TypeError):
                cells.append("-")
        out.append(cells)
    return out


def table(rows: list[list[str]]) -> str:
    width = max(12, *(len(n) for n in rows[0][1:]))
    return "\n".join(
        f"{row[0]:30s}" + "".join(f"{c:>{width + 2}s}" for c in row[1:]) for row in rows
    )


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
    flow_help = "the gateway's flow control (docs/flow-control.md): its line in the report"
    parser.add_argument("--flow-control", choices=("on", "off"), default="off", help=flow_help)
    parser.add_argument("--flow-saturation-ms", type=float, default=500.0, help="with it on")
    parser.add_argument("--out", default="out/run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    running = f"running {args.workload} x {args.requests} through {args.workers} workers"
    for policy in args.policies.split(","):
        print(f"{running} with {policy} ...", flush=True)
        results[policy] = run_policy(policy, args, out)
    grid = rows(results)
    text = table(grid)
    print("\n" + text)
    (out / "report.txt").write_text(text + "\n")
    plots = run_report.write_plots(out, results)
    line = run_report.verdict(results, "cache_aware", "round_robin")
    page = out / "report.md"
    flow = run_report.flow_line(args.flow_control, results)
    page.write_text(run_report.markdown(args, grid, plots, [line, flow]), encoding="utf-8")
    for text_line in (line, flow):
        if text_line:
            print("\n" + text_line.replace("`", ""))
    print(f"\nreports: {out}/ (report.txt, report.md, one JSON per policy)")
    if plots:
        print("plots: " + ", ".join(str(p) for p in plots))
    else:
        print(run_report.MISSING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
