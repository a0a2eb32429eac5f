"""LoRA adapters end to end (docs/adapters.md): a real gateway in front of two real emulated
workers serving adapters (`--enable-lora`), their KV events on the base's stream: an adapter
nobody has loaded is loaded on demand; repeated prompts per adapter are predicted exactly
(x-urc-route's matched_tokens = the worker's cached_tokens); a prompt cached under one adapter
is predicted 0 for another and for the base."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.backends.test_emulated_server import FAST, unique
from tests.gateway import ADMIN, admin_workers, route
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

pytestmark = pytest.mark.timeout(120)
MODEL, GROUP = "emu-8b", "emu-8b-bf16"
ADAPTERS = ("sql", "poet")


@contextlib.contextmanager
def _fleet(tmp: Path) -> Iterator[tuple[str, list[Child]]]:
    lora = ["--enable-lora", "--max-loras", "2", "--lora-default-mb", "1"]
    workers = [start_worker("--model", MODEL, "--kv-group", GROUP, *FAST, *lora) for _ in "ab"]
    config = tmp / "gateway.toml"
    tables = [f'[[models]]\nname = "{MODEL}"\nkv_group = "{GROUP}"\n']
    tables += [
        f'[[models]]\nname = "{a}"\nbase = "{MODEL}"\nlora_path = "/m/{a}"\n' for a in ADAPTERS
    ]
    config.write_text('[gateway]\nadmin_key = "admin-secret"\n' + "\n".join(tables))
    gateway = None
    try:
        urls = [w.url for w in workers]
        gateway = start_gateway(urls, "--config", str(config))
        exact = lambda: [w["mode"] for w in admin_workers(gateway.url)] == ["exact"] * 2  # noqa: E731
        assert wait_for(exact, 20)
        yield gateway.url, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def _complete(url: str, model: str, prompt: str) -> tuple[int, int, str]:
    """(predicted, cached, worker) of one completion through the gateway."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    said = route(resp)
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(said["matched_tokens"]), int(cached), said["worker"]


def _predicted(url: str, model: str, prompt: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    plan = httpx.post(f"{url}/admin/route", json=body, headers=ADMIN, timeout=5).json()
    return max(c["matched_tokens"] for c in plan["candidates"])


def test_adapters_load_on_demand_and_are_predicted_exactly(tmp_path: Path) -> None:
    with _fleet(tmp_path) as (url, _workers):
        prompt = unique(200)
        assert _complete(url, "sql", prompt)[:2] == (0, 0)  # loaded on demand, then answered
        assert wait_for(lambda: _predicted(url, "sql", prompt) > 0, 10)  # its KV events came
        predicted, cached, _ = _complete(url, "sql", prompt)
        assert predicted == cached == 192  # the worker's blocks, as the gateway predicted them
        assert _predicted(url, "poet", prompt) == 0  # never another adapter's
        assert _predicted(url, MODEL, prompt) == 0  # nor the base's
        assert _complete(url, "poet", prompt)[:2] == (0, 0)
        assert _complete(url, MODEL, prompt)[:2] == (0, 0)
        for adapter in ADAPTERS:  # each reuses its own prefix, predicted exactly
            other = unique(150)
            _complete(url, adapter, other)
            assert wait_for(lambda: _predicted(url, adapter, other) > 0, 10)  # noqa: B023
            predicted, cached, _ = _complete(url, adapter, other)
            assert predicted == cached == 144
        metrics = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=5).text
        loads = [m for m in metrics.splitlines() if m.startswith("urc_adapter_loads_total{")]
        assert sum(float(m.rsplit(" ", 1)[1]) for m in loads) >= 2
