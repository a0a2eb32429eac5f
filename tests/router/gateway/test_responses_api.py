"""`/v1/responses` end to end: emulated workers and a gateway as real processes on 127.0.0.1, the
official `openai` client; a Responses request reuses the prefix a chat request left, on the
same worker, as the gateway predicted; streamed usage reaches the gateway; bad input is a 400
naming the field; unknown `/v1/*` paths stay a 404."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway import all_exact, assert_400s, best_match, gateway_fleet, route
from tests.gateway import openai_client as client
from tests.processes import wait_for
from urc.processes import Child, start_gateway

pytestmark = pytest.mark.timeout(120)

SYSTEM = ("You are the assistant of a library that answers questions about its catalogue. " * 30)[
    :2000
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, list[Child]]]:
    with gateway_fleet(2, "--admin-key", "admin-secret") as running:
        yield running


def test_a_responses_request_reuses_the_prefix_a_chat_request_left(fleet) -> None:
    url, _ = fleet
    chat_body = {
        "model": "emulated",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Which books about rivers do you hold?"},
        ],
        "max_tokens": 4,
    }
    chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body, timeout=30)
    assert chat.status_code == 200, chat.text
    turn = "And which about mountains?"
    same_as_chat = {
        **chat_body,
        "messages": [chat_body["messages"][0], {"role": "user", "content": turn}],
    }
    # the worker's KV events reach the index within moments
    assert wait_for(lambda: best_match(url, same_as_chat) >= 1984, 5)
    body = {
        "model": "emulated",
        "instructions": SYSTEM,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": turn}]}],
        "max_output_tokens": 4,
    }
    answer = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert doc["object"] == "response"
    assert doc["output"][0]["type"] == "message" and doc["output"][0]["role"] == "assistant"
    assert doc["output"][0]["content"][0]["type"] == "output_text"
    cached = doc["usage"]["input_tokens_details"]["cached_tokens"]
    r = route(answer)
    assert cached >= 1984 and r["worker"] == route(chat)["worker"], (cached, r)
    assert int(r["matched_tokens"]) == cached  # the gateway predicted what the worker reused
    # the same messages as a chat: the same prompt tokens, so the same block keys
    twin = httpx.post(f"{url}/v1/chat/completions", json=same_as_chat, timeout=30).json()
    assert doc["usage"]["input_tokens"] == twin["usage"]["prompt_tokens"] == int(r["prompt_tokens"])


def test_the_openai_client_streamed_and_not(fleet) -> None:
    url, _ = fleet
    c = client(url)
    whole = c.responses.create(
        model="emulated", instructions="Be brief.", input="Name a river.", max_output_tokens=8
    )
    assert whole.object == "response" and whole.output_text
    assert whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    events = list(
        c.responses.create(
            model="emulated", input="Name a mountain.", max_output_tokens=6, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text
    assert final.usage.output_tokens == 6 and final.status == "incomplete"
    assert final.usage.input_tokens_details.cached_tokens >= 0
    with c.responses.stream(model="emulated", input="Name a lake.", max_output_tokens=5) as s:
        done = s.get_final_response()
    assert done.output_text and done.usage.output_tokens == 5


def test_streamed_usage_reaches_the_gateway(fleet, tmp_path: Path) -> None:
    """The gateway reads usage from the Responses stream's last event: its recording says so."""
    _, workers = fleet
    trace = tmp_path / "trace.jsonl"
    admin = ("--admin-key", "admin-secret")
    gateway = start_gateway([w.url for w in workers], "--record", str(trace), *admin)
    try:
        assert wait_for(lambda: all_exact(gateway.url, 2), 20)
        c = client(gateway.url)
        prompt = "Tell me about the catalogue. " + SYSTEM
        as_chat = {"model": "emulated", "messages": [{"role": "user", "content": prompt}]}
        for stream in (False, True):
            out = c.responses.create(
                model="emulated", input=prompt, max_output_tokens=7, stream=stream
            )
            if stream:
                assert list(out)[-1].response.usage.output_tokens == 7
            else:  # the next finds this one's prompt once its KV events are in
                assert wait_for(lambda: best_match(gateway.url, as_chat) >= 1984, 5)
    finally:
        gateway.stop()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["output_length"] for line in lines] == [7, 7]
    assert lines[1]["cached_tokens"] >= 1984  # the second found the first's prompt
    assert all(line["input_length"] > 2000 for line in lines)


BAD = [
    ({"input": "hi"}, "model"),
    ({"model": "emulated"}, "input"),
    ({"model": "emulated", "input": 5}, "input"),
    ({"model": "emulated", "input": ""}, "input"),
    ({"model": "emulated", "input": []}, "input"),
    ({"model": "emulated", "input": ["hi"]}, "input[0]"),
    ({"model": "emulated", "input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"model": "emulated", "input": [{"role": "user", "content": 3}]}, "input[0].content"),
    (
        {"model": "emulated", "input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].type",
    ),
    (
        {
            "model": "emulated",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
        },
        "input[0].content[0].type",
    ),
    (
        {"model": "emulated", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "input[0].content[0].text",
    ),
    ({"model": "emulated", "input": "hi", "instructions": 3}, "instructions"),
    ({"model": "emulated", "input": "hi", "stream": "yes"}, "stream"),
    ({"model": "emulated", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    (
        {"model": "emulated", "input": "hi", "previous_response_id": "resp_1"},
        "previous_response_id",
    ),
]


@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_bad_input_is_a_400_naming_the_field(fleet, target: str) -> None:
    url, workers = fleet
    base = url if target == "gateway" else workers[0].url
    assert_400s(base, "/v1/responses", BAD, target == "worker")
    not_json = httpx.post(f"{base}/v1/responses", content=b"{", timeout=10)
    assert not_json.status_code == 400 and "error" in not_json.json()
    unknown = {"model": "nope", "input": "hi"}
    answer = httpx.post(f"{base}/v1/responses", json=unknown, timeout=10)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_other_v1_paths_stay_a_404(fleet) -> None:
    url, _ = fleet
    for method in ("GET", "POST"):
        answer = httpx.request(method, f"{url}/v1/foo", json={"model": "emulated"}, timeout=10)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{url}/v1/responses", timeout=10)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
