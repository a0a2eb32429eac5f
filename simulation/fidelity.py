"""Live against offline: one seeded workload through `urc cluster` and through the replay with
the same worker parameters, names and candidate order, so the two differ only in what real time
adds (HTTP hops, event-loop wake-ups, KV events in flight). No API keys: one namespace."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.emulated.config import EngineConfig
from core.hardware import DEFAULT_HOST_COPY_TOKENS_PER_S
from router.policies import policy_params
from simulation.compare import compare
from simulation.replay import FleetConfig
from simulation.workloads import workload_requests

ADMIN_KEY = "urc-fidelity"
MODEL = "emulated"


@dataclass(slots=True)
class FidelityCase:
    policy: str = "cache_aware"
    workload: str = "mixed"
    params: dict[str, str] = field(default_factory=dict)
    requests: int = 300
    workers: int = 4
    capacity_tokens: int = 40_000
    prefill_tokens_per_s: float = 5_000.0
    concurrency: int = 8
    seed: int = 0
    pending_ttl_s: float = 0.0  # the gateway's --pending-ttl, and the replay's
    host_capacity_tokens: int = 0  # each worker's host tier (docs/tiers.md; 0: none)
    host_copy_tokens_per_s: float = DEFAULT_HOST_COPY_TOKENS_PER_S
    ready_timeout_s: float = 90.0


# the cases tests/simulation/test_simulation_fidelity.py checks (hit rates) and
# `bench/replay_bench.py --fidelity-cases` measures (TTFT too)
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


@dataclass(slots=True)
class FidelityOutcome:
    case: FidelityCase
    live: dict[str, Any]  # the urc bench summary (loadgen.report)
    offline: dict[str, Any]  # the replay summary (simulation.summary)

    @property
    def hit_rate_diff(self) -> float:
        """Offline minus live, in rate units (0.01 = one point)."""
        return self.offline["hit_rate"] - self.live["hit_rate"]

    @property
    def ttft_p50_ratio(self) -> float:
        return self.offline["ttft_p50_s"] / self.live["ttft_s"]["p50"]

    def describe(self) -> str:
        c, live, off = self.case, self.live, self.offline
        a, b = live["hit_rate"], off["hit_rate"]
        lines = [
            f"{c.workload} x {c.requests} ({c.params or 'defaults'}), {c.policy}, {c.workers} "
            f"workers x {c.capacity_tokens:,} tokens, prefill {c.prefill_tokens_per_s:,.0f} tok/s, "
            f"concurrency {c.concurrency}"
            + (f", host tier {c.host_capacity_tokens:,} tokens" if c.host_capacity_tokens else ""),
            f"{'':14s}{'live':>12s}{'offline':>12s}{'diff':>12s}",
            f"{'hit rate':14s}{a:>12.2%}{b:>12.2%}{(b - a) * 100:>+10.2f}pt",
        ]
        for label, a, b, unit in (
            ("TTFT mean", live["ttft_s"]["mean"], off["ttft_mean_s"], "ms"),
            ("TTFT p50", live["ttft_s"]["p50"], off["ttft_p50_s"], "ms"),
            ("TTFT p99", live["ttft_s"]["p99"], off["ttft_p99_s"], "ms"),
            ("latency p50", live["latency_s"]["p50"], off["latency_p50_s"], "ms"),
            ("duration", live["duration_s"], off["duration_s"], "s"),
        ):
            scale = 1e3 if unit == "ms" else 1.0
            lines.append(
                f"{label:14s}{a * scale:>10.1f}{unit:2s}{b * scale:>10.1f}{unit:2s}"
                f"{(b / a - 1) * 100:>+11.1f}%"
            )
        return "\n".join(lines)


def _urc(*args: str) -> list[str]:
    return [sys.executable, "-m", "urc.cli", *args]


def _start_cluster(case: FidelityCase, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`urc cluster` for the case, its output in `log`; the process and the gateway's URL."""
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = _urc(
        "cluster",
        f"--workers={case.workers}",
        f"--port={port}",
        f"--policy={case.policy}",
        f"--admin-key={ADMIN_KEY}",
        f"--worker-arg=--capacity-tokens={case.capacity_tokens}",
        f"--worker-arg=--prefill-tokens-per-s={case.prefill_tokens_per_s}",
        f"--pending-ttl={case.pending_ttl_s}",
        f"--host-capacity-tokens={case.host_capacity_tokens}",
        f"--host-copy-tokens-per-s={case.host_copy_tokens_per_s}",
        f"--prefill-tokens-per-s={case.prefill_tokens_per_s}",  # the gateway knows its hardware
    )
    if "host_copy_tokens_per_s" in policy_params(case.policy):
        cmd.append(f"--policy-param=host_copy_tokens_per_s={case.host_copy_tokens_per_s}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + case.ready_timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("gateway: "):
                return proc, line.split(" ", 1)[1].strip()
        time.sleep(0.1)
    _stop(proc)
    seen = log.read_text().splitlines()[-20:]
    raise RuntimeError("the cluster did not start:\n" + "\n".join(seen))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _worker_names(url: str) -> list[str]:
    """The gateway's workers in its candidate order, all up."""
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    req = urllib.request.Request(url + "/admin/workers", headers=auth)
    with urllib.request.urlopen(req, timeout=10) as resp:
        workers = json.load(resp)["workers"]
    if not all(w["up"] for w in workers):
        raise RuntimeError(f"not every worker is up: {workers}")
    return [w["name"] for w in workers]


def run_live(case: FidelityCase) -> tuple[dict[str, Any], list[str]]:
    """The bench summary of the case against a fresh cluster, and the worker names."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_cluster(case, Path(tmp) / "cluster.log")
        try:
            names = _worker_names(url)
            out = Path(tmp) / "live.json"
            cmd = _urc(
                "bench",
                f"--target={url}",
                f"--workload={case.workload}",
                f"--requests={case.requests}",
                f"--concurrency={case.concurrency}",
                f"--seed={case.seed}",
                f"--model={MODEL}",
                f"--json={out}",
                "--no-progress",
                *(f"--param={key}={value}" for key, value in case.params.items()),
            )
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
            return json.loads(out.read_text()), names
        finally:
            _stop(proc)


def run_offline(case: FidelityCase, names: list[str]) -> dict[str, Any]:
    requests = workload_requests(
        case.workload,
        case.requests,
        seed=case.seed,
        models=[MODEL],
        params=dict(case.params),
        isolate_tenants=False,
    )
    fleet = FleetConfig(
        workers=len(names),
        names=names,
        engine=EngineConfig(
            capacity_tokens=case.capacity_tokens,
            prefill_tokens_per_s=case.prefill_tokens_per_s,
            host_capacity_tokens=case.host_capacity_tokens,
            host_copy_tokens_per_s=case.host_copy_tokens_per_s,
        ),
        concurrency=case.concurrency,
        pending_ttl_s=case.pending_ttl_s,
    )
    return compare(requests, [case.policy], fleet, seed=case.seed).runs[case.policy].summary


def run_case(case: FidelityCase) -> FidelityOutcome:
    live, names = run_live(case)
    if live["counts"]["ok"] != case.requests:
        raise RuntimeError(f"live run had failures: {live['counts']} {live['errors']}")
    return FidelityOutcome(case, live, run_offline(case, names))
