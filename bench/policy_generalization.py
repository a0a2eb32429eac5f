"""Does `cache_aware` win beyond the trace it was looked at on? Policies x workloads, offline.

    python bench/policy_generalization.py [--seeds 0,1,2] [--quick] [--variant LABEL:K=V,...]

Hit rate and TTFT per policy and scenario, and wins/ties/losses (docs/benchmarks.md)."""

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness import SHARED_TRACE

from backends.emulated.config import EngineConfig
from router.policies import make_policy
from simulation.compare import build_params
from simulation.replay import FleetConfig, Replay
from simulation.requests import SimRequest
from simulation.summary import summarize
from simulation.traces import parse_trace, read_trace, trace_requests
from simulation.workloads import workload_requests

BLOCK = 512  # tokens per hash id, as in Mooncake's traces
HIT_TIE = 0.002  # hit rates this close are a tie (0.2 points)
P99_TIE = 0.01  # p99 TTFTs within 1% are a tie


@dataclass(slots=True)
class Synthetic:
    """A Mooncake-style trace: shared documents (Zipf), sessions, unique suffixes."""

    seed: int
    requests: int = 2500
    rate: float = 4.0  # requests/s, Poisson
    docs: int = 400  # shared prefixes (system prompts, documents)
    zipf: float = 1.0  # popularity skew of the documents
    doc_blocks: float = 16.0  # mean document length in blocks (lognormal)
    unique_blocks: float = 6.0  # mean unique suffix per request in blocks (lognormal)
    session_p: float = 0.3  # chance a request continues an open session
    turn_blocks: float = 3.0  # mean new blocks per follow-up turn
    output_tokens: float = 150.0  # mean output length
    fanout: int = 1  # requests sent at once on each newly drawn document

    def records(self) -> list[str]:
        rng = random.Random(f"synthetic/{self.seed}")
        next_id = iter(range(1 << 62))

        def fresh(mean: float) -> list[int]:  # new hash ids, lognormally many
            sigma = 0.8
            count = max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))
            return [next(next_id) for _ in range(count)]

        docs = [fresh(self.doc_blocks) for _ in range(self.docs)]
        weights = [1.0 / (k + 1) ** self.zipf for k in range(self.docs)]
        sessions: list[list[int]] = []
        t, lines = 0.0, []
        while len(lines) < self.requests:
            if sessions and rng.random() < self.session_p:
                s = rng.randrange(len(sessions))
                ids = sessions[s] = sessions[s] + fresh(self.turn_blocks)
                if rng.random() < 0.25:  # the conversation ends
                    sessions.pop(s)
                batch = [ids]
            else:
                (doc,) = rng.choices(docs, weights)
                # fan-out: parallel calls on one document, each with its own question
                batch = [doc + fresh(self.unique_blocks) for _ in range(self.fanout)]
                sessions.append(batch[0])
                if len(sessions) > 64:
                    sessions.pop(0)
            for k, ids in enumerate(batch):
                length = (len(ids) - 1) * BLOCK + rng.randint(1, BLOCK)
                out = max(1, int(rng.expovariate(1.0 / self.output_tokens)))
                record = {
                    "timestamp": int(t * 1000) + 5 * k,
                    "input_length": length,
                    "output_length": out,
                    "hash_ids": ids,
                }
                lines.append(json.dumps(record))
            t += rng.expovariate(self.rate)
        return lines


@dataclass(slots=True)
class Scenario:
    name: str
    requests: Callable[[], list[SimRequest]]
    workers: int
    capacity_tokens: int
    block_size: int = BLOCK
    names: str = "w"  # worker names are this + 0, 1, ... (rendezvous hashes them)


def _shared_trace(time_scale: float) -> Callable[[], list[SimRequest]]:
    return lambda: trace_requests(read_trace(SHARED_TRACE), time_scale=time_scale)


def _fleet(name: str) -> tuple[int, int]:
    """The fleet a scenario's name gives: `8x400k` is 8 workers of 400k tokens each."""
    size = next(word for word in name.split() if "x" in word and word.endswith("k"))
    workers, _, capacity = size.partition("x")
    return int(workers), int(capacity[:-1]) * 1000


