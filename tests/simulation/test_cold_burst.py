"""bench/cold_burst.py: its search over the splits of make run's first burst holds each policy's
own split, reproduced by the engine as the replay ran it (docs/benchmarks.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = re.compile(r"^(\w+): p99 ([\d.]+)  max ([\d.]+)", re.M)
BOUND = re.compile(
    r"lowest p99 of a split of the burst with max <= ([\d.]+): ([\d.]+) \(max ([\d.]+)"
)
KIND = re.compile(r"^burst kind \d+: (\d+) x", re.M)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_split_is_missed_and_none_beats_the_bound(seed: int) -> None:
    bench = [sys.executable, str(ROOT / "bench/cold_burst.py"), "--seed", str(seed)]
    done = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sum(int(n) for n in KIND.findall(done.stdout)) == 16, "the burst: 16 in flight"
    policies = POLICY.findall(done.stdout)
    bounds = BOUND.findall(done.stdout)
    assert [name for name, _, _ in policies] == ["cache_aware", "round_robin"]
    assert len(bounds) == 2, done.stdout
    for (_, p99, top), (cap, low, worst) in zip(policies, bounds, strict=True):
        assert cap == top
        # the policy's own split is one of those tried: the best is at most as slow as it
        assert float(low) <= float(p99) + 0.05
        assert float(worst) <= float(top) + 0.05
