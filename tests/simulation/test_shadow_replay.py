"""Shadow policies live and offline: `urc replay REC --shadow NAME` follows a recording's live
decisions and asks each candidate policy what the gateway's `--shadow-policy` asks.

- a small synthetic recording whose shadow numbers can be worked out by hand;
- the acceptance test on real processes: a gateway routing by round robin with shadow policies
  and `--record`, then `urc replay` on the recording; the shadow hit rates must agree within
  2 points of what the gateway exported."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.blocks import block_keys
from simulation import cli
from tests.gateway import ADMIN, admin_workers, all_exact
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker

SHADOWS = ("cache_aware", "consistent_hash", "sglang")


def write_recording(path: Path, n: int) -> Path:
    """Round robin over workers a, b, one request a second: 4 shared blocks, 1 unique block
    and 5 more tokens each. Request 0 finds nothing; request 1 goes to b while a holds the
    prefix; every later one finds the 64 prefix tokens on both."""
    lines = [json.dumps({"urc_record": 1, "block_size": 16})]
    for i in range(n):
        tokens = list(range(64)) + [1000 + i] * 16 + [7] * 5
        cached = 0 if i < 2 else 64
        row = {
            "timestamp": i * 1000.0,
            "input_length": len(tokens),
            "output_length": 2,
            "hash_ids": block_keys(tokens, 16),
            "model": "m",
            "tenant": "default",
            "worker": "ab"[i % 2],
            "policy": "round_robin",
            "predicted_tokens": cached,
            "cached_tokens": cached,
        }
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_shadow_replay_follows_the_recording_and_counts_what_each_policy_predicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 10
    rec = write_recording(tmp_path / "rec.jsonl", n)
    out = tmp_path / "report.json"
    argv = [str(rec), "--shadow", "cache_aware", "--json", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "live round_robin, recorded" in printed and "cache_aware" in printed
    assert report["config"]["shadow"] == ["cache_aware"]
    assert list(report["policies"]) == ["recorded"]  # no --policy: only the followed decisions
    recorded = report["policies"]["recorded"]
    assert recorded["workers"]["a"]["requests"] == recorded["workers"]["b"]["requests"] == n / 2
    prompt = n * 85
    live = report["shadow"]["live"]
    assert live["recorded_hit_rate"] == pytest.approx(64 * (n - 2) / prompt, abs=1e-6)
    assert live["hit_rate"] == pytest.approx(live["recorded_hit_rate"], abs=1e-6)
    assert live["predicted_hit_rate"] == pytest.approx(64 * (n - 2) / prompt, abs=1e-6)
    shadow = report["shadow"]["policies"]["cache_aware"]
    # from request 1 on, cache_aware goes where the prefix is: 64 tokens each
    assert shadow["requests"] == n and shadow["prompt_tokens"] == prompt
    assert shadow["predicted_hit_tokens"] == 64 * (n - 1)
    assert 1 / n <= shadow["disagreement_rate"] <= 1  # request 1 at least: a, not b
    assert shadow["predicted_ttft_mean_s"] > 0


def test_a_shadow_replay_refuses_what_it_cannot_follow(tmp_path: Path) -> None:
    rec = write_recording(tmp_path / "rec.jsonl", 4)
    assert cli.main([str(rec), "--shadow", "round_robin", "--worker-names", "a,c"]) == 2
    assert cli.main(["--workload", "mixed", "--shadow", "round_robin"]) == 2


# -- the acceptance test: live gateway against the replay ------------------------------------


def workload(n: int, seed: int = 3) -> list[str]:
    """Prompts of 12 shared prefixes (20-40 blocks of bytes), each with its own tail."""
    rng = random.Random(seed)
    prefixes = [f"<system {g}> " + "x" * rng.randrange(300, 620) for g in range(12)]
    return [
        rng.choice(prefixes) + f" question {i}: " + "y" * rng.randrange(8, 60) for i in range(n)
    ]


def shadow_counters(url: str) -> dict[str, dict[str, float]]:
    """From /metrics: per shadow policy, the prompt and predicted hit tokens it counted."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("urc_shadow_prompt_tokens", "urc_shadow_predicted_hit_tokens"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out.setdefault(sample.labels["policy"], {})[family.name] = sample.value
    return out


def test_gateway_shadow_predictions_match_the_replay_of_its_recording(tmp_path: Path) -> None:
    rec = tmp_path / "rec.jsonl"
    workers = [start_worker() for _ in range(3)]
    shadow_flags = [arg for name in SHADOWS for arg in ("--shadow-policy", name)]
    gateway = start_gateway(
        [w.url for w in workers],
        "--admin-key",
        "admin-secret",
        "--policy",
        "round_robin",
        "--record",
        str(rec),
        *shadow_flags,
    )
    prompts = workload(240)
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 3), 20)
        names = [w["name"] for w in admin_workers(url)]  # the candidate order
        with httpx.Client(timeout=30) as client:

            def send(prompt: str) -> int:
                body = {"model": "emulated", "prompt": prompt, "max_tokens": 4}
                return client.post(f"{url}/v1/completions", json=body).status_code

            with cf.ThreadPoolExecutor(4) as pool:
                assert all(code == 200 for code in pool.map(send, prompts))
        live = shadow_counters(url)
        mode = httpx.get(f"{url}/admin/mode", headers=ADMIN, timeout=5).json()["shadows"]
    finally:
        gateway.stop()  # closes (flushes) the recording
        for w in workers:
            w.stop()

    out = tmp_path / "replay.json"
    cmd = [sys.executable, "-m", "urc.cli", "replay", str(rec), "--no-progress"]
    cmd += [arg for name in SHADOWS for arg in ("--shadow", name)]
    cmd += ["--worker-names", ",".join(names), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=120)
    offline = json.loads(out.read_text())["shadow"]
    assert offline["live"]["requests"] == len(prompts)
    for name in SHADOWS:
        counted = live[name]
        live_rate = counted["urc_shadow_predicted_hit_tokens"] / counted["urc_shadow_prompt_tokens"]
        assert mode[name]["requests"] == len(prompts)
        assert live_rate == pytest.approx(mode[name]["predicted_hit_rate"])
        replayed = offline["policies"][name]
        assert replayed["prompt_tokens"] == counted["urc_shadow_prompt_tokens"]
        print(f"{name}: gateway {live_rate:.4f} replay {replayed['predicted_hit_rate']:.4f}")
        assert abs(replayed["predicted_hit_rate"] - live_rate) <= 0.02
