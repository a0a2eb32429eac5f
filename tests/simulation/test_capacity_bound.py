"""A fleet whose caches are bound by KV capacity: one shared system prompt must not draw every
session to its first holder (docs/policies.md, cache_aware: queueing imposed on others)."""

from __future__ import annotations

from collections import Counter

from backends.emulated.config import EngineConfig
from simulation.compare import compare
from simulation.replay import FleetConfig
from simulation.workloads import workload_requests


def test_a_shared_system_prompt_does_not_herd_sessions_onto_one_worker() -> None:
    # 48 sessions of ~1.4k tokens each share a 1000-token system prompt; 16k tokens of KV per
    # worker hold ~10 of them: the working set fits only when spread over the four workers
    params = {"sessions": 48, "turns": 6, "system_tokens": 1000}
    reqs = workload_requests("multi-turn", 1200, seed=7, rate=40.0, params=params)
    fleet = FleetConfig(workers=4, engine=EngineConfig(block_size=16, capacity_tokens=16_000))
    runs = compare(reqs, ["cache_aware", "round_robin"], fleet).runs
    busiest = max(Counter(runs["cache_aware"].result.worker).values())
    assert busiest < 0.4 * len(reqs)  # herded, one worker took them all
    hit = {name: run.summary["hit_rate"] for name, run in runs.items()}
    assert hit["cache_aware"] > hit["round_robin"] - 0.01  # herded: 0.75 against 0.93
