"""A replay's report: the `--json` document (schema "urc.replay/1", docs/cli.md), the terminal
table, the Markdown page and the PNG plots (with matplotlib, the `plot` extra)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from simulation.compare import Run

SCHEMA = "urc.replay/1"


def rounded(value: Any) -> Any:
    """Floats to 6 significant digits (NaN and inf to None), recursively."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def build_report(
    config: Mapping[str, Any],
    summaries: Mapping[str, Mapping[str, Any]],
    bound: float | None,
    recorded: Mapping[str, Any] | None = None,
    shadow: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "config": config,
        "policies": summaries,
        "bound": {"hit_rate": bound},
    }
    optional = {"recorded": recorded, "shadow": shadow}
    report.update({key: value for key, value in optional.items() if value is not None})
    return rounded(report)


def write_json(report: Mapping[str, Any], path: str | Path) -> None:
    text = json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"
    Path(path).write_text(text, encoding="utf-8")


COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("hit rate", "hit_rate", "pct"),
    ("TTFT mean", "ttft_mean_s", "ms"),
    ("TTFT p50", "ttft_p50_s", "ms"),
    ("TTFT p99", "ttft_p99_s", "ms"),
    ("lat p50", "latency_p50_s", "ms"),
    ("lat p99", "latency_p99_s", "ms"),
    ("tok/s", "throughput_tok_s", "int"),
    ("imbalance", "load_imbalance", "x"),
    ("index MB", "index_bytes_est", "mb"),
)

TIER_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("GPU hits", "gpu_hit_rate", "pct"),
    ("host hits", "host_hit_rate", "pct"),
)


_FORMATS: dict[str, Callable[[Any], str]] = {
    "pct": lambda v: f"{v * 100:.1f}%",
    "ms": lambda v: f"{v * 1e3:.0f}ms",
    "x": lambda v: f"{v:.2f}",
    "mb": lambda v: f"{v / 1e6:.1f}",
    "int": lambda v: f"{v:,.0f}",
}


def cell(value: Any, kind: str) -> str:
    return "-" if value is None else _FORMATS[kind](value)


def named_rows(
    corner: str, columns: Sequence[tuple[str, str, str]], named: Mapping[str, Mapping[str, Any]]
) -> list[list[str]]:
    """A header (`corner`, the columns' titles), then a row a name: its values' cells."""
    rows = [[corner, *(title for title, _, _ in columns)]]
    for name, values in named.items():
        rows.append([name, *(cell(values.get(key), kind) for _, key, kind in columns)])
    return rows


def table_rows(
    summaries: Mapping[str, Mapping[str, Any]],
    bound: float | None,
    speeds: Mapping[str, float] | None = None,
) -> list[list[str]]:
    """The policies' table (with `speeds`, its wall-clock column), the bound last."""
    columns = COLUMNS
    if any(s.get("host_hit_rate") for s in summaries.values()):  # a host tier served hits
        columns = (COLUMNS[0], *TIER_COLUMNS, *COLUMNS[1:])
    if any(s.get("adapter_loads") for s in summaries.values()):  # LoRA adapters' loads
        columns = (*columns, ("adapter loads", "adapter_loads", "int"))
    rows = named_rows("policy", columns, summaries)
    if speeds is not None:
        rows[0].append("sim req/s")
        for name, row in zip(summaries, rows[1:], strict=True):
            row.append(cell(speeds.get(name, 0.0), "int"))
    tail = ["bound: 1 infinite cache", cell(bound, "pct")]
    rows.append(tail + ["-"] * (len(rows[0]) - len(tail)))
    return rows


TENANT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "int"),
    ("completed", "completed", "int"),
    ("refused", "refused", "int"),
    ("TTFT p50", "ttft_p50_s", "ms"),
    ("TTFT p99", "ttft_p99_s", "ms"),
)


