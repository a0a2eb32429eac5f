"""LoRA adapters on a real emulated worker process over HTTP (127.0.0.1): vLLM's load and unload
endpoints with their statuses, `--lora-modules`, `/v1/models` and `/urc/info` as vLLM and the
gateway read them, the slots in the pushed and polled load, the metrics, per-adapter caching,
and the KV events that file an adapter's blocks under `<base kv_group>+lora:<name>` in the
gateway's index with the keys the gateway computes for its requests."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx
import pytest

from backends.emulated.request import output_tokens
from core.blocks import block_keys
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.kv_subscriber import KVEventSubscriber
from tests.backends.test_emulated_server import BS, FAST, GROUP, MODEL, running_worker, unique

pytestmark = pytest.mark.timeout(60)

LORA = ["--enable-lora", "--max-loras", "2", "--lora-default-mb", "1"]


def complete(http: httpx.Client, model: str, prompt: str) -> int:
    """The cached tokens of one completion."""
    resp = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_endpoints_models_info_load_and_metrics() -> None:
    args = ["--model", MODEL, "--kv-group", GROUP, *FAST, *LORA, "--lora-modules", "a1=/m/a1"]
    with running_worker(*args) as w, httpx.Client(base_url=w.url, timeout=10) as http:
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        assert cards["a1"]["root"] == "/m/a1" and cards["a1"]["parent"] == MODEL
        assert cards[MODEL]["parent"] is None
        ok = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/m/a2"})
        assert ok.status_code == 200 and "a2" in ok.text
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/m"})
        assert (
            again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        )
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "a3"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert gone.status_code == 404 and "error" in gone.json()

        text = unique(100)
        assert complete(http, "a1", text) == 0
        assert complete(http, "a1", text) == 96  # its own blocks
        assert complete(http, MODEL, text) == 0  # never the base's
        assert complete(http, "a2", text) == 0  # nor another adapter's

        info = http.get("/urc/info").json()
        models = {m["name"]: m for m in info["models"]}
        assert models["a1"]["kv_group"] == f"{GROUP}+lora:a1"
        assert models["a1"]["base"] == MODEL and models["a1"]["lora_path"] == "/m/a1"
        assert "kv_events" not in models["a1"]  # its blocks ride the base's stream
        assert models[MODEL]["kv_events"] == info["kv_events"]
        assert info["lora"] == {"max_loras": 2, "active": ["a1", "a2"]}
        load = http.get("/urc/load").json()
        assert load["lora_active"] == ["a1", "a2"] and load["max_loras"] == 2
        metrics = http.get("/metrics").text
        assert f'urc_worker_lora_loads_total{{model="{MODEL}"}} 2.0' in metrics
        assert f'urc_worker_lora_evictions_total{{model="{MODEL}"}} 0.0' in metrics
        assert f'urc_worker_lora_active{{model="{MODEL}"}} 2.0' in metrics

        ok = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert ok.status_code == 200 and "removed" in ok.text
        after = http.post("/v1/completions", json={"model": "a2", "prompt": "x", "max_tokens": 1})
        assert after.status_code == 404
        assert "a2" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
        assert http.get("/urc/load").json()["lora_active"] == ["a1"]


def test_without_enable_lora_the_endpoints_are_not_there() -> None:
    with running_worker("--model", MODEL, *FAST) as w, httpx.Client(base_url=w.url) as http:
        body = {"lora_name": "a", "lora_path": "/m/a"}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert "lora" not in http.get("/urc/info").json()
        assert "lora_active" not in http.get("/urc/load").json()


async def test_adapter_kv_events_mirror_under_the_adapter_group() -> None:
    args = ["--model", MODEL, "--kv-group", GROUP, *FAST, *LORA, "--lora-modules", "ad=/m/ad"]
    with running_worker(*args) as w:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(w.url, timeout=timeout) as s:

            async def send(model: str, ids: list[int], salt: str | None = None) -> list[int]:
                body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 3}
                if salt is not None:
                    body["cache_salt"] = salt
                async with s.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                lora = None if model == MODEL else model
                return block_keys(ids + output_tokens(2), BS, salt, lora=lora)

            async with s.get("/urc/info") as resp:
                info = await resp.json()
            index = UnifiedIndex()
            # own_keys: our worker's block hashes are the gateway's keys
            mirror = WorkerMirror(index, "w0", GROUP, BS, own_keys=True)
            events = info["kv_events"]
            sub = KVEventSubscriber(
                mirror, events["endpoint"], events["replay_endpoint"], topic=events["topic"]
            )
            task = asyncio.create_task(sub.run())
            try:
                await asyncio.wait_for(sub.synced.wait(), 10)
                ids = list(range(40, 120))
                base = set(await send(MODEL, ids))
                adapter = set(await send("ad", ids))
                adapter |= set(await send("ad", ids[:50], salt="t1"))
                group = f"{GROUP}+lora:ad"
                for _ in range(200):
                    if index.residency("w0", group) == adapter:
                        break
                    await asyncio.sleep(0.02)
                assert index.residency("w0", group) == adapter
                assert index.residency("w0", GROUP) == base
                keys = block_keys(ids, BS, lora="ad")
                assert index.match(keys, group) == {"w0": len(keys)}
                assert index.match(keys, GROUP) == {}
                async with s.post("/v1/unload_lora_adapter", json={"lora_name": "ad"}) as resp:
                    assert resp.status == 200
                for _ in range(200):
                    if not index.residency("w0", group):
                        break
                    await asyncio.sleep(0.02)
                assert not index.residency("w0", group)
                assert index.residency("w0", GROUP) == base
            finally:
                sub.stop()
                await asyncio.wait_for(task, 5)
