"""PNG plots of a replay, when matplotlib is installed (the `plot` extra); optional otherwise.

ttft_cdf.png      TTFT distribution per policy (log time axis)
hit_rate.png      hit rate of the requests sent in each slice of the run, per policy
worker_load.png   each worker's mean requests in flight over time, one panel per policy
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
    for name, values in ttfts.items():
        xs = sorted(v for v in values if not math.isnan(v) and v > 0)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "ttft_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in series.items():
        points = [(t, h) for t, h in zip(s["t_s"], s["hit_rate"], strict=True) if h is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] * 100 for p in points], label=name)
    if bound is not None:
        ax.axhline(bound * 100, color="grey", linestyle="--", label="1 infinite cache (all)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_title("Hit rate over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "hit_rate.png", plt))

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
    paths.append(_save(fig, out / "worker_load.png", plt))
    return paths


def _save(fig: Any, path: Path, plt: Any) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
