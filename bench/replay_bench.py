"""How fast `urc replay` runs, and (with --fidelity) how close it is to a live cluster.

    python bench/replay_bench.py [--breakdown] [--profile POLICY] [--fidelity | --fidelity-cases]

Requests per CPU second against in-run baselines, or live vs offline (docs/benchmarks.md)."""

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import SHARED_TRACE

from backends.emulated.config import EngineConfig
from core import native
from router.policies import make_policy
from simulation.compare import build_params, policy_names
from simulation.replay import FleetConfig, Replay, RunResult
from simulation.traces import read_trace, trace_requests

TARGET = 50_000
SOURCE_ENV = {**os.environ, "URC_PURE_PYTHON": "1"}  # every module from its Python source
FIDELITY_PARAMS = ["groups=40", "question_tokens=400"]  # of the default workload
# FidelityCase's fields that --fidelity-NAME sets, and their defaults here
FIDELITY = dict(
    requests=1200,
    workers=8,
    capacity_tokens=30_000,
    prefill_tokens_per_s=5e3,
    concurrency=24,
    host_capacity_tokens=0,  # each worker's host tier (docs/tiers.md)
)


def _timed(obj: Any, attr: str, totals: dict[str, float], label: str) -> None:
    inner: Callable[..., Any] = getattr(obj, attr)
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + clock() - t0

    setattr(obj, attr, wrapper)