def scenarios(quick: bool, seed: int = 0) -> list[Scenario]:
    """The scenarios; `seed` draws other synthetic traces and workloads of the same shapes."""
    n = 1200 if quick else 2500
    k = 100 * seed
    out: list[Scenario] = []

    def docs(name: str, i: int, **shape: Any) -> Scenario:
        spec = Synthetic(k + i, n, **shape)

        def requests() -> list[SimRequest]:
            return trace_requests(parse_trace(spec.records(), f"synthetic/{spec.seed}"))

        return Scenario(name, requests, *_fleet(name))

    def load(name: str, rate: float, **params: Any) -> Scenario:
        def requests() -> list[SimRequest]:
            return workload_requests(name.split()[0], n, seed=7 + seed, rate=rate, params=params)

        return Scenario(name, requests, *_fleet(name), block_size=16)

    if SHARED_TRACE.exists():
        for name, scale in [("8x400k", 1.0), ("16x200k", 1.0), ("4x800k slow", 2.0)]:
            out.append(Scenario(f"mooncake {name}", _shared_trace(scale), *_fleet(name)))
    out += [
        docs("docs zipf1.0 8x400k", 1, rate=4.0),
        docs("docs long 8x200k", 2, rate=2.0, docs=200, doc_blocks=40, unique_blocks=10),
        docs("hot docs 4x400k busy", 3, rate=4.5, docs=60, zipf=1.2, unique_blocks=4),
        docs("chats 16x200k", 4, rate=8.0, docs=100, session_p=0.6, unique_blocks=4),
        docs("flat docs 8x300k", 5, rate=5.0, docs=1500, zipf=0.6, doc_blocks=10),
        docs("unique long 8x400k", 6, rate=3.0, docs=800, unique_blocks=24, session_p=0.2),
        docs("agents 8x400k", 7, rate=3.0, docs=30, session_p=0.8, turn_blocks=8.0),
        docs("flat docs 8x400k busy", 8, rate=7.0, docs=2000, zipf=0.8, doc_blocks=12),
        docs("fan-out 8x400k", 9, rate=1.0, docs=300, doc_blocks=30, session_p=0.1, fanout=4),
        load("system-prompts 8x24k", 30.0, groups=60, prefix_tokens=3000),
        load("multi-turn 4x16k", 40.0, sessions=48, turns=6, system_tokens=1000),
        load("mixed 16x8k", 60.0),
    ]
    if seed:
        for sc in out:
            sc.names = f"s{seed}w"
    return out


def run(
    scenario: Scenario, requests: list[SimRequest], name: str, params: dict[str, str]
) -> dict[str, Any]:
    fleet = FleetConfig(
        workers=scenario.workers,
        names=[f"{scenario.names}{i}" for i in range(scenario.workers)],
        engine=EngineConfig(
            block_size=scenario.block_size, capacity_tokens=scenario.capacity_tokens
        ),
    )
    for key in [k for k in params if k.startswith("fleet.")]:  # e.g. fleet.pending_ttl_s=10
        setattr(fleet, key[6:], float(params[key]))
    params = {k: v for k, v in params.items() if not k.startswith("fleet.")}
    policy = make_policy(name, build_params(name, {}, fleet, 0), **params)
    return summarize(Replay(requests, policy, fleet).run(), requests)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="cache_aware,sglang,round_robin")
    p.add_argument("--only", default="", help="comma-separated scenario names (substrings)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...")
    p.add_argument("--quick", action="store_true", help="fewer requests per synthetic scenario")
    p.add_argument("--seeds", default="0", help="comma-separated scenario seeds")
    args = p.parse_args()
    rows = [(n, n, {}) for n in args.policies.split(",") if n]  # (label, policy, params)
    for item in args.variant:
        label, _, rest = item.partition(":")
        rows.append((label, "cache_aware", dict(x.split("=", 1) for x in rest.split(",") if x)))
    only = [s for s in args.only.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    t0 = time.perf_counter()
    header = f"{'scenario':25s} {'policy':14s} {'hit':>6s} {'p50 ms':>7s} {'p99 ms':>7s}"
    print(header + "\n" + "-" * len(header))
    for seed in seeds:
        for sc in scenarios(args.quick, seed):
            if only and not any(o in sc.name for o in only):
                continue
            title = sc.name if len(seeds) == 1 else f"{sc.name} #{seed}"
            requests = sc.requests()
            results[title] = {}
            for label, name, params in rows:
                s = results[title][label] = run(sc, requests, name, params)
                hit, p50, p99 = s["hit_rate"], s["ttft_p50_s"] * 1e3, s["ttft_p99_s"] * 1e3
                print(f"{title:25s} {label:14s} {hit:6.1%} {p50:7.0f} {p99:7.0f}", flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    ours = [label for label, name, _ in rows if name == "cache_aware"]
    summary(results, ours, [label for label, name, _ in rows if name != "cache_aware"])
    return 0


def summary(
    results: dict[str, dict[str, dict[str, Any]]], ours: list[str], others: list[str]
) -> None:
    """Wins/ties/losses of each cache_aware row against each baseline, and the worst case."""
    for mine in ours:
        for other in others:
            hit, p99 = [0, 0, 0], [0, 0, 0]  # win, tie, loss
            worst_hit, worst_p99 = 0.0, 0.0
            for rows in results.values():
                a, b = rows[mine], rows[other]
                dh = a["hit_rate"] - b["hit_rate"]
                hit[0 if dh > HIT_TIE else 1 if dh >= -HIT_TIE else 2] += 1
                worst_hit = min(worst_hit, dh)
                rp = a["ttft_p99_s"] / b["ttft_p99_s"] - 1
                p99[0 if rp < -P99_TIE else 1 if rp <= P99_TIE else 2] += 1
                worst_p99 = max(worst_p99, rp)
            print(
                f"{mine} vs {other}: hit win/tie/loss {hit[0]}/{hit[1]}/{hit[2]} "
                f"(worst {worst_hit * 100:+.1f} pts); p99 win/tie/loss {p99[0]}/{p99[1]}/{p99[2]} "
                f"(worst {worst_p99:+.0%})"
            )


if __name__ == "__main__":
    sys.exit(main())
