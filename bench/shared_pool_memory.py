"""How much less KV memory one worker needs when its models share one pool than with a static
per-model split of the same hit rate: GPU pages alone, and GPU + host tier (docs/benchmarks.md).

    python bench/shared_pool_memory.py [--trace PATH] [--gpu-tokens C] [--host-ratio R]
        [--models 2,4,10] [--seeds 0,1] [--quick] [--json PATH]

The worker's cache is driven directly (no HTTP, no timing): requests one after another, each
matched, promoted from the host tier, allocated (LRU eviction), inserted and released."""

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from harness import SHARED_TRACE, log

from backends.cache.check import check
from backends.cache.host import HostTier
from backends.cache.radix import RadixCache
from simulation.traces import read_trace, trace_requests

MIXES = ("even", "zipf", "shifting")
EXPECTED_10 = "0.6-0.8"  # published: a unified pool needs 0.6-0.8 of a 10-model split's memory


@dataclass(slots=True)
class Request:
    keys: list[int]  # prompt blocks, then output blocks (cached when the request finishes)
    prompt_blocks: int
    prompt_tokens: int
    root: int  # the first hash id: requests with one root share a prefix tree


@dataclass(slots=True)
class Served:
    hit_tokens: int = 0
    prompt_tokens: int = 0
    uncached: int = 0  # requests bigger than their pool: served, nothing cached

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def load(path: Path, limit: int | None) -> tuple[list[Request], int]:
    """The trace's requests as block keys (docs/traces.md, "As keys"), and its block size."""
    trace = read_trace(path)
    records = trace.ordered(limit)
    requests = []
    for rec, sim in zip(records, trace_requests(trace, limit=limit), strict=True):
        root = rec.hash_ids[0] if rec.hash_ids else -1 - rec.line
        keys = sim.keys + sim.tail_keys
        requests.append(Request(keys, len(sim.keys), rec.input_length, root))
    return requests, trace.block_size


def assign(requests: Sequence[Request], n: int, mix: str, seed: int) -> list[tuple[Request, int]]:
    """The requests with their models, in serving order. Each prefix tree (root) goes whole to
    one model, drawn when the root first arrives: `even` and `zipf` (1.0) in the trace's order;
    `shifting` draws evenly, then re-times each model's requests (their order kept) so that in
    each of n equal phases the models' rates are Zipf 1.0 with another model first."""
    rng = random.Random(f"{seed}/{mix}/{n}")
    weights = [1.0 / (k + 1) for k in range(n)] if mix == "zipf" else [1.0] * n
    model_of: dict[int, int] = {}
    stream = []
    for r in requests:
        model = model_of.get(r.root)
        if model is None:
            model = model_of[r.root] = rng.choices(range(n), weights)[0]
        stream.append((r, model))
    if mix != "shifting":
        return stream
    own: list[list[Request]] = [[] for _ in range(n)]
    for r, model in stream:
        own[model].append(r)
    timed = []
    for model, reqs in enumerate(own):
        rates = [1.0 / ((model - phase) % n + 1) for phase in range(n)]
        for k, r in enumerate(reqs):
            timed.append((_at(rates, (k + 0.5) / len(reqs)), model, k, r))
    timed.sort(key=lambda t: (t[0], t[1], t[2]))
    return [(r, model) for _, model, _, r in timed]


def _at(rates: list[float], q: float) -> float:
    """Where in [0, 1) the share `q` of a rate piecewise constant over len(rates) phases lies."""
    n = len(rates)
    left = q * sum(rates)
    for phase, rate in enumerate(rates):
        if left <= rate:
            return (phase + left / rate) / n
        left -= rate
    return 1.0


def serve(
    stream: Sequence[tuple[Request, int]],
    bs: int,
    pools: int,
    gpu_blocks: int,
    host_blocks: int,
) -> Served:
    """Replay through `pools` caches of `gpu_blocks` each (+ a host tier of `host_blocks`):
    one pool is the shared one (a kv_group per model), `pools` = models is the split."""
    caches = [RadixCache(gpu_blocks * bs, bs) for _ in range(pools)]
    hosts: list[HostTier | None] = [None] * pools
    if host_blocks > 0:
        for i, cache in enumerate(caches):
            host = HostTier(host_blocks * bs, bs)
            host.attach(cache)
            hosts[i] = host
    served = Served()
    for r, model in stream:
        at = model if pools > 1 else 0
        cache, host = caches[at], hosts[at]
        group = str(model)
        keys = r.keys
        limit = r.prompt_blocks
        match = cache.match(keys, limit, group)
        node = match.node
        cache.lock(node)
        promoted = 0
        if host is not None:
            node, promoted = host.promote(node, keys, match.blocks, limit, group)
        cached = match.blocks + promoted
        served.hit_tokens += min(cached * bs, r.prompt_tokens)
        served.prompt_tokens += r.prompt_tokens
        rest = len(keys) - cached
        if not cache.allocate(rest * bs):
            served.uncached += 1
            cache.unlock(node)
            continue
        ins = cache.insert(node, keys[cached:])
        if rest > ins.inserted:
            cache.free((rest - ins.inserted) * bs)
        cache.move_lock(node, ins.node)
        cache.unlock(ins.node)
    for cache, host in zip(caches, hosts, strict=True):
        check(cache)
        if host is not None:
            host.check()
    return served


