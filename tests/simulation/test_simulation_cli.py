"""`urc replay` from the command line: the table, the JSON schema, byte-identical reruns, the
--out directory with and without matplotlib, workloads, and arguments it refuses."""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from simulation import cli

REQUIRED = {
    "hit_rate",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "throughput_tok_s",
    "load_imbalance",
}


def synthetic_trace(path: Path, n: int = 400, seed: int = 1) -> Path:
    """Mooncake-shaped: 30 shared prefixes of 2-12 blocks, unique suffixes, ~8 req/s."""
    rng = random.Random(seed)
    prefixes = [list(range(1000 * g, 1000 * g + rng.randrange(2, 12))) for g in range(30)]
    lines, t, fresh = [], 0.0, 10**6
    for _ in range(n):
        t += rng.expovariate(8.0) * 1000
        ids = list(prefixes[rng.randrange(30)])
        extra = rng.randrange(1, 6)
        ids += range(fresh, fresh + extra)
        fresh += extra
        length = (len(ids) - 1) * 512 + rng.randrange(1, 512)
        row = {
            "timestamp": int(t),
            "input_length": length,
            "output_length": rng.randrange(1, 200),
            "hash_ids": ids,
        }
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return synthetic_trace(tmp_path / "trace.jsonl")


def run(*argv: str) -> int:
    return cli.main([*argv, "--no-progress"])


