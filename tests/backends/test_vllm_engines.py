"""The gateway in front of two real vLLM CPU engines (`make test-vllm`; skipped without
URC_VLLM_PYTHON): the openai client through it, prefixes routed to the engine holding them,
vLLM's cached_tokens against the gateway's prediction, the mirror following vLLM's evictions,
the parity probe catching a different tokenizer, a killed engine failed over and purged."""

from __future__ import annotations

import concurrent.futures as cf
import re

import httpx
import openai
import pytest

from backends.real.process import start_engine
from backends.tiny_checkpoint import write_checkpoint, write_tokenizer
from core.text import filler
from tests.backends.vllm_fleet import (
    ADMIN,
    BLOCK,
    MODEL,
    VLLM_PYTHON,
    admin_workers,
    attach_args,
    cached_tokens,
    route,
    settle,
    start_vllm_engines,
)
from tests.processes import wait_for
from urc.processes import start_gateway

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON, reason="URC_VLLM_PYTHON unset (make test-vllm)"),
    pytest.mark.timeout(900),
]
KEYS = {"acme": "sk-acme", "beta": "sk-beta"}
NUM_BLOCKS = 64  # per engine: 2,048 tokens, so that a few dozen prompts make vLLM evict


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm")
    model_dir = write_checkpoint(root / "model")
    engines = start_vllm_engines(model_dir, root, 2, NUM_BLOCKS)
    api_keys = [a for tenant, key in KEYS.items() for a in ("--api-key", f"{tenant}:{key}")]
    gateway = start_gateway(
        [],
        *attach_args(engines),
        "--model-tokenizer",
        f"{MODEL}={model_dir}",
        "--admin-key",
        "admin",
        *api_keys,
    )
    try:
        assert wait_for(
            lambda: [w["mode"] for w in admin_workers(gateway.url)] == ["exact"] * 2, 60
        )
        yield gateway, engines, root
    finally:
        gateway.stop()
        for engine in engines:
            engine.stop()


def post(url: str, path: str, body: dict, tenant: str = "acme") -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    response = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response


def chat(prefix: str, question: str) -> dict:
    messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


def test_openai_client_streamed_and_not(fleet) -> None:
    gateway, _, _ = fleet
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["acme"], max_retries=0)
    messages = [{"role": "user", "content": "hello there"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content is not None
    text = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=5)
    assert text.usage.completion_tokens >= 1
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    pieces = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True))
    assert any(p.choices for p in pieces)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_the_gateway_samples_vllm_load_from_its_metrics(fleet) -> None:
    """Attached without an engine name: /urc/load is 404 there, so its /metrics are read."""
    gateway, _, _ = fleet

    def sampled() -> bool:
        reports = [w["reported"] or {} for w in admin_workers(gateway.url)]
        return all(r.get("source") == "prometheus" and "waiting" in r for r in reports)

    assert wait_for(sampled, 10)
    for worker in admin_workers(gateway.url):
        reported = worker["reported"]
        assert reported["waiting"] >= 0 and reported["running"] >= 0
        assert 0.0 <= reported["kv_usage"] <= 1.0 and reported["age_s"] < 5


def test_shared_prefixes_go_where_vllm_holds_them_and_predictions_match(fleet) -> None:
    gateway, _, _ = fleet
    url = gateway.url
    prefixes = [f"Team {g}. " + filler(600, f"prefix-{g}") for g in range(4)]
    first = {}
    for g, prefix in enumerate(prefixes):
        first[g] = route(post(url, "/v1/chat/completions", chat(prefix, f"first {g}?")))["worker"]
        settle(url)
    assert len(set(first.values())) == 2, first  # new prefixes spread over both engines
    errors, hits = [], 0
    for g, prefix in enumerate(prefixes):
        for i in range(2):
            response = post(url, "/v1/chat/completions", chat(prefix, f"question {i} of {g}?"))
            r, usage = route(response), response.json()["usage"]
            assert r["worker"] == first[g], (g, r)
            hits += int(r["matched_tokens"]) >= 5 * BLOCK
            errors.append(abs(int(r["matched_tokens"]) - cached_tokens(response)))
            errors[-1] /= usage["prompt_tokens"]
            settle(url)
    assert hits == 8, hits
    assert max(errors) <= 0.02, errors
    # another tenant's salt: nothing of acme's is predicted, and vLLM finds nothing either
    other = post(url, "/v1/chat/completions", chat(prefixes[0], "question 0 of 0?"), "beta")
    assert route(other)["matched_tokens"] == "0" and cached_tokens(other) == 0