@dataclass(slots=True)
class Row:
    models: int
    mix: str
    seed: int
    top_share: float  # the most used model's share of the prompt tokens
    split_hit: float  # GPU alone, split at C
    shared_hit: float  # GPU alone, shared at C
    ratio: float  # the smallest shared GPU pool reaching split_hit, over C
    split_hit_host: float  # GPU + host, split at C + H
    shared_hit_host: float
    ratio_host: float  # the smallest shared GPU + host (same proportion) reaching it, over C + H
    split_uncached: int  # requests bigger than their model's share of the split


def smallest(
    stream: Sequence[tuple[Request, int]],
    bs: int,
    target: float,
    total: int,
    host_ratio: float,
    steps: int,
    at_total: float,
) -> float:
    """The smallest shared pool (GPU blocks, host blocks in proportion) whose hit rate reaches
    `target`, over `total` GPU blocks (`at_total`: its hit rate there): bisection, to
    1/2**steps of the bracket."""

    def hit_rate(gpu: int) -> float:
        return serve(stream, bs, 1, gpu, round(gpu * host_ratio)).hit_rate

    lo, hi = 0, total
    while at_total < target:  # the shared pool short at the split's size: look above it
        if hi >= 16 * total:
            return float("inf")
        lo, hi = hi, 2 * hi
        at_total = hit_rate(hi)
    for _ in range(steps):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if hit_rate(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi / total


def measure(
    requests: Sequence[Request],
    bs: int,
    n: int,
    mix: str,
    seed: int,
    gpu_blocks: int,
    host_ratio: float,
    steps: int,
) -> Row:
    stream = assign(requests, n, mix, seed)
    tokens = [0] * n
    for r, m in stream:
        tokens[m] += r.prompt_tokens
    per = gpu_blocks // n
    per_host = round(per * host_ratio)
    total = per * n
    split = serve(stream, bs, n, per, 0)
    split_host = serve(stream, bs, n, per, per_host)
    shared = serve(stream, bs, 1, total, 0)
    shared_host = serve(stream, bs, 1, total, per_host * n)
    ratio = smallest(stream, bs, split.hit_rate, total, 0.0, steps, shared.hit_rate)
    ratio_host = smallest(
        stream,
        bs,
        split_host.hit_rate,
        total,
        per_host / per,
        steps,
        shared_host.hit_rate,
    )
    return Row(
        n,
        mix,
        seed,
        max(tokens) / sum(tokens),
        split.hit_rate,
        shared.hit_rate,
        ratio,
        split_host.hit_rate,
        shared_host.hit_rate,
        ratio_host,
        split.uncached,
    )


def mean_row(rows: Sequence[Row]) -> Row:
    """The seeds' mean of each number."""
    k = len(rows)
    means = {f.name: sum(getattr(r, f.name) for r in rows) / k for f in fields(Row)[3:]}
    means["split_uncached"] = sum(r.split_uncached for r in rows) // k
    return Row(rows[0].models, rows[0].mix, -1, **means)


def table(rows: Sequence[Row], spread: dict[tuple[int, str], tuple[float, float]]) -> str:
    head = (
        f"{'N':>3} {'mix':<9} {'top':>5} | {'split':>6} {'shared':>6} {'ratio':>5} "
        f"{'(range)':>11} {'big':>4} | {'split':>6} {'shared':>6} {'ratio':>5} {'(range)':>11} "
        "| expected"
    )
    sub = (
        f"{'':>3} {'':<9} {'share':>5} | {'GPU only: hit @C, memory':<37} | "
        f"{'GPU + host: hit @C+H, memory':<32} |"
    )
    lines = [sub, head, "-" * len(head)]
    for r in rows:
        lo, hi = spread[(r.models, r.mix)]
        lo_h, hi_h = spread[(-r.models, r.mix)]
        lines.append(
            f"{r.models:>3} {r.mix:<9} {r.top_share:>5.2f} | {r.split_hit:>6.1%} "
            f"{r.shared_hit:>6.1%} {r.ratio:>5.2f} {f'{lo:.2f}-{hi:.2f}':>11} "
            f"{r.split_uncached:>4} | "
            f"{r.split_hit_host:>6.1%} {r.shared_hit_host:>6.1%} {r.ratio_host:>5.2f} "
            f"{f'{lo_h:.2f}-{hi_h:.2f}':>11} | {EXPECTED_10 if r.models == 10 else ''}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=SHARED_TRACE, help="a Mooncake-format trace")
    ap.add_argument("--requests", type=int, default=None, help="its first N requests (all)")
    ap.add_argument("--gpu-tokens", type=int, default=800_000, help="C: the GPU KV of the worker")
    ap.add_argument("--host-ratio", type=float, default=4.0, help="H = C x this (4: 1.6M per 400k)")
    ap.add_argument("--models", default="2,4,10", help="model counts")
    ap.add_argument("--mixes", default=",".join(MIXES), help="traffic mixes: " + ", ".join(MIXES))
    ap.add_argument("--seeds", default="0,1", help="model assignments drawn; the table: means")
    ap.add_argument("--steps", type=int, default=7, help="bisection steps (1/2**steps of C)")
    ap.add_argument("--quick", action="store_true", help="seed 0, 5 steps, 2 and 4 models")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    steps = 5 if args.quick else args.steps
    counts = [2, 4] if args.quick else [int(n) for n in args.models.split(",")]
    mixes = args.mixes.split(",")
    if not set(mixes) <= set(MIXES):
        ap.error(f"--mixes: one of {', '.join(MIXES)}")
    if not args.trace.exists():
        ap.error(f"no trace at {args.trace}")
    requests, bs = load(args.trace, args.requests)
    gpu_blocks = args.gpu_tokens // bs
    if gpu_blocks < max(counts):
        ap.error("--gpu-tokens: at least one block per model")
    host_blocks = round(gpu_blocks * args.host_ratio)
    one = [(r, 0) for r in requests]
    everything = len({k for r in requests for k in r.keys}) + 1
    bounds = {  # the hit rate of one cache of each size
        "infinite_hit_rate": serve(one, bs, 1, everything, 0).hit_rate,
        "one_pool_hit_rate": serve(one, bs, 1, gpu_blocks, 0).hit_rate,
        "one_pool_host_hit_rate": serve(one, bs, 1, gpu_blocks, host_blocks).hit_rate,
    }
    rows: list[Row] = []
    means: list[Row] = []
    spread: dict[tuple[int, str], tuple[float, float]] = {}
    for n in counts:
        for mix in mixes:
            log(f"{n} models, {mix}")
            got = [
                measure(requests, bs, n, mix, s, gpu_blocks, args.host_ratio, steps) for s in seeds
            ]
            rows.extend(got)
            means.append(mean_row(got))
            spread[(n, mix)] = (min(r.ratio for r in got), max(r.ratio for r in got))
            spread[(-n, mix)] = (min(r.ratio_host for r in got), max(r.ratio_host for r in got))
    sizes = {"block_size": bs, "gpu_tokens": gpu_blocks * bs, "host_tokens": host_blocks * bs}
    print(report(args.trace.name, len(requests), sizes, bounds, seeds))
    print(table(means, spread))
    print("big: requests bigger than their model's GPU share of the split (served, not cached)")
    if args.json is not None:
        result = {"trace": str(args.trace), "requests": len(requests), **sizes, **bounds}
        result |= {"rows": [asdict(r) for r in rows], "means": [asdict(r) for r in means]}
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def report(
    trace: str, requests: int, sizes: dict[str, int], bounds: dict[str, float], seeds: list[int]
) -> str:
    """The lines above the table: the run, one cache's hit rates, what the ratio is."""
    return (
        f"trace {trace}: {requests} requests, blocks of {sizes['block_size']} tokens; one "
        f"worker, C = {sizes['gpu_tokens']:,} GPU tokens, H = {sizes['host_tokens']:,} host "
        f"tokens\nhit rate of one cache: infinite {bounds['infinite_hit_rate']:.1%}, C "
        f"{bounds['one_pool_hit_rate']:.1%}, C + H {bounds['one_pool_host_hit_rate']:.1%} "
        "(capacity bound below the infinite cache's)\nratio: the smallest shared pool reaching "
        "the split's hit rate, over the split's memory; mean over seeds "
        f"{','.join(map(str, seeds))} (range)"
    )


if __name__ == "__main__":
    sys.exit(main())