def tenant_rows(summaries: Mapping[str, Mapping[str, Any]]) -> list[list[str]] | None:
    """Each policy's tenants (`policy / tenant`), where the requests name tenants."""
    named = {
        f"{policy} / {tenant}": row
        for policy, s in summaries.items()
        for tenant, row in s.get("tenants", {}).items()
    }
    return named_rows("policy / tenant", TENANT_COLUMNS, named) if named else None


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in [rows[0], ["-" * w for w in widths], *rows[1:]]:  # the header, a rule, the rows
        cells = zip(row[1:], widths[1:], strict=True)
        lines.append("  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in cells)]))
    return "\n".join(lines)


def write_out(
    out: Path,
    report: Mapping[str, Any],
    runs: Mapping[str, Run],
    bound: float | None,
    shadow: Sequence[Sequence[str]] | None = None,
) -> None:
    """--out DIR: report.json, series.json, the plots and report.md (`shadow`: its rows)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "report.json")
    curves = {name: run.series for name, run in runs.items()}
    (out / "series.json").write_text(
        json.dumps(rounded(curves), sort_keys=True) + "\n", encoding="utf-8"
    )
    ttfts = {name: run.result.ttft_s for name, run in runs.items()}
    written = write_plots(out, ttfts, curves, bound)
    if not written:
        print(f"urc replay: {MISSING}", file=sys.stderr)
    (out / "report.md").write_text(markdown(report, written, shadow), encoding="utf-8")
    print(f"report: {out / 'report.md'}")


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def _host_tier(fleet: Mapping[str, Any]) -> str:
    tokens = fleet.get("host_capacity_tokens") or 0
    if not tokens:
        return ""
    rate = fleet.get("host_copy_tokens_per_s") or 0
    return f" (+ {tokens:,} on a host tier copied at {rate:,.0f} tokens/s)"


def markdown(
    report: Mapping[str, Any], plots: Sequence[str], shadow: Sequence[Sequence[str]] | None = None
) -> str:
    """A short page: what was replayed on what, the table, the plots (or why none), the shadows."""
    cfg = report["config"]
    fleet = cfg.get("fleet", {})
    rows = table_rows(report["policies"], report["bound"]["hit_rate"])
    source = cfg.get("trace") or f"workload {cfg.get('workload')}"
    lines = [
        "# urc replay",
        "",
        f"Source: `{source}`, {cfg.get('requests')} requests, seed {cfg.get('seed')}.",
        f"Fleet: {fleet.get('workers')} emulated workers, "
        f"{fleet.get('capacity_tokens'):,} tokens of KV each{_host_tier(fleet)}, prefill "
        f"{fleet.get('prefill_tokens_per_s'):,.0f} tokens/s, blocks of "
        f"{fleet.get('block_size')} tokens, KV events after {fleet.get('event_delay_s')} s"
        + ("." if fleet.get("kv_events", True) else " (off: approximate residency)."),
        "",
        markdown_table(rows),
        "",
        "Hit rate: cached / prompt tokens as the workers report them. TTFT and latency from "
        "the client's send. Imbalance: max / mean of the workers' mean requests in flight. "
        "The bound: every request on one worker that never evicts.",
    ]
    recorded = report.get("recorded")
    if recorded and recorded.get("hit_rate") is not None:
        lines += [
            "",
            f"Recorded live under `{recorded.get('policy')}`: hit rate "
            f"{recorded['hit_rate'] * 100:.1f}% over {recorded.get('requests')} requests.",
        ]
    if tenants := tenant_rows(report["policies"]):
        lines += ["", "Per tenant (refused: flow control's 429s):", "", markdown_table(tenants)]
    lines += ["", "Decisions by reason:", ""]
    for name, s in report["policies"].items():
        text = ", ".join(f"{k} {v}" for k, v in s.get("reasons", {}).items())
        lines.append(f"- `{name}`: {text}")
    lines.append("")
    lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots] if plots else [MISSING]
    if shadow is not None:
        lines += ["", "Shadow policies on the recorded decisions:", "", markdown_table(shadow)]
    return "\n".join(lines) + "\n"


MISSING = (
    "Plots were not written: matplotlib is not installed (pip install 'unified-radix-cache[plot]')."
)


def write_plots(
    out: Path,
    ttfts: Mapping[str, Sequence[float]],
    series: Mapping[str, Mapping[str, Any]],
    bound: float | None,
) -> list[str]:
    """Write the three PNGs into `out`; their paths. [] when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_cdf(ax, ttfts)
    ax.set(xscale="log", xlabel="time to first token (s)", ylabel="fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    paths.append(save_figure(fig, out / "ttft_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in series.items():
        points = [(t, h) for t, h in zip(s["t_s"], s["hit_rate"], strict=True) if h is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] * 100 for p in points], label=name)
    if bound is not None:
        ax.axhline(bound * 100, color="grey", linestyle="--", label="1 infinite cache (all)")
    ax.set(xlabel="time (s)", ylabel="hit rate (% of prompt tokens)", title="Hit rate over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(save_figure(fig, out / "hit_rate.png", plt))

    n = max(1, len(series))
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.4 * n), sharex=True, squeeze=False)
    for ax, (name, s) in zip(axes[:, 0], series.items(), strict=False):
        for worker, load in s["in_flight"].items():
            ax.plot(s["t_s"], load, linewidth=0.9, label=worker)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("in flight")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("time (s)")
    if len(next(iter(series.values()), {}).get("in_flight", {})) <= 16:
        axes[0, 0].legend(fontsize=6, ncol=4)
    fig.suptitle("Requests in flight per worker")
    paths.append(save_figure(fig, out / "worker_load.png", plt))
    return paths


def plot_cdf(ax: Any, curves: Mapping[str, Sequence[float]]) -> None:
    """One step curve per name on `ax`: the fraction of its values at or below x (nan and values
    <= 0, which never happened, left out)."""
    for name, values in curves.items():
        xs = sorted(v for v in values if not math.isnan(v) and v > 0)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)


def save_figure(fig: Any, path: Path, plt: Any) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
