"""A rollout's plan in the replay (docs/rollouts.md, "Offline first"): virtual time, so the
decisions and their times are exact. On a shared-prefix multi-turn workload a worse candidate
(round robin against cache_aware) rolls back at its first step and an equal one advances through
every step; the shared trace's decision for round robin; `urc replay --rollout-policy`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.emulated.config import EngineConfig
from router.rollout import CANDIDATE, Rollout
from router.rollout_plan import RolloutPlan
from simulation.cli import main
from simulation.replay import FleetConfig
from simulation.requests import SimRequest
from simulation.rollout import replay_key, replay_rollout
from simulation.traces import read_trace, trace_requests
from simulation.workloads import workload_requests

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "mooncake_synthetic_trace.jsonl"
# the live test (tests/router/gateway/test_rollout_live.py) runs the same plans
PLAN = {"steps": "10,25,50,100", "dwell_s": 10.0, "min_requests": 150}
EQUAL_MARGINS = {"ttft_p50_margin": 0.5, "ttft_p99_margin": 1.0}
TRACE_PLAN = {"steps": "10,50,100", "dwell_s": 120.0, "min_requests": 100}
TRACE_MARGINS = {"hit_rate_margin": 0.15, "ttft_p50_margin": 2.0, "ttft_p99_margin": 2.0}


@pytest.fixture(scope="module")
def conversations() -> list[SimRequest]:
    """384 conversations of 6 turns behind one 1,024-token system prompt, 16 at a time."""
    params = {"sessions": 64, "turns": 6, "system_tokens": 1024}
    return workload_requests("multi-turn", 6000, params=params)


def run(requests: list[SimRequest], candidate: str, **settings: object) -> dict:
    plan = RolloutPlan(policy=candidate, **{**PLAN, **settings})  # type: ignore[arg-type]
    fleet = FleetConfig(workers=4, concurrency=16)
    _, report = replay_rollout(requests, "cache_aware", plan, fleet, {})
    return report


def kinds(report: dict) -> list[str]:
    return [e["kind"] for e in report["events"]]


def test_a_worse_candidate_rolls_back_at_its_first_step(conversations):
    report = run(conversations, "round_robin")
    assert kinds(report) == ["started", "rolled_back"]
    rollback = report["events"][-1]
    assert rollback["step"] == 0 and rollback["share"] == 0
    assert rollback["reason"].startswith("hit_rate worse")
    assert report["state"] == "rolled_back" and report["share_percent"] == 0
    assert run(conversations, "round_robin") == report  # virtual time: the same, every time


def test_an_equal_candidate_advances_through_every_step(conversations):
    report = run(conversations, "cache_aware", **EQUAL_MARGINS)
    assert kinds(report) == ["started", "advanced", "advanced", "complete"]
    assert [e["share"] for e in report["events"]] == [10, 25, 50, 100]
    times = [e["at"] for e in report["events"]]
    assert all(b - a >= PLAN["dwell_s"] for a, b in zip(times, times[1:], strict=False))


def test_every_turn_of_a_conversation_is_on_one_arm(conversations):
    plan = RolloutPlan(policy="round_robin", steps="10,100", dwell_s=1e9)
    rollout = Rollout(plan, 0.0)
    arms: dict[int, set[int]] = {}
    for req in conversations:
        arms.setdefault(req.session, set()).add(rollout.place(replay_key(req)).arm)
    assert all(len(a) == 1 for a in arms.values())
    share = sum(CANDIDATE in a for a in arms.values()) / len(arms)
    assert 0.05 < share < 0.15, share


def test_the_shared_trace_rolls_round_robin_back_at_its_first_step():
    trace = read_trace(TRACE)
    requests = trace_requests(trace)
    fleet = FleetConfig(workers=8, engine=EngineConfig(block_size=trace.block_size))
    settings = {**TRACE_PLAN, **TRACE_MARGINS}
    plan = RolloutPlan(policy="round_robin", **settings)  # type: ignore[arg-type]
    _, report = replay_rollout(requests, "cache_aware", plan, fleet, {})
    assert kinds(report) == ["started", "rolled_back"] and report["events"][-1]["step"] == 0
    assert "worse" in report["events"][-1]["reason"]


def test_the_cli_prints_the_timeline_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    argv = ["--workload", "multi-turn", "-p", "sessions=64", "-p", "turns=6"]
    argv += ["-p", "system_tokens=1024", "--requests", "6000", "--workers", "4"]
    argv += ["--concurrency", "16", "--policy", "cache_aware", "--rollout-policy", "round_robin"]
    argv += ["--rollout-steps", "10,25,50,100", "--rollout-dwell", "10"]
    argv += ["--rollout-min-requests", "150", "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "rolled_back" in printed and "final: rolled_back at 0 %" in printed
    report = json.loads(out.read_text())
    assert report["rollout"]["state"] == "rolled_back" and report["run"]["requests"] == 6000


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--policy", "cache_aware", "--rollout-policy", "x"], "unknown policy"),
        (["--policy", "cache_aware,round_robin", "--rollout-policy", "round_robin"], "one"),
        (["--rollout-model", "m", "--rollout-alias", "a"], "policy rollouts"),
        (["--rollout-policy", "round_robin", "--rollout-steps", "50,10"], "rise"),
    ],
)
def test_the_cli_refuses_what_it_cannot_replay(argv, error, capsys):
    assert main(["--workload", "multi-turn", "--requests", "10", *argv]) == 2
    assert error in capsys.readouterr().err
