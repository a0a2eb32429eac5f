"""Several policies over the same requests, each on a fresh fleet, index, client and policy
(built as the gateway builds it). Each run's wall-clock speed stays out of the report's JSON."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.policies import POLICY_NAMES, Policy, make_policy, policy_params, told_params
from simulation.flow import FlowConfig
from simulation.replay import FleetConfig, Replay, RunResult
from simulation.requests import SimRequest
from simulation.summary import series, summarize

if TYPE_CHECKING:
    from simulation.rollout import ReplayRollout


@dataclass(slots=True)
class Run:
    """One policy's replay: its result, summary (the report's) and series (the plots')."""

    result: RunResult
    summary: dict[str, Any]
    series: dict[str, Any]
    speed: float  # simulated requests per second of wall time (not in the report)


@dataclass(slots=True)
class Comparison:
    runs: dict[str, Run]
    bound: float | None
    params: dict[str, dict[str, Any]]  # the parameters each policy was built with


def run_policy(
    name: str,
    requests: Sequence[SimRequest],
    policy: Policy,
    fleet: FleetConfig,
    progress: Callable[[str, int], None] | None = None,
    flow: FlowConfig | None = None,
    rollout: ReplayRollout | None = None,
) -> Run:
    """Replay `requests` under `policy` on a fresh `fleet` (and flow control's own state;
    `rollout`: a rollout's plan beside it), timed; `progress(name, sent)`."""
    replay = Replay(requests, policy, fleet, flow=flow, rollout=rollout)
    report = None if progress is None else (lambda sent: progress(name, sent))
    if report is not None:
        report(0)
    t0 = time.perf_counter()
    result = replay.run(report)
    speed = len(requests) / max(time.perf_counter() - t0, 1e-9)
    if report is not None:
        report(len(requests))
    return Run(result, summarize(result, requests), series(result, requests), speed)


def infinite_cache_hit_rate(requests: Iterable[SimRequest]) -> float | None:
    """Cached / prompt tokens on one worker that never evicts (each request reuses the longest
    prefix seen before): the ceiling of every policy."""
    seen: set[int] = set()
    prompt = cached = 0
    for req in requests:
        keys = req.keys
        n = len(req.prompt)
        bs = req.route.block_size
        cap = min(len(keys), (n - 1) // bs)
        hit = 0
        while hit < cap and keys[hit] in seen:  # chained: a held key holds its whole prefix
            hit += 1
        prompt += n
        cached += hit * bs
        seen.update(keys)
        seen.update(req.tail_keys)
    return cached / prompt if prompt else None


def policy_names(spec: str) -> list[str]:
    """`all`, one name, or a comma-separated list; ValueError on unknown names."""
    names = list(POLICY_NAMES) if spec.strip() == "all" else [s.strip() for s in spec.split(",")]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise ValueError(
            f"unknown policy {', '.join(unknown)!r} (known: {', '.join(POLICY_NAMES)})"
        )
    return list(dict.fromkeys(names))


def split_params(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, str]]:
    """`KEY=VALUE` (every listed policy that has KEY) or `POLICY:KEY=VALUE` -> per policy."""
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for item in items:
        target, colon, rest = item.partition(":")
        if not colon or "=" in target:
            target, rest = "", item
        key, eq, value = rest.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--policy-param wants [POLICY:]KEY=VALUE, got {item!r}")
        targets = [target] if target else [n for n in names if key in policy_params(n)]
        if not targets or (target and target not in out):
            raise ValueError(f"--policy-param {item!r} applies to none of {', '.join(names)}")
        for name in targets:
            if key not in policy_params(name):
                raise ValueError(f"policy {name!r} has no parameter {key!r}")
            out[name][key] = value
    return out


def build_params(
    name: str, given: Mapping[str, Any], fleet: FleetConfig, seed: int
) -> dict[str, Any]:
    """The policy's parameters: the given ones, the fleet's prefill rate, chunk size and host
    copy rate (an operator configures the gateway for its hardware) and the seed, where it
    takes them."""
    told = {
        "prefill_tokens_per_s": fleet.engine.prefill_tokens_per_s,
        "chunk_tokens": fleet.engine.chunk_tokens,
        "host_copy_tokens_per_s": fleet.engine.host_copy_tokens_per_s,
        "seed": seed,
    }
    return {**told_params(name, told), **given}


def compare(
    requests: Sequence[SimRequest],
    names: Sequence[str],
    fleet: FleetConfig,
    *,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int = 0,
    progress: Callable[[str, int], None] | None = None,
    flow: FlowConfig | None = None,
) -> Comparison:
    """Replay `requests` under each policy in `names` on `fleet` (with `flow`: flow control)."""
    runs: dict[str, Run] = {}
    used: dict[str, dict[str, Any]] = {}
    for name in names:
        given = (params or {}).get(name, {})
        used[name] = build_params(name, given, fleet, seed)
        policy = make_policy(name, used[name], **given)
        runs[name] = run_policy(name, requests, policy, fleet, progress, flow)
    limit = fleet.context_len()
    bound = infinite_cache_hit_rate(r for r in requests if len(r.prompt) + r.max_tokens <= limit)
    return Comparison(runs, bound, used)
