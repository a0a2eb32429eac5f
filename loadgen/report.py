"""A run's results -> the summary (`--json`: schema `urc.bench/1`, docs/cli.md) and a table."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the replay reads this module too: no HTTP client at its start
    from loadgen.client import RequestResult

SCHEMA = "urc.bench/1"
_STATS = ("mean", "p50", "p90", "p99", "max")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(_STATS)
    quantiles = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    return {"mean": sum(values) / len(values), **quantiles, "max": max(values)}


_ROW = ("index", "model", "tenant", "session_id", "group_id", "start_s", "error", "detail")
_ROW += ("status", "ttft_s", "latency_s", "prompt_tokens", "output_tokens")


def request_row(r: RequestResult) -> dict[str, Any]:
    row = {name: getattr(r, name) for name in _ROW}
    row["cached_tokens"] = r.actual_cached_tokens
    row["predicted_tokens"] = r.predicted_tokens
    row["worker"] = r.route.worker if r.route else None
    row["route_reason"] = r.route.reason if r.route else None
    return row


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _cache(results: Sequence[RequestResult]) -> tuple[int, int, list[float]]:
    """Prompt and cached tokens summed over the ok requests that report both; the gaps: predicted
    - actual cached tokens in % of the prompt, where such a request also reports a prediction."""
    prompt = cached = 0
    gaps: list[float] = []
    for r in results:
        if not r.ok or r.prompt_tokens is None or (actual := r.actual_cached_tokens) is None:
            continue
        prompt += r.prompt_tokens
        cached += actual
        if r.predicted_tokens is not None and r.prompt_tokens > 0:
            gaps.append(100.0 * (r.predicted_tokens - actual) / r.prompt_tokens)
    return prompt, cached, gaps


def _per_worker(results: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    """Requests, hit rate and prediction error of each worker that answered, by name."""
    by_worker: dict[str, list[RequestResult]] = {}
    for r in results:
        if r.route is not None and r.route.worker is not None:
            by_worker.setdefault(r.route.worker, []).append(r)
    workers: dict[str, dict[str, Any]] = {}
    for name, answered in sorted(by_worker.items()):
        prompt, cached, gaps = _cache(answered)
        workers[name] = {
            "requests": len(answered),
            "ok": sum(1 for r in answered if r.ok),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else None,
            "prediction_mae_pct": _mean([abs(g) for g in gaps]),
        }
    return workers


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    dropped: int = 0,
    config: Mapping[str, Any] | None = None,
    per_request: bool = False,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if r.error not in (None, "cancelled"))
    output = sum(r.output_tokens for r in ok)
    prompt_reported, cached_reported, gaps = _cache(ok)
    summary: dict[str, Any] = {
        "schema": SCHEMA,
        "config": dict(config or {}),
        "duration_s": duration_s,
        "counts": {
            "sent": len(results),
            "ok": len(ok),
            "failed": sum(errors.values()),
            "cancelled": sum(1 for r in results if r.error == "cancelled"),
            "dropped": dropped,
        },
        "errors": dict(sorted(errors.items())),
        "error_examples": {
            kind: next(r.detail for r in results if r.error == kind) for kind in sorted(errors)
        },
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "latency_s": distribution([r.latency_s for r in ok if r.latency_s is not None]),
        "throughput": {
            "requests_per_s": len(ok) / duration_s if duration_s > 0 else None,
            "output_tokens_per_s": output / duration_s if duration_s > 0 else None,
        },
        "tokens": {
            "prompt": sum(r.prompt_tokens or 0 for r in ok),
            "cached": sum(r.actual_cached_tokens or 0 for r in ok),
            "output": output,
        },
        "hit_rate": cached_reported / prompt_reported if prompt_reported else None,
        "prediction": {
            "compared": len(gaps),
            "mae_pct": _mean([abs(g) for g in gaps]),
            "bias_pct": _mean(gaps),
        },
        "workers": _per_worker(results),
    }
    if per_request:
        summary["requests"] = [request_row(r) for r in results]
    return summary


def write_json(summary: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def format_report(summary: Mapping[str, Any]) -> str:
    """The summary as a few aligned lines for a terminal."""
    cfg, counts, tput = summary["config"], summary["counts"], summary["throughput"]
    source = cfg.get("workload") or cfg.get("trace") or "?"
    lines = [f"urc bench  {cfg.get('target', '?')}  {source}  mode={cfg.get('mode', '?')}"]
    errs = ", ".join(f"{k} {v}" for k, v in summary["errors"].items())
    lines.append(
        f"requests    {counts['sent']} sent  {counts['ok']} ok  {counts['failed']} failed"
        + (f" ({errs})" if errs else "")
        + f"  {counts['cancelled']} cancelled  {counts['dropped']} dropped"
        + f"  in {summary['duration_s']:.2f}s"
    )
    for kind, detail in summary["error_examples"].items():
        lines.append(f"  {kind + ':':14}{detail[:84]}")
    if tput["requests_per_s"] is not None:
        lines.append(
            f"throughput  {tput['requests_per_s']:.2f} req/s"
            f"  {tput['output_tokens_per_s']:.1f} output tok/s"
        )
    lines.append(f"{'':12}" + "".join(f"{s:>10}" for s in _STATS))
    for label, key in (("TTFT ms", "ttft_s"), ("latency ms", "latency_s")):
        lines.append(f"{label:12}" + "".join(f"{_ms(summary[key][s]):>10}" for s in _STATS))
    tok = summary["tokens"]
    lines.append(
        f"cache       hit rate {_pct(summary['hit_rate'])}"
        f"  ({tok['cached']:,} of {tok['prompt']:,} prompt tokens cached, as workers report)"
    )
    pred = summary["prediction"]
    if pred["compared"]:
        lines.append(
            f"prediction  MAE {pred['mae_pct']:.2f}% of prompt tokens"
            f"  (bias {pred['bias_pct']:+.2f}%) over {pred['compared']} requests"
        )
    if summary["workers"]:
        width = max(12, *(len(name) + 2 for name in summary["workers"]))
        lines.append(
            f"{'worker':{width}}{'requests':>10}{'ok':>10}{'hit rate':>10}{'pred MAE':>10}"
        )
        for name, w in summary["workers"].items():
            hit = _pct(w["hit_rate"])
            mae = w.get("prediction_mae_pct")
            err = "-" if mae is None else f"{mae:.2f}%"
            lines.append(f"{name:{width}}{w['requests']:>10}{w['ok']:>10}{hit:>10}{err:>10}")
    return "\n".join(lines)