def speed(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    trace = read_trace(args.trace)
    requests = trace_requests(trace, limit=args.requests)
    load_s = time.perf_counter() - t0
    engine = EngineConfig(block_size=trace.block_size, capacity_tokens=args.capacity_tokens)
    fleet = FleetConfig(workers=args.workers, engine=engine)
    n = len(requests)
    print(
        f"{Path(args.trace).name}: {n} requests, blocks of {trace.block_size} tokens, "
        f"{args.workers} workers x {args.capacity_tokens:,} tokens of KV; read + keyed in "
        f"{load_s * 1e3:.0f} ms ({n / load_s:,.0f} requests/s, once for every policy)"
    )
    print(
        f"{'policy':16s}{'req/s':>10s}{'x target':>10s}{'python':>10s}{'x python':>10s}"
        f"{'per-step':>10s}{'x per-step':>12s}{'steps/req':>11s}{'events/req':>12s}"
    )
    for name in policy_names(args.policies):
        runs = [_replay_speed(requests, name, fleet) for _ in range(args.repeat)]
        best, result = max(rate for rate, _ in runs), runs[-1][1]
        if args.rate_only:  # the child of `_source_speed`
            print(best)
            return
        python, per_step = f"{'-':>10s}{'-':>10s}", f"{'-':>10s}{'-':>12s}"
        if args.baseline and native.compiled():
            base = _source_speed(name)
            python = f"{base:>10,.0f}{best / base:>10.2f}"
        if args.baseline:  # same outcome, one event per forward pass
            base, stepped = _replay_speed(requests, name, fleet, per_step=True)
            assert _outcome(stepped) == _outcome(result)
            per_step = f"{base:>10,.0f}{best / base:>12.2f}"
        print(
            f"{name:16s}{best:>10,.0f}{best / TARGET:>10.2f}{python}{per_step}"
            f"{result.engine_steps / n:>11.2f}{result.events_applied / n:>12.2f}"
        )
        if args.breakdown:
            breakdown(requests, name, fleet)
    if args.profile:
        profile(requests, args.profile, fleet)


def _outcome(r: RunResult) -> tuple:
    """What a replay decided and measured, NaN (never answered) made comparable."""
    times = [None if math.isnan(t) else t for t in r.ttft_s + r.latency_s]
    return r.worker, r.cached_tokens, times


def _source_speed(policy: str) -> float:
    """This run's measurement of `policy` from the Python source, in a child process."""
    argv = [sys.executable, __file__, *sys.argv[1:], "--policies", policy, "--rate-only"]
    out = subprocess.run(argv, env=SOURCE_ENV, capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def _replay(requests: list, name: str, fleet: FleetConfig, per_step: bool = False) -> Replay:
    """A replay of `requests` under policy `name` with its default parameters."""
    policy = make_policy(name, build_params(name, {}, fleet, 0))
    return Replay(requests, policy, fleet, per_step=per_step)


def _replay_speed(
    requests: list, name: str, fleet: FleetConfig, per_step: bool = False
) -> tuple[float, RunResult]:
    """Simulated requests per CPU second of one replay (robust to a shared machine), its result."""
    replay = _replay(requests, name, fleet, per_step)
    t = time.process_time()
    result = replay.run()
    return len(requests) / (time.process_time() - t), result


def breakdown(requests: list, name: str, fleet: FleetConfig) -> None:
    totals: dict[str, float] = {}
    replay = _replay(requests, name, fleet)
    for attr in ("insert", "remove", "match"):
        _timed(replay.index, attr, totals, f"index.{attr}")
    _timed(replay.policy, "choose", totals, "policy.choose")
    for w in replay.workers:
        _timed(w.engine, "step", totals, "engine.step")
        _timed(w.engine, "submit", totals, "engine.submit")
    t0 = time.perf_counter()
    replay.run()
    total = time.perf_counter() - t0
    totals["loop, client, load accounting"] = total - sum(totals.values())
    n = len(requests)
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"    {label:32s}{seconds / n * 1e6:8.1f} us/request  {seconds / total:6.1%}")


def profile(requests: list, name: str, fleet: FleetConfig) -> None:
    from pyinstrument import Profiler

    replay = _replay(requests, name, fleet)
    profiler = Profiler(interval=0.0005)
    profiler.start()
    replay.run()
    profiler.stop()
    print(profiler.output_text(unicode=False, color=False))


def fidelity(args: argparse.Namespace) -> None:
    from simulation.fidelity import CASES, FidelityCase, run_case

    items = args.fidelity_param
    if not items and args.fidelity_workload == "system-prompts":
        items = FIDELITY_PARAMS
    cases = [
        FidelityCase(
            policy=policy,
            workload=args.fidelity_workload,
            params=dict(item.split("=", 1) for item in items),
            **{name: getattr(args, f"fidelity_{name}") for name in FIDELITY},
        )
        for policy in policy_names(args.fidelity_policy)
    ]
    for case in CASES.values() if args.fidelity_cases else cases:
        outcome = run_case(case)
        print(outcome.describe())
        hit_ok = abs(outcome.hit_rate_diff) <= 0.02
        ttft_ok = abs(outcome.ttft_p50_ratio - 1) <= 0.15
        print(
            f"targets: hit rate within 2 points {'yes' if hit_ok else 'NO'}, "
            f"TTFT p50 within 15 % {'yes' if ttft_ok else 'NO'}\n"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--trace", default=str(SHARED_TRACE))
    add("--requests", type=int, default=None)
    add("--workers", type=int, default=8)
    add("--capacity-tokens", type=int, default=400_000)
    add("--policies", default="all")
    add("--repeat", type=int, default=3)
    baseline = "also time the replay from source and per step (the in-run baselines)"
    add("--baseline", action=argparse.BooleanOptionalAction, default=True, help=baseline)
    add("--rate-only", action="store_true", help=argparse.SUPPRESS)
    add("--breakdown", action="store_true")
    add("--profile", metavar="POLICY")
    add("--fidelity", action="store_true", help="live vs offline instead")
    cases = "live vs offline on the cases of tests/simulation/test_simulation_fidelity.py"
    add("--fidelity-cases", action="store_true", help=cases)
    add("--fidelity-policy", default="cache_aware,sglang,round_robin")
    add("--fidelity-workload", default="system-prompts")
    add("--fidelity-param", action="append", default=[], metavar="KEY=VALUE")
    for name, default in FIDELITY.items():
        add(f"--fidelity-{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    if (args.breakdown or args.profile) and native.compiled():  # wrappers need the source
        print("--breakdown/--profile: running the Python source (URC_PURE_PYTHON=1)", flush=True)
        os.execve(sys.executable, [sys.executable, *sys.argv], SOURCE_ENV)
    if args.fidelity or args.fidelity_cases:
        fidelity(args)
    else:
        speed(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
