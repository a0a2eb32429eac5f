"""The token-parity probe end to end: an emulated worker (byte tokenizer) behind a gateway that
tokenizes like it, and behind one configured with a different tokenizer, which the probe must
catch (logged, exported, the worker routed in approximate mode) until a probe matches again."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from backends.tiny_checkpoint import write_tokenizer
from core.tokenizer import HFTokenizer
from router.gateway.config import GatewayConfig, WorkerConfig
from router.gateway.fleet import Fleet
from router.gateway.parity import ParityProbe
from router.index import UnifiedIndex
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker

ADMIN = {"Authorization": "Bearer k"}


def workers(gateway: str) -> list[dict]:
    return httpx.get(f"{gateway}/admin/workers", headers=ADMIN, timeout=5).json()["workers"]


def parity(gateway: str) -> dict[str, float]:
    text = httpx.get(f"{gateway}/metrics", timeout=5).text
    found = re.findall(
        r'^urc_tokenizer_parity\{model="([^"]+)",worker="([^"]+)"\} (\S+)$', text, re.M
    )
    return {f"{worker}/{model}": float(value) for model, worker, value in found}


@pytest.fixture(scope="module")
def worker():
    proc = start_worker()
    try:
        yield proc
    finally:
        proc.stop()


def test_a_matching_tokenizer_keeps_the_worker_exact(worker) -> None:
    gateway = start_gateway([worker.url], "--admin-key", "k")
    try:
        assert wait_for(lambda: list(parity(gateway.url).values()) == [1.0], 20)
        assert [w["mode"] for w in workers(gateway.url)] == ["exact"]
    finally:
        gateway.stop()


def test_a_different_tokenizer_is_caught_and_the_worker_downgraded(worker, tmp_path: Path) -> None:
    write_tokenizer(tmp_path, vocab_size=400)
    gateway = start_gateway(
        [worker.url], "--admin-key", "k", "--model-tokenizer", f"emulated={tmp_path}"
    )
    try:
        assert wait_for(lambda: list(parity(gateway.url).values()) == [0.0], 20)
        assert wait_for(lambda: [w["mode"] for w in workers(gateway.url)] == ["approximate"], 10)
        assert any("tokenizer parity" in line for line in gateway.lines)
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=5).text
        assert re.search(r"^urc_tokenizer_parity_mismatches_total\{.*\} 1\.0$", metrics, re.M)
        # routed on the gateway's own history: a repeated prompt is predicted as cached
        body = {"model": "emulated", "prompt": "parity " * 40, "max_tokens": 2}
        first = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
        second = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == second.status_code == 200
        assert "matched_tokens=0" in first.headers["x-urc-route"]
        assert "matched_tokens=0" not in second.headers["x-urc-route"]
    finally:
        gateway.stop()


async def test_a_probe_that_matches_again_restores_exact_mode(worker, tmp_path: Path) -> None:
    write_tokenizer(tmp_path, vocab_size=400)
    index = UnifiedIndex()
    fleet = Fleet(GatewayConfig(workers=[WorkerConfig(url=worker.url)]), index)
    await fleet.start()
    try:
        (w,) = fleet.workers.values()
        (name,) = w.models
        probe = ParityProbe(fleet, interval_s=60)
        model = fleet.models[name]
        own = model.tokenizer
        assert w.mode == "exact"
        model.tokenizer = HFTokenizer(tmp_path)
        await probe.probe(w)
        state = probe.states[(w.name, name)]
        assert (w.mode, state.ok, state.mismatches) == ("approximate", False, 1)
        assert state.expected != state.actual
        assert probe.describe()[0]["ok"] is False
        model.tokenizer = own
        await probe.probe(w)
        assert (w.mode, state.ok, state.checks) == ("exact", True, 2)
    finally:
        await fleet.close()
