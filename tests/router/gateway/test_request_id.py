"""x-request-id (docs/operability.md): the client's, when valid, else one the gateway makes;
forwarded to the worker (whose own log names it and whose answer echoes it) and returned on
every answer of the gateway, from either of its servers, errors included."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway import all_exact
from tests.logs import text_lines
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker


@pytest.fixture(scope="module")
def fleet():
    worker = start_worker("--log-level", "debug")  # a line per generation, with its request id
    gateway = start_gateway([worker.url], "--admin-key", "admin-secret")
    try:
        assert wait_for(lambda: all_exact(gateway.url, 1), 20)
        model = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"][0]["id"]
        yield gateway, worker, model
    finally:
        gateway.stop()
        worker.stop()


def _worker_saw(worker, request_id: str) -> bool:
    lines = text_lines(worker, "backends.http.openai_api")
    return any(line.get("request_id") == request_id for line in lines)


def test_the_clients_id_goes_through_the_worker_and_back(fleet):
    gateway, worker, model = fleet
    body = {"model": model, "prompt": "round trip", "max_tokens": 2}
    sent = {"x-request-id": "client-id-42"}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=sent, timeout=30)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-id-42"
    assert response.headers.get_list("x-request-id") == ["client-id-42"]  # once, not echoed twice
    assert wait_for(lambda: _worker_saw(worker, "client-id-42"), 10), worker.lines[-5:]
    streamed = {**body, "stream": True}
    sent = {"x-request-id": "client-stream-7"}
    url = f"{gateway.url}/v1/completions"
    with httpx.stream("POST", url, json=streamed, headers=sent, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "client-stream-7"
        response.read()
    assert wait_for(lambda: _worker_saw(worker, "client-stream-7"), 10)


def test_an_id_is_made_when_none_or_a_bad_one_is_sent(fleet):
    gateway, worker, model = fleet
    body = {"model": model, "prompt": "no id", "max_tokens": 2}
    url = f"{gateway.url}/v1/completions"
    made = [httpx.post(url, json=body, timeout=30).headers["x-request-id"] for _ in range(2)]
    assert made[0] and made[1] and made[0] != made[1]
    assert wait_for(lambda: _worker_saw(worker, made[1]), 10)  # the worker got the made one
    for bad in ("x" * 129, "tab\there", ""):
        response = httpx.post(url, json=body, headers={"x-request-id": bad}, timeout=30)
        assert response.status_code == 200
        assert response.headers["x-request-id"] not in (bad, "")
        assert len(response.headers["x-request-id"]) <= 128
    longest = "y" * 128
    response = httpx.post(url, json=body, headers={"x-request-id": longest}, timeout=30)
    assert response.headers["x-request-id"] == longest


def test_errors_and_the_aiohttp_side_answer_with_the_id(fleet):
    gateway, _, model = fleet
    url = f"{gateway.url}/v1/completions"
    sent = {"x-request-id": "bad-body-1", "content-type": "application/json"}
    response = httpx.post(url, content=b"[1, 2", headers=sent, timeout=10)
    assert response.status_code == 400 and response.headers["x-request-id"] == "bad-body-1"
    unknown = {"model": "nope", "prompt": "x"}
    response = httpx.post(url, json=unknown, headers={"x-request-id": "nope-1"}, timeout=10)
    assert response.status_code == 404 and response.headers["x-request-id"] == "nope-1"
    # a connection that began with another endpoint stays aiohttp's (server.py): its inference
    # requests are served there, and answer with the id too
    with httpx.Client(timeout=30) as client:
        models = client.get(f"{gateway.url}/v1/models", headers={"x-request-id": "models-1"})
        assert models.headers["x-request-id"] == "models-1"
        body = {"model": model, "prompt": "via aiohttp", "max_tokens": 2}
        for stream in (False, True):
            sent = {"x-request-id": f"aiohttp-{stream}"}
            response = client.post(url, json={**body, "stream": stream}, headers=sent)
            assert response.status_code == 200
            assert response.headers.get_list("x-request-id") == [f"aiohttp-{stream}"]
        error = client.post(url, json=unknown, headers={"x-request-id": "aiohttp-404"})
        assert error.status_code == 404 and error.headers["x-request-id"] == "aiohttp-404"
    health = httpx.get(f"{gateway.url}/health", timeout=5)
    assert health.headers["x-request-id"]


def test_the_worker_echoes_the_id(fleet):
    _, worker, model = fleet
    body = {"model": model, "prompt": "straight to the worker", "max_tokens": 2}
    url = f"{worker.url}/v1/completions"
    response = httpx.post(url, json=body, headers={"x-request-id": "direct-1"}, timeout=30)
    assert response.headers["x-request-id"] == "direct-1"
    made = httpx.post(url, json=body, timeout=30).headers["x-request-id"]
    assert made and made != "direct-1"
    error = httpx.post(url, json={"model": model}, headers={"x-request-id": "direct-2"}, timeout=5)
    assert error.status_code == 400 and error.headers["x-request-id"] == "direct-2"
