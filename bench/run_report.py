"""The main job's page (`make run`): PNG plots of the per-request records each policy's
`urc bench --json --json-requests` wrote, and report.md beside the table (docs/benchmarks.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simulation.report import MISSING, markdown_table, plot_cdf, save_figure


def hit_rate_over_time(requests: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """Cumulative hit rate (cached / prompt tokens, as the workers report them) of the answered
    requests in the order they were sent: (send times in s, hit rates in %)."""
    answered = [
        r
        for r in requests
        if r.get("error") is None and r.get("prompt_tokens") and r.get("cached_tokens") is not None
    ]
    answered.sort(key=lambda r: r["start_s"])
    times: list[float] = []
    rates: list[float] = []
    prompt = cached = 0
    for r in answered:
        prompt += r["prompt_tokens"]
        cached += r["cached_tokens"]
        times.append(r["start_s"])
        rates.append(100.0 * cached / prompt)
    return times, rates


def ttfts_ms(requests: Sequence[Mapping[str, Any]]) -> list[float]:
    return [r["ttft_s"] * 1e3 for r in requests if r.get("error") is None and r.get("ttft_s")]


def write_plots(out: Path, results: Mapping[str, Mapping[str, Any]]) -> list[Path]:
    """hit_rate.png and ttft_cdf.png in `out`, one line per policy; [] without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, summary in results.items():
        times, rates = hit_rate_over_time(summary.get("requests", []))
        ax.plot(times, rates, label=name)
    ax.set(xlabel="time since the start (s)", ylabel="hit rate so far (% of prompt tokens)")
    ax.set_title("Hit rate over time (cumulative)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(Path(save_figure(fig, out / "hit_rate.png", plt)))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_cdf(ax, {name: ttfts_ms(s.get("requests", [])) for name, s in results.items()})
    ax.set(xlabel="time to first token (ms)", ylabel="fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(Path(save_figure(fig, out / "ttft_cdf.png", plt)))
    return paths


def verdict(results: Mapping[str, Mapping[str, Any]], ours: str, other: str) -> str:
    """One line: `ours` against `other` on hit rate, TTFT p50 and p99."""
    if ours not in results or other not in results:
        return ""
    a, b = results[ours], results[other]
    try:
        hit = (a["hit_rate"] - b["hit_rate"]) * 100
        p50 = a["ttft_s"]["p50"] / b["ttft_s"]["p50"]
        p99 = a["ttft_s"]["p99"] / b["ttft_s"]["p99"]
    except (KeyError, TypeError, ZeroDivisionError):
        return ""
    ahead = hit > 0 and p50 < 1 and p99 < 1
    return (
        f"`{ours}` against `{other}`: hit rate {hit:+.1f} points, TTFT p50 x{p50:.2f}, "
        f"p99 x{p99:.2f} ({'ahead on all three' if ahead else 'not ahead on all three'})."
    )


def flow_line(setting: str, results: Mapping[str, Mapping[str, Any]]) -> str:
    """One line: flow control on or off, and with it on what it did per policy (its outcomes:
    admitted at once, after a wait in its queue, refused)."""
    if setting != "on":
        return (
            "Flow control: off. On this workload it helps neither policy: at its default "
            "threshold the pool never saturates (every request admitted at once, the same "
            "TTFT), and a lower one held requests and raised TTFT p99 (docs/benchmarks.md); "
            "`--flow-control on` shows what it does."
        )
    parts = []
    for name, summary in results.items():
        counts = summary.get("flow") or {}
        done = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v) or "no requests"
        parts.append(f"`{name}` {done}")
    return "Flow control: on (docs/flow-control.md): " + "; ".join(parts) + "."


def slowest(n: int) -> str:
    """The request p99 of `n` falls on (linear interpolation: next to the one slower)."""
    rank = n - math.floor((n - 1) * 0.99)
    if rank == 1:
        return "the slowest"
    suffix = {2: "nd", 3: "rd"}.get(rank % 10 if rank // 10 % 10 != 1 else 0, "th")
    return f"the {rank}{suffix} slowest"


def markdown(
    args: Any, rows: Sequence[Sequence[str]], plots: Sequence[Path], lines_after: Sequence[str]
) -> str:
    """The page: the workload, the cluster, the table, the plots (or why none), the verdict
    and flow control's line (`lines_after`, each skipped when empty)."""
    lines = [
        "# make run: policies side by side",
        "",
        f"Workload `{args.workload}` (seed {args.seed}): {args.requests} requests, "
        f"{args.concurrency} in flight (closed loop), through `urc bench`.",
        f"Cluster: `urc cluster`, a gateway and {args.workers} emulated GPU workers on "
        f"127.0.0.1, {args.capacity_tokens:,} tokens of KV each; one cluster per policy.",
        "",
        markdown_table(rows),
        "",
        "Hit rate: cached / prompt tokens as the workers report them. TTFT and latency as the "
        "client saw them. Prediction error: the gateway's matched tokens against the worker's "
        "cached tokens, in % of the prompt. TTFT p99 of "
        f"{args.requests} requests is {slowest(args.requests)}; the first "
        f"{args.concurrency} start at once into an empty fleet, and `python bench/cold_burst.py` "
        "shows how much of p99 that cold burst decides (docs/benchmarks.md).",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in plots] if plots else [MISSING]
    for line in lines_after:
        if line:
            lines += ["", line]
    return "\n".join(lines) + "\n"
