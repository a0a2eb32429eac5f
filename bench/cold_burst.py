"""How much of `make run`'s TTFT p99 its cold burst decides, and the best any split of it does.

    python bench/cold_burst.py [--seed 0] [--policies cache_aware,round_robin] [--requests 400]

A closed loop starts with `--concurrency` requests at once into an empty fleet: all cold misses.
Each policy's run of make run's workload is replayed (`urc replay`'s engine model), with its
TTFT p99, max and mean and how many of its slowest requests are in that first burst. Then every
split of the burst over the workers is tried (requests that are interchangeable, same length and
same sharing, counted once), each worker's share through the emulated engine as the replay sends
it (all of it before the worker's first step), the rest of the run's TTFTs as the policy had
them: the lowest p99 a split reaches without a higher max TTFT than the policy's
(docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from functools import cache

import harness

from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request
from router.policies import make_policy
from simulation.cli import build_parser, load
from simulation.replay import FleetConfig, Replay, RunResult
from simulation.requests import SimRequest

MAX_SPLITS = 2_000_000  # beyond this the burst has too many kinds of request to try every split


def shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def kinds(burst: list[SimRequest]) -> list[list[SimRequest]]:
    """The burst in classes of interchangeable requests: the same length, sharing nothing with
    the rest of the burst, or all sharing the same prefix with each other and nothing else."""
    by_head: dict[int | None, list[SimRequest]] = {}
    for r in burst:
        by_head.setdefault(r.keys[0] if r.keys else None, []).append(r)
    loners: dict[int, list[SimRequest]] = {}
    out: list[list[SimRequest]] = []
    for head, group in by_head.items():
        if head is None or len(group) == 1:
            for r in group:
                loners.setdefault(len(r.prompt), []).append(r)
            continue
        lengths = {len(r.prompt) for r in group}
        shares = {shared_blocks(a.keys, b.keys) for a, b in itertools.combinations(group, 2)}
        if len(lengths) == 1 and len(shares) == 1:
            out.append(group)
        else:
            out.extend([r] for r in group)
    return out + list(loners.values())


def describe(group: list[SimRequest]) -> str:
    tokens = len(group[0].prompt)
    if len(group) > 1 and group[0].keys and group[0].keys[0] == group[1].keys[0]:
        shared = shared_blocks(group[0].keys, group[1].keys) * group[0].route.block_size
        return f"{len(group)} x {tokens} tokens, sharing {shared}"
    return f"{len(group)} x {tokens} tokens, sharing none"


def compositions(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in compositions(n - first, parts - 1):
            yield (first, *rest)


def burst_bound(
    burst: list[SimRequest], rest: list[float], fleet: FleetConfig, cap_s: float
) -> tuple[float, float, tuple[tuple[int, ...], ...]] | None:
    """(p99, max, per-worker counts of each kind) of the split with the lowest p99 whose max
    TTFT is at most `cap_s`; None when there are too many splits to try."""
    groups = kinds(burst)
    workers = fleet.workers
    if math.prod(math.comb(len(g) + workers - 1, workers - 1) for g in groups) > MAX_SPLITS:
        return None
    config = fleet.engine_config()

    @cache
    def ttfts(counts: tuple[int, ...]) -> tuple[float, ...]:
        """First-token times of one worker given counts[k] requests of kind k, all sent at 0."""
        engine = EmulatedEngine(config)
        sent = [r for g, n in zip(groups, counts, strict=True) for r in g[:n]]
        reqs = [
            Request(i, r.prompt, r.max_tokens, r.salt, 0.0, r.keys, r.tail_keys)
            for i, r in enumerate(sent)
        ]
        for req in reqs:
            engine.submit(req)
        now: float | None = 0.0
        while now is not None and any(r.first_token_time is None for r in reqs):
            engine.step(now)
            now = engine.next_time()
        return tuple(r.first_token_time or math.inf for r in reqs)

    best: tuple[float, float, tuple[tuple[int, ...], ...]] | None = None
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for split in itertools.product(*(compositions(len(g), workers) for g in groups)):
        per_worker = tuple(sorted(zip(*split, strict=True)))  # workers are interchangeable
        if per_worker in seen:
            continue
        seen.add(per_worker)
        times = [t for counts in per_worker for t in ttfts(counts)]
        top = max(times)
        if top > cap_s:
            continue
        p99 = harness.percentile(rest + times, 0.99)
        if best is None or p99 < best[0]:
            best = (p99, top, per_worker)
    return best


def tail_size(n: int) -> int:
    """How many of `n` requests p99 reaches into (linear interpolation): 5 of 400."""
    return n - math.floor((n - 1) * 0.99)


def report(
    name: str, run: RunResult, requests: list[SimRequest], burst_ids: list[int], fleet: FleetConfig
) -> None:
    """The policy's p99, max and mean, and the lowest p99 a split of its burst reaches."""
    sortable = [-math.inf if math.isnan(t) else t for t in run.ttft_s]
    ttft = [t for t in run.ttft_s if not math.isnan(t)]
    p99, top = harness.percentile(ttft, 0.99), max(ttft)
    in_burst = set(burst_ids)
    k = tail_size(len(ttft))
    slowest = sorted(range(len(requests)), key=lambda i: -sortable[i])[:k]
    print(
        f"\n{name}: p99 {p99 * 1e3:.1f}  max {top * 1e3:.1f}  mean "
        f"{sum(ttft) / len(ttft) * 1e3:.1f}  ({sum(i in in_burst for i in slowest)} of the "
        f"{k} slowest in the burst)"
    )
    rest = [t for i, t in enumerate(run.ttft_s) if i not in in_burst and not math.isnan(t)]
    burst = [requests[i] for i in burst_ids]
    for cap in (top + 1e-9, math.inf):
        bound = burst_bound(burst, rest, fleet, cap)
        if bound is None:
            print("  too many kinds of request in the burst to try every split")
            return
        low, worst, split = bound
        within = f"max <= {top * 1e3:.1f}" if cap < math.inf else "any max"
        print(
            f"  lowest p99 of a split of the burst with {within}: {low * 1e3:.1f} "
            f"(max {worst * 1e3:.1f}; requests of each kind per worker: {split})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--capacity-tokens", type=int, default=30_000)
    parser.add_argument("--workload", default="mixed")
    args = parser.parse_args()
    replay_args = build_parser().parse_args(
        ["--workload", args.workload, "--requests", str(args.requests)]
        + ["--concurrency", str(args.concurrency), "--workers", str(args.workers)]
        + ["--capacity-tokens", str(args.capacity_tokens), "--seed", str(args.seed)]
    )
    requests, _, fleet, _ = load(replay_args)
    print(
        f"{args.workload} x {args.requests}, {args.concurrency} in flight, {args.workers} "
        f"workers x {args.capacity_tokens} tokens, seed {args.seed} (replay; TTFT in ms)"
    )
    runs = {
        name: Replay(requests, make_policy(name), fleet).run() for name in args.policies.split(",")
    }
    # a closed loop sends the same first requests under any policy
    first = next(iter(runs.values()))
    burst_ids = sorted(range(len(requests)), key=lambda i: first.sent_s[i])[: args.concurrency]
    for k, group in enumerate(kinds([requests[i] for i in burst_ids])):
        print(f"burst kind {k}: {describe(group)}")
    for name, run in runs.items():
        report(name, run, requests, burst_ids, fleet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
