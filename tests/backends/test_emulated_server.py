"""The emulated worker as a real process on 127.0.0.1: the official `openai` client against it
(chat and completions, streamed and not), cached tokens and salts, the discovery document,
SGLang's endpoints, OpenAI-shaped errors for bad input, clean exits on SIGTERM and SIGINT, and
KV events that rebuild the worker's cache in the gateway's index through a real subscriber."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from backends.emulated.request import output_tokens
from core.blocks import block_keys
from core.tokenizer import ByteTokenizer
from router.index import UnifiedIndex, host_group
from router.kv_mirror import WorkerMirror
from router.kv_subscriber import KVEventSubscriber
from tests import processes
from urc.processes import Child

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "emu-8b"
GROUP = "emu-8b-bf16"
BS = 16
FAST = ["--prefill-tokens-per-s", "500000", "--decode-base-ms", "2"]
FAST += ["--decode-per-request-ms", "0.01"]


def running_worker(*args: str, **kwargs: Any) -> AbstractContextManager[Child]:
    return processes.running_worker("backends.emulated.server", *args, **kwargs)


@pytest.fixture(scope="module")
def worker() -> Iterator[Child]:
    with running_worker("--model", MODEL, "--kv-group", GROUP, "--max-body-mb", "1", *FAST) as w:
        yield w


@pytest.fixture()
def client(worker: Child) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="none", timeout=10, max_retries=0)


def http(worker: Child) -> httpx.Client:
    return httpx.Client(base_url=worker.url, timeout=10)


def unique(n: int) -> str:
    """A prompt of n characters (n byte tokens) that no other test sends."""
    return (uuid.uuid4().hex * (n // 32 + 1))[:n]


def expected_text(n: int) -> str:
    return bytes(output_tokens(n)).decode()


def cached(n_prompt: int) -> int:
    """What a repeat of an n-token prompt finds: its full blocks, keeping one token to compute."""
    return (n_prompt - 1) // BS * BS


# -- OpenAI ------------------------------------------------------------------------------------


def test_chat_completions(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello " + unique(40)}]
    prompt_tokens = len(ByteTokenizer().encode_chat(messages))
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)  # type: ignore[arg-type]
    assert out.object == "chat.completion" and out.model == MODEL
    assert out.choices[0].message.content == expected_text(12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.prompt_tokens == prompt_tokens
    assert (out.usage.completion_tokens, out.usage.total_tokens) == (12, prompt_tokens + 12)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(7)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached(prompt_tokens)  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])

    default = client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    assert default.choices[0].finish_reason == "stop"  # no limit set: the answer just ends
    assert default.usage is not None and default.usage.completion_tokens == 256


def test_completions(client: openai.OpenAI) -> None:
    prompt = unique(100)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert out.object == "text_completion" and out.choices[0].text == expected_text(5)
    assert out.usage is not None and out.usage.prompt_tokens == 100
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == expected_text(9)
    assert pieces[-1].choices[0].finish_reason == "length"
    ids = list(range(1, 60))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 59
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("priority", [-(2**63), -5, 0, 7, 2**63 - 1])
def test_vllms_priority_field_is_accepted(client: openai.OpenAI, priority: int) -> None:
    extra = {"priority": priority}
    out = client.completions.create(model=MODEL, prompt=unique(40), max_tokens=3, extra_body=extra)
    assert out.choices[0].text == expected_text(3)
    messages = [{"role": "user", "content": unique(30)}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        stream=True,
        extra_body=extra,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected_text(4)
    answer = client.responses.create(
        model=MODEL, input=unique(30), max_output_tokens=2, extra_body=extra
    )
    assert answer.output_text == expected_text(2)


def test_the_protect_hint_header_is_checked(worker: Child) -> None:
    body = {"model": MODEL, "prompt": unique(20), "max_tokens": 2}
    with http(worker) as h:
        ok = h.post("/v1/completions", json=body, headers={"x-urc-protect": "-2"})
        assert ok.status_code == 200
        bad = h.post("/v1/completions", json=body, headers={"x-urc-protect": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-urc-protect"


async def test_the_worker_schedules_by_priority() -> None:
    # one request at a time: while `long` decodes, `low` then `high` queue; the better priority
    # runs first, so it is the one whose shared prefix the other then finds cached
    with running_worker("--model", MODEL, "--kv-group", GROUP, *FAST, "--max-batch", "1") as w:
        async with aiohttp.ClientSession(w.url, timeout=aiohttp.ClientTimeout(total=20)) as s:

            async def send(prompt: str, priority: int) -> int:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "priority": priority}
                async with s.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    usage = (await resp.json())["usage"]
                    return int(usage["prompt_tokens_details"]["cached_tokens"])

            body = {"model": MODEL, "prompt": unique(20), "max_tokens": 100_000, "stream": True}
            async with s.post("/v1/completions", json=body) as long:
                await long.content.readline()  # decoding: the batch is full
                shared = unique(4 * BS)
                low = asyncio.create_task(send(shared + unique(20), 5))
                high = asyncio.create_task(send(shared + unique(20), -5))
                for _ in range(200):  # bounded: until both wait in the engine's queue
                    async with s.get("/urc/load") as resp:
                        if (await resp.json())["waiting"] == 2:
                            break
                    await asyncio.sleep(0.02)
                else:
                    raise AssertionError("the two requests never queued")
            # the stream closed: `long` is aborted and frees the batch
            assert await high == 0 and await low == 4 * BS


def test_a_repeated_prompt_reports_cached_tokens_in_usage_and_header(
    client: openai.OpenAI, worker: Child
) -> None:
    prompt = unique(300)
    first = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.headers["x-urc-cached-tokens"] == "0"
    again = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.headers["x-urc-cached-tokens"] == str(cached(300))
    usage = again.parse().usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens == cached(300)  # type: ignore[union-attr]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True}
    with http(worker) as h, h.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.headers["x-urc-cached-tokens"] == str(cached(300))  # no usage in this stream
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_cache_salt_isolates_tenants(client: openai.OpenAI) -> None:
    prompt = unique(200)

    def cached_tokens(**extra: Any) -> int:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **extra)
        return out.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

    assert cached_tokens() == 0
    assert cached_tokens() == cached(200)
    assert cached_tokens(extra_body={"cache_salt": "tenant-b"}) == 0
    assert cached_tokens(extra_body={"cache_salt": "tenant-b"}) == cached(200)
    assert cached_tokens(extra_body={"cache_salt": "tenant-c"}) == 0


# -- discovery, metrics, SGLang ----------------------------------------------------------------


def test_info_document(worker: Child) -> None:
    with http(worker) as h:
        info = h.get("/urc/info").json()
        metrics = h.get("/metrics").text
    assert info["engine"] == "emulated" and len(info["incarnation"]) == 32
    assert info["block_size"] == BS and info["capacity_tokens"] == 400_000
    (model,) = info["models"]
    assert model["name"] == MODEL and model["kv_group"] == GROUP and model["tokenizer"] == "byte"
    assert len(model["fingerprint"]) == 32 and model["max_model_len"] == 131_072
    events = info["kv_events"]
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["topic"] == ""
    assert events["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert set(info["load"]) == {"running", "waiting", "queued_prefill_tokens", "decoding"}
    assert "urc_engine_requests_total" in metrics and "urc_engine_cache_usage" in metrics


def test_sglang_endpoints(worker: Child) -> None:
    with http(worker) as h:
        assert h.get("/health").status_code == 200
        assert h.get("/health_generate").status_code == 200
        for path in ("/get_model_info", "/model_info"):
            info = h.get(path).json()
            assert info["model_path"] == MODEL and info["is_generation"] is True
        for path in ("/get_server_info", "/server_info"):
            server = h.get(path).json()
            assert server["page_size"] == BS and server["max_total_num_tokens"] == 400_000
            assert server["internal_states"][0]["num_running_reqs"] >= 0
        assert h.get("/get_load").json()[0]["num_reqs"] >= 0

        text = unique(80)
        body = {"text": text, "sampling_params": {"max_new_tokens": 6}}
        out = h.post("/generate", json=body).json()
        assert out["text"] == expected_text(6) and out["output_ids"] == output_tokens(6)
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (80, 6)
        assert meta["cached_tokens"] == 0

        body = {"input_ids": list(text.encode()), "sampling_params": {"max_new_tokens": 4}}
        with h.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    outs = [json.loads(e) for e in events[:-1]]
    assert outs[-1]["text"] == expected_text(4)  # each event carries the whole output so far
    assert all(o["text"] == expected_text(o["meta_info"]["completion_tokens"]) for o in outs)
    assert outs[-1]["meta_info"]["cached_tokens"] == cached(80)
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "length"


# -- bad input ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
BAD: list[tuple[str, str, Any, int]] = [
    ("POST", CHAT, b"{not json", 400),
    ("POST", CHAT, b"[1, 2]", 400),
    ("POST", CHAT, {"model": MODEL}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": "hi"}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, 400),
    ("POST", CHAT, {"model": "gpt-nope", "messages": MSGS}, 404),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 0}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": "ten"}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 10**9}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "n": 2}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "cache_salt": ""}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "priority": "high"}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "priority": 1.5}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "priority": True}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "priority": 2**63}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "priority": [1]}, 400),
    ("POST", "/v1/responses", {"model": MODEL, "input": "a", "priority": "1"}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "stream": "yes"}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "stream_options": 3, "stream": True}, 400),
    ("POST", CHAT, {"model": MODEL, "messages": MSGS, "stream_options": {}}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)}, 413),
    ("POST", "/generate", {"sampling_params": {}}, 400),
    ("POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400),
    ("GET", CHAT, None, 405),
    ("GET", "/v1/nothing-here", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD)
def test_bad_input_gets_an_openai_error(
    worker: Child, method: str, path: str, body: Any, status: int
) -> None:
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": body}
    with http(worker) as h:
        resp = h.request(method, path, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


# -- KV events -------------------------------------------------------------------------------


async def test_kv_events_rebuild_the_workers_cache_in_the_index() -> None:
    with running_worker("--model", MODEL, "--kv-group", GROUP, *FAST, stop=signal.SIGINT) as w:
        expected: set[int] = set()
        async with aiohttp.ClientSession(w.url, timeout=aiohttp.ClientTimeout(total=10)) as s:

            async def send(ids: list[int], max_tokens: int, salt: str | None = None) -> None:
                body: dict[str, Any] = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens}
                if salt is not None:
                    body["cache_salt"] = salt
                async with s.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                # the KV of prompt + output but the last token, in full blocks
                expected.update(block_keys(ids + output_tokens(max_tokens - 1), BS, salt))

            shared = list(os.urandom(100))
            await send(shared + [1] * 40, 20)
            await send(shared + [2] * 40, 5, salt="tenant-a")
            async with s.get("/urc/info") as resp:
                info = await resp.json()

            index = UnifiedIndex()
            mirror = WorkerMirror(index, "w0", info["models"][0]["kv_group"], BS)
            events = info["kv_events"]
            sub = KVEventSubscriber(
                mirror, events["endpoint"], events["replay_endpoint"], topic=events["topic"]
            )
            task = asyncio.create_task(sub.run())
            try:
                await asyncio.wait_for(sub.synced.wait(), 10)  # caught up by replay
                assert index.residency("w0", GROUP) == expected
                await send(shared + [3] * 70, 33)  # now live
                await send(shared + [2] * 40, 5, salt="tenant-a")
                for _ in range(200):
                    if index.residency("w0", GROUP) == expected:
                        break
                    await asyncio.sleep(0.02)
                assert index.residency("w0", GROUP) == expected
                keys = block_keys(shared + [3] * 70, BS)
                assert index.match(keys, GROUP) == {"w0": len(keys)}
                assert index.match(block_keys(shared, BS, "tenant-b"), GROUP) == {}
            finally:
                sub.stop()
                await asyncio.wait_for(task, 5)


async def test_a_host_tier_serves_an_evicted_prefix_and_its_events_mirror_both_tiers() -> None:
    tier = ["--capacity-tokens", "256", "--host-capacity-tokens", "4096"]
    with running_worker("--model", MODEL, "--kv-group", GROUP, *FAST, *tier) as w:
        async with aiohttp.ClientSession(w.url, timeout=aiohttp.ClientTimeout(total=10)) as s:

            async def send(ids: list[int], max_tokens: int) -> int:
                body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens}
                async with s.post("/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    usage = (await resp.json())["usage"]
                return int(usage["prompt_tokens_details"]["cached_tokens"])

            first = list(os.urandom(150))
            assert await send(first, 10) == 0
            assert await send(list(os.urandom(240)), 10) == 0  # evicts `first` to the host
            async with s.get("/urc/info") as resp:
                info = await resp.json()
            assert info["host_capacity_tokens"] == 4096 and info["host_copy_tokens_per_s"] > 0
            index = UnifiedIndex()
            mirror = WorkerMirror(index, "w0", GROUP, BS)
            events = info["kv_events"]
            sub = KVEventSubscriber(
                mirror, events["endpoint"], events["replay_endpoint"], topic=events["topic"]
            )
            task = asyncio.create_task(sub.run())
            try:
                await asyncio.wait_for(sub.synced.wait(), 10)
                keys = block_keys(first, BS)
                assert index.residency("w0", host_group(GROUP)) >= set(keys)
                assert index.residency("w0", GROUP).isdisjoint(keys)
                assert await send(first, 10) == cached(150)  # promoted back
                for _ in range(200):
                    if index.residency("w0", GROUP) >= set(keys):
                        break
                    await asyncio.sleep(0.02)
                assert index.residency("w0", GROUP) >= set(keys)  # and still on the host
                assert index.residency("w0", host_group(GROUP)) >= set(keys)
            finally:
                sub.stop()
                await asyncio.wait_for(task, 5)
            async with s.get("/metrics") as resp:
                metrics = await resp.text()
    host_hits = f'urc_engine_host_hit_tokens_total{{model="{MODEL}"}} {cached(150)}.0'
    assert host_hits in metrics and "urc_engine_host_promoted_blocks_total" in metrics
