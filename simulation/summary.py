"""One run's numbers: what the clients saw, what the workers reused, how the load spread (each
key's definition: docs/cli.md, "The replay's report")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadgen.report import percentile
from simulation.flow import SHARED_TENANT, refusals, tenant_names
from simulation.replay import RunResult
from simulation.requests import SimRequest

# the index's memory per block and per run (tracemalloc, CPython 3.11, keys included)
BYTES_PER_BLOCK = 88
BYTES_PER_RUN = 163


def _stats(values: list[float], prefix: str) -> dict[str, float | None]:
    stats = {
        "mean": math.fsum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values, default=None),
    }
    return {f"{prefix}_{k}_s": v for k, v in stats.items()}


def _workers(
    result: RunResult,
    requests: Sequence[SimRequest],
    sent: list[int],
    done: list[int],
    duration: float,
) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """Each worker's requests, tokens, hit rate and mean in flight; the seconds it was busy."""
    rows: list[dict[str, Any]] = [
        {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0} for _ in result.workers
    ]
    busy = [0.0] * len(result.workers)
    for i in sent:
        rows[result.worker[i]]["requests"] += 1
    for i in done:
        w = result.worker[i]
        rows[w]["prompt_tokens"] += len(requests[i].prompt)
        rows[w]["cached_tokens"] += result.cached_tokens[i]
        busy[w] += result.latency_s[i]
    for w, row in enumerate(rows):
        row["hit_rate"] = (
            row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else None
        )
        row["mean_in_flight"] = busy[w] / duration if duration > 0 else 0.0
    return dict(zip(result.workers, rows, strict=True)), busy


def summarize(result: RunResult, requests: Sequence[SimRequest]) -> dict[str, Any]:
    done = [i for i, ok in enumerate(result.ok) if ok]
    sent = [i for i, w in enumerate(result.worker) if w >= 0]
    prompt = sum(len(requests[i].prompt) for i in done)
    output = sum(requests[i].max_tokens for i in done)
    cached = sum(result.cached_tokens[i] for i in done)
    host = sum(result.host_tokens[i] for i in done)
    predicted = sum(result.predicted_tokens[i] for i in done)
    start = min((result.sent_s[i] for i in sent), default=0.0)
    end = max((result.sent_s[i] + result.latency_s[i] for i in done), default=start)
    duration = end - start
    workers, busy = _workers(result, requests, sent, done, duration)
    mean_busy = math.fsum(busy) / len(busy) if busy else 0.0
    summary: dict[str, Any] = {
        "requests": len(requests),
        "completed": len(done),
        "rejected": len(sent) - len(done),
        "dropped": result.dropped,
        "hit_rate": cached / prompt if prompt else None,
        "gpu_hit_rate": (cached - host) / prompt if prompt else None,
        "host_hit_rate": host / prompt if prompt else None,  # promoted from the host tier
        "predicted_hit_rate": predicted / prompt if prompt else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "host_cached_tokens": host,
        "output_tokens": output,
        "duration_s": duration,
        "throughput_tok_s": (prompt + output) / duration if duration > 0 else None,
        "output_tok_s": output / duration if duration > 0 else None,
        "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else None,
        "index_peak_blocks": result.index_peak_blocks,
        "index_blocks": result.index_blocks,
        "index_residencies": result.index_residencies,
        "index_bytes_est": BYTES_PER_BLOCK * result.index_blocks
        + BYTES_PER_RUN * result.index_runs,
        "kv_events": result.events_applied,
        "reasons": dict(sorted(result.reasons.items())),
        "workers": workers,
    }
    summary.update(_stats([result.ttft_s[i] for i in done], "ttft"))
    summary.update(_stats([result.latency_s[i] for i in done], "latency"))
    if result.refused:
        summary["refused"] = refusals(result.refused)
    if result.adapters:  # LoRA adapters (docs/adapters.md): loads, evictions, unloads
        summary.update({f"adapter_{k}": n for k, n in result.adapters.items()})
    if names := tenant_names(requests):
        summary["tenants"] = tenants(result, requests, names)
    return summary


def tenants(
    result: RunResult, requests: Sequence[SimRequest], names: list[str]
) -> dict[str, dict[str, Any]]:
    """Per tenant: its requests, how many completed and were refused (flow control's 429s),
    and its TTFT p50 and p99 (from when the client sent it: a wait in the gateway's queue
    counts)."""
    rows: dict[str, dict[str, Any]] = {
        name: {"requests": 0, "completed": 0, "refused": 0} for name in names
    }
    ttfts: dict[str, list[float]] = {name: [] for name in names}
    for i, req in enumerate(requests):
        row = rows[req.tenant or SHARED_TENANT]
        row["requests"] += 1
        if result.ok[i]:
            row["completed"] += 1
            ttfts[req.tenant or SHARED_TENANT].append(result.ttft_s[i])
        elif i in result.refused:
            row["refused"] += 1
    for name, row in rows.items():
        row["ttft_p50_s"] = percentile(ttfts[name], 50)
        row["ttft_p99_s"] = percentile(ttfts[name], 99)
    return rows


def series(result: RunResult, requests: Sequence[SimRequest], buckets: int = 60) -> dict[str, Any]:
    """Over `buckets` equal slices of the run: the hit rate of the requests sent in each, and
    each worker's mean requests in flight (what the plots draw)."""
    done = [i for i, ok in enumerate(result.ok) if ok]
    if not done:
        return {"t_s": [], "hit_rate": [], "in_flight": {}}
    start = min(result.sent_s[i] for i in done)
    end = max(result.sent_s[i] + result.latency_s[i] for i in done)
    width = (end - start) / buckets or 1.0
    prompt = [0] * buckets
    cached = [0] * buckets
    load = [[0.0] * buckets for _ in result.workers]
    for i in done:
        t0 = result.sent_s[i]
        b = min(int((t0 - start) / width), buckets - 1)
        prompt[b] += len(requests[i].prompt)
        cached[b] += result.cached_tokens[i]
        row = load[result.worker[i]]
        t1 = t0 + result.latency_s[i]
        while t0 < t1 and b < buckets:  # spread the request's stay over the buckets it spans
            edge = start + (b + 1) * width
            row[b] += (min(t1, edge) - t0) / width
            t0, b = edge, b + 1
    return {
        "t_s": [start + (b + 0.5) * width for b in range(buckets)],
        "hit_rate": [c / p if p else None for c, p in zip(cached, prompt, strict=True)],
        "in_flight": dict(zip(result.workers, load, strict=True)),
    }
