"""bench/shared_pool_memory.py on a tiny Mooncake-format trace written here: it runs, its
caches pass their integrity checks, and what it reports holds together (docs/benchmarks.md)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 512  # tokens per hash id, as in Mooncake's traces


def tiny_trace(path: Path, requests: int = 240, seed: int = 0) -> None:
    """Shared documents (skewed), sessions that extend their last prompt, unique suffixes."""
    rng = random.Random(seed)
    fresh = iter(range(10**6))
    docs = [[next(fresh) for _ in range(rng.randint(2, 6))] for _ in range(16)]
    sessions: list[list[int]] = []
    lines = []
    for i in range(requests):
        if sessions and rng.random() < 0.4:
            ids = rng.choice(sessions)
        else:
            ids = list(rng.choices(docs, [1 / (k + 1) for k in range(len(docs))])[0])
            sessions.append(ids)
        ids.extend(next(fresh) for _ in range(rng.randint(1, 3)))
        record = {"timestamp": 100 * i, "input_length": len(ids) * BLOCK - rng.randrange(BLOCK)}
        lines.append(json.dumps(record | {"output_length": 8, "hash_ids": list(ids)}))
    path.write_text("\n".join(lines) + "\n")


def test_quick_run_reports_memory_ratios_that_hold_together(tmp_path: Path) -> None:
    trace, out = tmp_path / "trace.jsonl", tmp_path / "result.json"
    tiny_trace(trace)
    bench = [sys.executable, str(ROOT / "bench/shared_pool_memory.py"), "--quick"]
    args = ["--trace", str(trace), "--gpu-tokens", str(48 * BLOCK), "--json", str(out)]
    done = subprocess.run(bench + args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ratio" in done.stdout and "even" in done.stdout
    result = json.loads(out.read_text())
    assert result["requests"] == 240
    assert result["one_pool_hit_rate"] < result["one_pool_host_hit_rate"]
    assert result["one_pool_host_hit_rate"] < result["infinite_hit_rate"], "capacity bound"
    rows = result["rows"]
    assert {(r["models"], r["mix"]) for r in rows} == {
        (n, mix) for n in (2, 4) for mix in ("even", "zipf", "shifting")
    }
    for r in rows:
        assert 0 < r["split_hit"] <= r["split_hit_host"] < result["infinite_hit_rate"]
        assert 0 < r["ratio"] <= 2 and 0 < r["ratio_host"] <= 2
        if r["shared_hit"] >= r["split_hit"]:  # the shared pool reaches it at C or below
            assert r["ratio"] <= 1
        if r["shared_hit_host"] >= r["split_hit_host"]:
            assert r["ratio_host"] <= 1
    zipf = [r["top_share"] for r in rows if r["mix"] == "zipf" and r["models"] == 4]
    even = [r["top_share"] for r in rows if r["mix"] == "even" and r["models"] == 4]
    assert zipf[0] > even[0], "the skewed mix is skewed"
