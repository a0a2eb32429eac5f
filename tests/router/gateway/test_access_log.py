"""The access log (docs/operability.md): one line per request on `urc.access`, streamed or not,
failed or not, as text key=value pairs or JSON, read from a real gateway's stderr."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway import all_exact, route
from tests.logs import access_line, json_lines
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

PROMPT = "the access log names every request " * 20


@pytest.fixture(scope="module")
def text_fleet():
    worker = start_worker()
    gateway = start_gateway([worker.url], "--access-log", "--admin-key", "admin-secret")
    try:
        assert wait_for(lambda: all_exact(gateway.url, 1), 20)
        model = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"][0]["id"]
        yield gateway, model
    finally:
        gateway.stop()
        worker.stop()


def _post(gateway: Child, body: dict, request_id: str) -> httpx.Response:
    headers = {"x-request-id": request_id}
    return httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=30)


def test_non_streamed_line_has_the_routing_and_the_workers_answer(text_fleet):
    gateway, model = text_fleet
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4}
    assert _post(gateway, body, "warm-1").status_code == 200
    response = _post(gateway, body, "again-1")  # the prefix is cached by now
    assert response.status_code == 200
    usage = response.json()["usage"]
    plan = route(response)
    line = access_line(gateway, "again-1")
    assert line["tenant"] == "default" and line["model"] == model
    assert line["stream"] == "false" and line["status"] == "200"
    assert line["worker"] == plan["worker"]
    assert line["prompt_tokens"] == plan["prompt_tokens"] == str(usage["prompt_tokens"])
    assert line["matched_tokens"] == plan["matched_tokens"]
    assert line["cached_tokens"] == str(usage["prompt_tokens_details"]["cached_tokens"])
    assert int(line["cached_tokens"]) > 0
    assert line["reason"] == plan["reason"] and line["attempts"] == "1"
    assert 0 < float(line["ttft_ms"]) <= float(line["latency_ms"])
    assert line["error"] == "-"


def test_streamed_line_has_the_time_to_first_token(text_fleet):
    gateway, model = text_fleet
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{gateway.url}/v1/chat/completions"
    headers = {"x-request-id": "stream-1"}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
        plan = route(response)
    usage = httpx.Response(200, content=events[-1][6:]).json()["usage"]
    line = access_line(gateway, "stream-1")
    assert line["stream"] == "true" and line["status"] == "200"
    assert line["worker"] == plan["worker"] and line["reason"] == plan["reason"]
    assert line["prompt_tokens"] == str(usage["prompt_tokens"])
    assert line["cached_tokens"] == str(usage["prompt_tokens_details"]["cached_tokens"])
    assert 0 < float(line["ttft_ms"]) <= float(line["latency_ms"])


def test_failed_requests_are_logged_with_what_is_known(text_fleet):
    gateway, model = text_fleet
    assert _post(gateway, {"model": "no-such-model", "prompt": "x"}, "fail-404").status_code == 404
    line = access_line(gateway, "fail-404")
    assert line["status"] == "404" and line["model"] == "no-such-model"
    assert line["worker"] == "-" and line["reason"] == "-"
    assert "does not exist" in line["error"]
    bad = httpx.post(
        f"{gateway.url}/v1/completions",
        content=b"{not json",
        headers={"x-request-id": "fail-400", "content-type": "application/json"},
        timeout=10,
    )
    assert bad.status_code == 400
    line = access_line(gateway, "fail-400")
    assert line["status"] == "400" and line["model"] == "-" and line["tenant"] == "-"


def test_json_format_lines_parse_and_carry_the_access_fields():
    worker = start_worker("--log-format", "json", "--log-level", "debug")
    gateway = start_gateway(
        [worker.url], "--access-log", "--log-format", "json", "--admin-key", "admin-secret"
    )
    try:
        assert wait_for(lambda: all_exact(gateway.url, 1), 20)
        model = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 3}
        assert _post(gateway, body, "json-1").status_code == 200
        line = access_line(gateway, "json-1", json_format=True)
    finally:
        gateway.stop()
        worker.stop()
    assert line["status"] == 200 and line["stream"] is False
    assert line["level"] == "INFO" and line["msg"] == "POST /v1/completions"
    assert isinstance(line["prompt_tokens"], int) and isinstance(line["latency_ms"], float)
    for child in (gateway, worker):  # every line is JSON but the announcement
        lines = [s for s in child.lines if s and not s.startswith(("gateway: ", "ready: "))]
        assert lines and all(s.startswith("{") for s in lines), lines[:5]
        docs = json_lines(child)
        assert all({"ts", "level", "logger", "msg"} <= d.keys() for d in docs)
        assert all(d["ts"].endswith("Z") for d in docs)
