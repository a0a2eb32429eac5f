"""Offline agrees with live: the same seeded workload through `urc cluster` of emulated workers
(real processes on 127.0.0.1, `urc bench` against it) and through the replay with the same
worker parameters gives hit rates within 2 points and TTFT p50 within 15 %, with a host tier
too.

Prompts carry a few hundred uncached tokens at 5,000 prefill tokens/s, so modelled time (~0.1 s)
dominates what only the live run has: HTTP hops and event-loop wake-ups (a few ms)."""

from __future__ import annotations

import pytest

from simulation.fidelity import FidelityCase, FidelityOutcome, run_case

CASES = {
    "shared system prompts": FidelityCase(
        workload="system-prompts",
        params={"groups": "16", "question_tokens": "400"},
        requests=160,
        capacity_tokens=40_000,
    ),
    # 16 sessions on 4 workers: with 12, where three or four sessions happen to start (worker
    # names are ports, hashed by the rendezvous) moved TTFT p50 by 70 % in 1 naming in 10,
    # offline alone: a test of luck, not of fidelity. 16 sessions over 200 requests keep p50
    # within 99-103 ms over 60 namings.
    "multi-turn sessions": FidelityCase(
        workload="multi-turn",
        params={"sessions": "16", "turns": "5", "user_tokens": "400"},
        requests=200,
        capacity_tokens=30_000,
    ),
    "shared system prompts, pending prefixes": FidelityCase(
        workload="system-prompts",
        params={"groups": "16", "question_tokens": "400"},
        requests=160,
        capacity_tokens=40_000,
        pending_ttl_s=10.0,
    ),
    # a GPU tier that holds about one session per worker, a host tier that holds them all:
    # most hits are promotions. consistent_hash keeps each session on its worker whatever the
    # timing, so the two sides differ only in the tier's model (docs/benchmarks.md)
    "multi-turn sessions, host tier": FidelityCase(
        policy="consistent_hash",
        workload="multi-turn",
        params={"sessions": "24", "turns": "5", "user_tokens": "400"},
        requests=120,
        capacity_tokens=5_000,
        host_capacity_tokens=80_000,
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_live_and_offline_agree(case: FidelityCase) -> None:
    outcome = run_case(case)
    if not _agrees(outcome):
        # the live side runs in real time on a shared machine: a stall of the machine for a
        # few seconds (seen once in a full suite) moves its p50; a real disagreement repeats
        outcome = run_case(case)
    report = outcome.describe()
    assert abs(outcome.hit_rate_diff) <= 0.02, report
    assert abs(outcome.ttft_p50_ratio - 1) <= 0.15, report
    assert outcome.live["hit_rate"] > 0.5, report  # the caches matter in both
    if case.host_capacity_tokens:
        assert outcome.offline["host_hit_rate"] > 0.3, report  # promotions, not just GPU hits


def _agrees(outcome: FidelityOutcome) -> bool:
    return abs(outcome.hit_rate_diff) <= 0.02 and abs(outcome.ttft_p50_ratio - 1) <= 0.15