def test_a_trace_replay_prints_a_table_and_writes_the_report(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert (
        run(
            str(trace),
            "--policy",
            "cache_aware,sglang,round_robin",
            "--workers",
            "4",
            "--capacity-tokens",
            "40000",
            "--out",
            str(out),
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "cache_aware" in table and "bound: 1 infinite cache" in table
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "urc.replay/1"
    assert set(report["policies"]) == {"cache_aware", "sglang", "round_robin"}
    for summary in report["policies"].values():
        assert set(summary) >= REQUIRED and summary["completed"] == 400
        assert 0 <= summary["hit_rate"] <= report["bound"]["hit_rate"]
    assert report["config"]["trace"] == "trace.jsonl"
    assert report["config"]["fleet"]["block_size"] == 512
    page = (out / "report.md").read_text()
    assert "| cache_aware |" in page
    series = json.loads((out / "series.json").read_text())
    assert set(series) == set(report["policies"])
    if importlib.util.find_spec("matplotlib"):
        for name in ("ttft_cdf.png", "hit_rate.png", "worker_load.png"):
            assert (out / name).stat().st_size > 1000 and f"({name})" in page


def test_the_same_trace_seed_and_flags_give_byte_identical_json(
    trace: Path, tmp_path: Path
) -> None:
    outputs = []
    for n in range(2):
        path = tmp_path / f"run{n}.json"
        assert (
            run(str(trace), "--policy", "all", "--workers", "3", "--seed", "7", "--json", str(path))
            == 0
        )
        outputs.append(path.read_bytes())
    assert outputs[0] == outputs[1]
    assert b"NaN" not in outputs[0]


def test_without_matplotlib_the_report_says_so(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    out = tmp_path / "out"
    assert run(str(trace), "--policy", "round_robin", "--requests", "50", "--out", str(out)) == 0
    assert not list(out.glob("*.png"))
    assert "matplotlib is not installed" in (out / "report.md").read_text()


def test_a_workload_replays_closed_loop(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    assert (
        run(
            "--workload",
            "multi-turn",
            "--requests",
            "80",
            "--workers",
            "2",
            "--policy",
            "cache_aware,least_load",
            "--json",
            str(path),
            "-p",
            "sessions=4",
        )
        == 0
    )
    report = json.loads(path.read_text())
    assert report["config"]["workload"] == "multi-turn"
    assert report["config"]["fleet"]["concurrency"] == 8
    assert report["policies"]["cache_aware"]["completed"] == 80


def test_policy_params_reach_the_policies_they_name(trace: Path, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    assert (
        run(
            str(trace),
            "--policy",
            "cache_aware,sglang",
            "--requests",
            "40",
            "--policy-param",
            "sglang:cache_threshold=0.5",
            "--policy-param",
            "externality=0",
            "--json",
            str(path),
        )
        == 0
    )
    params = json.loads(path.read_text())["config"]["policy_params"]
    assert params["sglang"]["cache_threshold"] == "0.5"
    assert params["cache_aware"]["externality"] == "0"
    assert params["cache_aware"]["prefill_tokens_per_s"] == 15000.0  # told the fleet's rate


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--policy", "nope", "TRACE"],
        ["--policy-param", "nope=1", "TRACE"],
        ["TRACE", "--workload", "mixed"],
        ["TRACE", "--rate", "3"],
        ["MISSING"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], trace: Path, tmp_path: Path) -> None:
    argv = [
        str(trace) if a == "TRACE" else str(tmp_path / "no.jsonl") if a == "MISSING" else a
        for a in argv
    ]
    assert run(*argv) == 2


def test_the_options_mount_on_a_subcommand(trace: Path) -> None:
    top = argparse.ArgumentParser(prog="urc")
    sub = top.add_subparsers(dest="command")
    cli.add_arguments(sub.add_parser("replay"))
    args = top.parse_args(
        ["replay", str(trace), "--policy", "round_robin", "--requests", "20", "--no-progress"]
    )
    assert cli.run(args) == 0


def test_a_gateway_recording_replays_to_what_was_recorded(tmp_path: Path) -> None:
    """Record a run in the gateway's --record format, replay the recording: same hit rate."""
    from backends.emulated.config import EngineConfig
    from simulation.compare import compare
    from simulation.replay import FleetConfig
    from simulation.workloads import workload_requests

    reqs = workload_requests("system-prompts", 200, rate=30.0, params={"groups": 10})
    fleet = FleetConfig(workers=3, engine=EngineConfig(capacity_tokens=15_000), concurrency=None)
    live = compare(reqs, ["cache_aware"], fleet).runs["cache_aware"].result
    lines = [json.dumps({"urc_record": 1, "block_size": 16})]
    for r in reqs:
        row = {
            "timestamp": round(r.arrival_s * 1000, 3),
            "input_length": len(r.prompt),
            "output_length": r.max_tokens,
            "hash_ids": r.keys,
            "model": "emulated",
            "tenant": None,
            "worker": live.workers[live.worker[r.index]],
            "cached_tokens": live.cached_tokens[r.index],
            "predicted_tokens": live.predicted_tokens[r.index],
            "policy": "cache_aware",
        }
        lines.append(json.dumps(row))
    recording = tmp_path / "recording.jsonl"
    recording.write_text("\n".join(lines) + "\n")
    path = tmp_path / "replayed.json"
    assert (
        run(
            str(recording),
            "--policy",
            "cache_aware",
            "--workers",
            "3",
            "--capacity-tokens",
            "15000",
            "--trace-kind",
            "chat",
            "--json",
            str(path),
        )
        == 0
    )
    report = json.loads(path.read_text())
    assert report["config"]["fleet"]["block_size"] == 16 and report["config"]["recorded"]
    recorded = report["recorded"]
    assert recorded["policy"] == "cache_aware" and recorded["requests"] == 200
    replayed = report["policies"]["cache_aware"]["hit_rate"]
    assert replayed == pytest.approx(recorded["hit_rate"], abs=0.01)


def test_a_host_tier_replays_identically_and_shows_hits_per_tier(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = ["--capacity-tokens", "20000", "--host-capacity-tokens", "80000"]
    tier += ["--host-copy-tokens-per-s", "200000"]
    outputs = []
    for n in range(2):
        path = tmp_path / f"tier{n}.json"
        argv = [str(trace), "--policy", "cache_aware", "--workers", "3", "--json", str(path)]
        assert run(*argv, *tier) == 0
        outputs.append(path.read_bytes())
    assert outputs[0] == outputs[1]
    report = json.loads(outputs[0])
    fleet = report["config"]["fleet"]
    assert fleet["host_capacity_tokens"] == 80_000 and fleet["host_copy_tokens_per_s"] == 200_000
    summary = report["policies"]["cache_aware"]
    assert summary["host_hit_rate"] > 0 and summary["gpu_hit_rate"] > 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "GPU hits" in header and "host hits" in header