def test_the_mirror_follows_vllm_evictions(fleet) -> None:
    gateway, _, _ = fleet
    url = gateway.url
    prompts = [f"Doc {i}: " + filler(800, f"evict-{i}") for i in range(24)]  # ~8 blocks each
    for prompt in prompts:  # ~190 blocks through 2 x 64
        post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    settle(url)
    removed = sum(s["mirror"]["blocks_removed"] for w in admin_workers(url) for s in w["kv_events"])
    assert removed > 0  # vLLM evicted, and said so
    for prompt in prompts[:6] + prompts[-3:]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        response = post(url, "/v1/completions", body)
        predicted = int(route(response)["matched_tokens"])
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        assert abs(predicted - cached_tokens(response)) <= 0.02 * prompt_tokens, (
            predicted,
            cached_tokens(response),
        )
        settle(url)


def test_a_wholly_cached_prompt_is_predicted_as_vllm_counts_it(fleet) -> None:
    gateway, _, _ = fleet
    ids = [(7 * i) % 400 + 10 for i in range(8 * BLOCK)]  # token ids: exactly 8 blocks
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2}
    post(gateway.url, "/v1/completions", body)
    settle(gateway.url)
    again = post(gateway.url, "/v1/completions", body)
    # vLLM recomputes the last prompt token, so the last full block is not reused
    assert int(route(again)["matched_tokens"]) == cached_tokens(again) == 7 * BLOCK


def test_a_different_tokenizer_on_the_gateway_is_caught(fleet) -> None:
    gateway, engines, root = fleet
    other = root / "other-tokenizer"
    other.mkdir()
    write_tokenizer(other, vocab_size=512, variant="reversed")
    probe_gateway = start_gateway(
        [],
        *attach_args(engines),
        "--model-tokenizer",
        f"{MODEL}={other}",
        "--admin-key",
        "admin",
    )
    try:

        def parity() -> list[float]:
            text = httpx.get(f"{probe_gateway.url}/metrics", timeout=10).text
            return [float(v) for v in re.findall(r"^urc_tokenizer_parity\{.*\} (\S+)$", text, re.M)]

        assert wait_for(lambda: parity() == [0.0, 0.0], 120)
        modes = [w["mode"] for w in admin_workers(probe_gateway.url)]
        assert modes == ["approximate", "approximate"]
        assert any("tokenizer parity" in line for line in probe_gateway.lines)
    finally:
        probe_gateway.stop()


def test_a_killed_engine_is_failed_over_purged_and_readmitted(fleet) -> None:
    gateway, engines, root = fleet
    url = gateway.url
    victim = engines[0].endpoints.url.removeprefix("http://")
    engines[0].kill()
    bodies = [chat(f"After the crash {i}. " + filler(300, f"crash-{i}"), "go") for i in range(6)]
    with cf.ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda b: post(url, "/v1/chat/completions", b), bodies))
    assert all(route(r)["worker"] != victim for r in responses)
    assert wait_for(
        lambda: [w["up"] for w in admin_workers(url) if w["name"] == victim] == [False], 30
    )
    down = next(w for w in admin_workers(url) if w["name"] == victim)
    assert down["cached_blocks"] == 0
    plan = httpx.post(
        f"{url}/admin/route", params={"tenant": "acme"}, json=bodies[0], headers=ADMIN, timeout=10
    ).json()
    assert [c["worker"] for c in plan["candidates"]] == [engines[1].endpoints.url[7:]], plan
    # the same engine again on the same ports: a new incarnation, mirrored from scratch
    engines[0] = start_engine(engines[0].launch, root / "vllm0-restarted.log")
    engines[0].wait_ready(600)
    assert wait_for(lambda: all(w["up"] and w["mode"] == "exact" for w in admin_workers(url)), 60)
    served = set()
    for i in range(6):
        body = chat(f"Restarted {i}. " + filler(300, f"restart-{i}"), "go")
        post(url, "/v1/chat/completions", body)
        settle(url)
        again = post(url, "/v1/chat/completions", body)
        assert int(route(again)["matched_tokens"]) == cached_tokens(again) > 0
        served.add(route(again)["worker"])
    assert victim in served
