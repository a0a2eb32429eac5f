"""The torch worker as a real process on 127.0.0.1: three served names over two sets of weights
in one page pool (tiny, an alias of it, and a Hugging Face directory written here), the
official `openai` client, the discovery document, cached tokens, salts, SGLang's endpoints,
errors, one KV-event stream per kv_group rebuilt through real subscribers, the gateway routing
to it unchanged, and a clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from core.blocks import block_keys
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.kv_subscriber import KVEventSubscriber
from tests import processes
from tests.backends.test_engine_models import write_model
from tests.processes import wait_for
from urc.processes import Child, start_gateway

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
BS = 16


def running_worker(*args: str, **kwargs: Any) -> AbstractContextManager[Child]:
    return processes.running_worker(
        "backends.torch_worker.server", "--threads", "1", *args, **kwargs
    )


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    other = write_model(tmp_path_factory.mktemp("hf") / "other")
    args = ["--model", "tiny", "--model", "alias=tiny", "--model", f"other={other}"]
    with running_worker(*args, "--num-pages", "400", "--max-model-len", "1024") as w:
        yield w


@pytest.fixture()
def client(worker: Child) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="none", timeout=30, max_retries=0)


def info(worker: Child) -> dict:
    return httpx.get(worker.url + "/urc/info", timeout=10).json()


def cached_tokens(client: openai.OpenAI, model: str, prompt: list[int], **extra: object) -> int:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0, **extra
    )  # type: ignore[call-overload]
    return out.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]


def test_info_document(worker: Child) -> None:
    doc = info(worker)
    assert doc["engine"] == "torch" and doc["block_size"] == BS and doc["device"] == "cpu"
    tiny, alias, other = doc["models"]
    assert [m["name"] for m in doc["models"]] == ["tiny", "alias", "other"]
    assert tiny["kv_group"] == alias["kv_group"] != other["kv_group"]
    assert tiny["fingerprint"] == alias["fingerprint"] and len(tiny["fingerprint"]) == 32
    assert tiny["tokenizer"] == "byte" and Path(other["tokenizer"]).is_dir()
    assert tiny["max_model_len"] == 1024
    assert tiny["kv_events"] == alias["kv_events"]
    assert tiny["kv_events"]["endpoint"] != other["kv_events"]["endpoint"]
    assert "kv_events" not in doc  # two kv_groups: no one stream speaks for the worker
    (pool,) = doc["pools"]  # one layout: one pool shared by both sets of weights
    assert sorted(pool["kv_groups"]) == sorted({tiny["kv_group"], other["kv_group"]})
    assert pool["pages"] == 399 and doc["capacity_tokens"] == 399 * BS


def test_completions_and_chat_with_the_openai_client(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog, twice over."
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt.encode())
    assert out.choices[0].finish_reason in ("length", "stop")
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text

    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model="alias", messages=messages, max_tokens=6, temperature=0
    )  # type: ignore[arg-type]
    assert chat.object == "chat.completion" and chat.model == "alias"
    chunks = list(
        client.chat.completions.create(
            model="alias",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    sampled = client.completions.create(
        model="other", prompt="Hello there", max_tokens=8, temperature=1.0, seed=3, top_p=0.9
    )
    again = client.completions.create(
        model="other", prompt="Hello there", max_tokens=8, temperature=1.0, seed=3, top_p=0.9
    )
    assert sampled.choices[0].text == again.choices[0].text  # seeded sampling repeats
    assert [m.id for m in client.models.list().data] == ["tiny", "alias", "other"]


def test_cache_hits_follow_kv_groups_and_salts(client: openai.OpenAI) -> None:
    prompt = list(range(10, 110))  # token ids both vocabularies know
    assert cached_tokens(client, "tiny", prompt) == 0
    assert cached_tokens(client, "alias", prompt) == 96  # an alias: the same pages
    assert cached_tokens(client, "other", prompt) == 0  # other weights: never tiny's pages
    assert cached_tokens(client, "other", prompt) == 96
    salt = {"extra_body": {"cache_salt": "tenant-b"}}
    assert cached_tokens(client, "tiny", prompt, **salt) == 0
    assert cached_tokens(client, "tiny", prompt, **salt) == 96


def test_sglang_endpoints_and_errors(worker: Child) -> None:
    with httpx.Client(base_url=worker.url, timeout=30) as h:
        body = {
            "input_ids": list(range(40)),
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        }
        out = h.post("/generate", json=body).json()
        assert len(out["output_ids"]) == 5 and out["meta_info"]["prompt_tokens"] == 40
        assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
        assert h.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 32
        server = h.get("/get_server_info").json()
        assert server["page_size"] == BS and server["max_total_num_tokens"] == 399 * BS
        assert h.get("/get_load").json()[0]["num_reqs"] == 0
        assert h.get("/health_generate").status_code == 200
        assert h.get("/health").status_code == 200
        assert h.get("/get_model_info").json()["tokenizer_path"] == "byte"

        bad = h.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
        long = h.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x" * 1020, "max_tokens": 10}
        )
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        ids = h.post("/v1/completions", json={"model": "tiny", "prompt": [300], "max_tokens": 1})
        assert ids.status_code == 400  # outside tiny's 260 ids
        assert h.post("/v1/completions", content=b"{").status_code == 400
        metrics = h.get("/metrics").text
    assert 'urc_engine_cached_tokens_total{model="tiny"}' in metrics
    assert 'urc_engine_pool_free_pages{pool="0"}' in metrics


async def test_each_kv_group_streams_its_own_events(worker: Child) -> None:
    doc = info(worker)
    index = UnifiedIndex()
    subs = []
    for model in (doc["models"][0], doc["models"][2]):
        events = model["kv_events"]
        mirror = WorkerMirror(index, "w0", model["kv_group"], block_size=BS)
        subs.append(
            KVEventSubscriber(
                mirror, events["endpoint"], events["replay_endpoint"], topic=events["topic"]
            )
        )
    tasks = [asyncio.create_task(sub.run()) for sub in subs]
    try:
        await asyncio.wait_for(asyncio.gather(*(s.synced.wait() for s in subs)), 10)
        prompt = [7] * 20 + list(range(60))
        async with httpx.AsyncClient(base_url=worker.url, timeout=30) as h:
            for model in ("tiny", "other"):
                body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                assert (await h.post("/v1/completions", json=body)).status_code == 200
        keys = block_keys(prompt, BS)
        tiny_group, other_group = doc["models"][0]["kv_group"], doc["models"][2]["kv_group"]
        for _ in range(200):
            if set(keys) <= index.residency("w0", tiny_group) & index.residency("w0", other_group):
                break
            await asyncio.sleep(0.02)
        assert index.match(keys, tiny_group) == {"w0": len(keys)}
        assert index.match(keys, other_group) == {"w0": len(keys)}
    finally:
        for sub in subs:
            sub.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)


def test_the_gateway_routes_to_torch_workers_unchanged() -> None:
    with running_worker("--num-pages", "200") as w:
        gateway = start_gateway([w.url], "--admin-key", "k")
        try:
            admin = {"Authorization": "Bearer k"}

            def exact() -> bool:
                try:
                    workers = httpx.get(f"{gateway.url}/admin/workers", headers=admin).json()
                except httpx.HTTPError:
                    return False
                return [x["mode"] for x in workers["workers"]] == ["exact"]

            assert wait_for(exact, 20)
            body = {"model": "tiny", "prompt": "a shared system prompt " * 4, "max_tokens": 3}
            first = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
            assert first.status_code == 200, first.text

            def predicted() -> int:
                plan = httpx.post(f"{gateway.url}/admin/route", json=body, headers=admin)
                return max(c["matched_tokens"] for c in plan.json()["candidates"])

            assert wait_for(lambda: predicted() == 80, 10)  # learned from the KV events
            again = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
            assert "matched_tokens=80" in again.headers["x-urc-route"]
        finally:
            gateway.stop()


def test_public_prefix_and_scoped_invalidation(client: openai.OpenAI, worker: Child) -> None:
    prompt = list(range(150, 198)) + list(range(198, 250))  # 3 public pages, then private
    a = {"extra_body": {"cache_salt": "ta", "urc_public_tokens": 48}}
    b = {"extra_body": {"cache_salt": "tb", "urc_public_tokens": 48}}
    assert cached_tokens(client, "tiny", prompt, **a) == 0
    assert cached_tokens(client, "tiny", prompt, **b) == 48  # the public part only
    assert cached_tokens(client, "tiny", prompt, **a) == 96
    r = httpx.post(worker.url + "/urc/invalidate", json={"salt_prefix": "ta"}, timeout=30)
    assert r.status_code == 200 and r.json()["freed_blocks"] == 3
    assert cached_tokens(client, "tiny", prompt, **b) == 96  # another tenant's: untouched
    assert cached_tokens(client, "tiny", prompt, **a) == 48  # ta's own blocks are gone
    bad = httpx.post(worker.url + "/urc/invalidate", json={"salt": ""}, timeout=30)
    assert bad.status_code == 400


def test_a_host_tier_in_info_metrics_and_usage() -> None:
    with running_worker("--num-pages", "6", "--host-capacity-tokens", "640") as w:
        doc = info(w)
        assert doc["host_capacity_tokens"] == 640 and doc["pools"][0]["host_pages"] == 40
        client = openai.OpenAI(base_url=w.url + "/v1", api_key="none", timeout=30, max_retries=0)
        first, other = list(range(60, 125)), list(range(130, 195))  # 4 full blocks each
        assert cached_tokens(client, "tiny", first) == 0
        assert cached_tokens(client, "tiny", other) == 0  # 5 GPU pages: `first` is demoted
        assert cached_tokens(client, "tiny", first) == 4 * BS  # promoted back
        metrics = httpx.get(w.url + "/metrics", timeout=10).text
    assert f'urc_engine_host_hit_tokens_total{{model="tiny"}} {4 * BS}.0' in metrics
    assert 'urc_engine_host_pages{pool="0"} 40.0' in metrics
    assert 'urc_engine_host_promoted_pages_total{pool="0"} 4.0' in metrics
