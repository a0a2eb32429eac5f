"""The gateway end to end: real worker and gateway processes on 127.0.0.1, real HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import http.server
import json
import threading

import httpx
import openai
import pytest

from tests.gateway import ADMIN, admin_workers, all_exact, best_match, route
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker


@pytest.fixture(scope="module")
def two_workers():
    workers = [start_worker() for _ in range(2)]
    gateway = start_gateway([w.url for w in workers], "--admin-key", "admin-secret")
    try:
        assert wait_for(lambda: all_exact(gateway.url, 2), 20)
        model = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"][0]["id"]
        yield gateway.url, model
    finally:
        gateway.stop()
        for w in workers:
            w.stop()


def test_openai_client_works_unchanged(two_workers):
    url, model = two_workers
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=8
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    text = client.completions.create(model=model, prompt="once upon a time", max_tokens=5)
    assert text.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "stream me"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6
    pieces = list(client.completions.create(model=model, prompt="abc", max_tokens=4, stream=True))
    assert sum(len(p.choices[0].text) for p in pieces if p.choices) > 0
    assert [m.id for m in client.models.list().data] == [model]


def test_shared_prefixes_land_where_they_are_cached(start_fleet):
    gateway, _ = start_fleet(4)
    url = gateway.url
    model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    prefixes = [f"group {g:02d} " + "system prompt text " * 106 for g in range(20)]
    prefixes = [p[:2000] for p in prefixes]
    client = httpx.Client(timeout=30)

    def send(prompt: str) -> httpx.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 4}
        response = client.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response

    for g, prefix in enumerate(prefixes):  # the first of each group warms one worker
        send(prefix + f" first question of group {g}?")
        probe = {"model": model, "prompt": prefix + " probe"}
        # the worker's KV events reach the index within moments
        assert wait_for(lambda probe=probe: best_match(url, probe) >= 1984, 5)
    followups = [
        (g, p + f" question {i} of group {g}?") for i in range(5) for g, p in enumerate(prefixes)
    ]
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda gp: send(gp[1]), followups))
    hits, errors, per_worker = 0, [], {}
    for response in responses:
        r = route(response)
        usage = response.json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        hits += int(r["matched_tokens"]) >= 1984
        errors.append(abs(int(r["matched_tokens"]) - cached) / usage["prompt_tokens"])
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
    assert hits >= 0.95 * len(followups), (hits, per_worker)
    assert max(errors) <= 0.02, max(errors)
    assert len(per_worker) >= 3, per_worker  # the groups spread over the fleet


def test_a_new_prefix_is_pending_on_its_worker_before_its_events_arrive():
    """Two concurrent requests over one new 2,000-token prefix: the second, sent while the
    first is still prefilling (so no KV event has told the gateway anything), goes where the
    first went and finds the prefix there, as the gateway predicted."""
    workers = [start_worker("--prefill-tokens-per-s", "400") for _ in range(2)]  # ~5 s of prefill
    gateway = start_gateway(
        [w.url for w in workers], "--admin-key", "admin-secret", "--pending-ttl", "10"
    )
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 2), 20)
        prefix = ("a new document nobody has read yet " * 60)[:2000]
        bodies = [
            {"model": "emulated", "prompt": prefix + f" question {i}?", "max_tokens": 2}
            for i in range(2)
        ]
        with cf.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/completions", json=bodies[0], timeout=30)
            # the first is routed (its prefix pending at once) long before its prefill ends
            assert wait_for(lambda: best_match(url, bodies[1]) >= 1984, 5)
            assert not first.done()
            second = httpx.post(f"{url}/v1/completions", json=bodies[1], timeout=30)
            first_response = first.result()
        assert first_response.status_code == second.status_code == 200, second.text
        assert route(second)["worker"] == route(first_response)["worker"]
        # what the second actually reuses depends on how much of the first's prefill is done
        # when it is scheduled (only computed blocks are shared), not on the routing
        assert int(route(second)["matched_tokens"]) >= 1984
    finally:
        gateway.stop()
        for w in workers:
            w.stop()


def test_tenants_do_not_share_cache():
    worker = start_worker()
    gateway = start_gateway([worker.url], "--api-key", "acme:key-a", "--api-key", "beta:key-b")
    try:
        url = gateway.url
        model = httpx.get(
            f"{url}/v1/models", headers={"Authorization": "Bearer key-a"}, timeout=5
        ).json()["data"][0]["id"]
        body = {"model": model, "prompt": "a confidential document " * 40, "max_tokens": 2}

        def cached(key: str) -> int:
            r = httpx.post(
                f"{url}/v1/completions",
                json=body,
                timeout=30,
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        cached("key-a")
        assert cached("key-a") > 0
        assert cached("key-b") == 0  # the same prompt from another tenant finds nothing
        # a client cannot pick another tenant's salt either
        spoof = {**body, "cache_salt": "anything"}
        r = httpx.post(
            f"{url}/v1/completions",
            json=spoof,
            timeout=30,
            headers={"Authorization": "Bearer key-b"},
        )
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # b's own cache
    finally:
        gateway.stop()
        worker.stop()


def test_bad_input_gets_clear_errors_and_the_gateway_keeps_serving(two_workers):
    url, model = two_workers
    post = lambda path, **kw: httpx.post(f"{url}{path}", timeout=30, **kw)  # noqa: E731
    cases = [
        (post("/v1/completions", content=b"{not json"), 400),
        (post("/v1/completions", content=b""), 400),
        (post("/v1/completions", json=[1, 2]), 400),
        (post("/v1/completions", json={"model": model, "prompt": 5}), 400),
        (post("/v1/completions", json={"model": model, "prompt": "x", "stream": "yes"}), 400),
        (post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}), 400),
        (post("/v1/completions", json={"prompt": "x"}), 400),
        (post("/v1/chat/completions", json={"model": model}), 400),
        (post("/v1/chat/completions", json={"model": model, "messages": [{"content": 1}]}), 400),
        (post("/v1/completions", json={"model": "no-such-model", "prompt": "x"}), 404),
        (post("/v1/completions", content=b"x" * (17 * 2**20)), 413),
        (post("/admin/workers", json={}), 401),
        (post("/v1/nothing-here", json={}), 404),
        (httpx.get(f"{url}/v1/completions", timeout=5), 405),
    ]
    for response, status in cases:
        assert response.status_code == status, (response.status_code, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"]
    ok = post("/v1/completions", json={"model": model, "prompt": "still alive", "max_tokens": 2})
    assert ok.status_code == 200 and httpx.get(f"{url}/health").status_code == 200


def test_auth_errors():
    worker = start_worker()
    gateway = start_gateway([worker.url], "--api-key", "acme:key-a")
    try:
        body = {"model": "m", "prompt": "x"}
        missing = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
        wrong = httpx.post(
            f"{gateway.url}/v1/completions",
            json=body,
            timeout=10,
            headers={"Authorization": "Bearer nope"},
        )
        for response in (missing, wrong):
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
    finally:
        gateway.stop()
        worker.stop()


def test_metrics_and_dry_run(two_workers):
    url, model = two_workers
    body = {"model": model, "messages": [{"role": "user", "content": "explain " * 30}]}
    plan = httpx.post(f"{url}/admin/route", json=body, headers=ADMIN, timeout=5).json()
    assert plan["worker"] and len(plan["candidates"]) == 2 and plan["prompt_tokens"] > 0
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for name in (
        "urc_requests_total",
        "urc_ttft_seconds",
        "urc_decision_seconds",
        "urc_predicted_cached_tokens_total",
        "urc_actual_cached_tokens_total",
        "urc_index_blocks",
        "urc_worker_healthy",
        "urc_kv_event_gaps",
        "urc_gc_pause_seconds",
        "urc_event_loop_lag_seconds",
    ):
        assert name in text, name


def test_workers_without_events_get_approximate_residency(tmp_path):
    """An engine that cannot be asked and publishes nothing: routing history stands in."""
    workers = [start_worker() for _ in range(2)]
    config = tmp_path / "gateway.toml"
    config.write_text(
        "\n".join(
            f'[[workers]]\nurl = "{w.url}"\nmodels = ["emulated"]\nblock_size = 16\n'
            for w in workers
        )
    )
    gateway = start_gateway([], "--config", str(config), "--admin-key", "admin-secret")
    try:
        url = gateway.url
        assert wait_for(
            lambda: sum(w["up"] and w["mode"] == "approximate" for w in admin_workers(url)) == 2,
            10,
        )
        prompt = "an approximately remembered prefix " * 30
        first = httpx.post(
            f"{url}/v1/completions",
            timeout=30,
            json={"model": "emulated", "prompt": prompt, "max_tokens": 2},
        )
        second = httpx.post(
            f"{url}/v1/completions",
            timeout=30,
            json={"model": "emulated", "prompt": prompt + " again", "max_tokens": 2},
        )
        assert route(second)["worker"] == route(first)["worker"]
        predicted = int(route(second)["matched_tokens"])
        actual = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert predicted > 0 and abs(predicted - actual) <= 16
    finally:
        gateway.stop()
        for w in workers:
            w.stop()


class _GarbageWorker(http.server.BaseHTTPRequestHandler):
    """A worker that answers its probes and then garbage: a fault to inject, not a stand-in."""

    def do_GET(self) -> None:  # noqa: N802
        info = {"models": [{"name": "garbage-model"}], "block_size": 16}
        self._send(json.dumps(info).encode() if self.path == "/urc/info" else b"ok")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(b"\x00\xffnot json at all")

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_worker_answering_garbage_is_a_502_not_a_crash():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GarbageWorker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gateway = start_gateway([f"http://127.0.0.1:{server.server_address[1]}"])
    try:
        for stream in (False, True):
            body = {"model": "garbage-model", "prompt": "hello", "stream": stream}
            r = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
            assert r.status_code in (502, 503), r.text
            assert r.json()["error"]["message"]
        assert httpx.get(f"{gateway.url}/health", timeout=5).status_code in (200, 503)
    finally:
        gateway.stop()
        server.shutdown()


def test_record_writes_a_replayable_trace(tmp_path):
    worker = start_worker()
    trace = tmp_path / "live.jsonl"
    gateway = start_gateway([worker.url], "--record", str(trace), "--api-key", "acme:k")
    try:
        headers = {"Authorization": "Bearer k"}
        for i in range(3):
            body = {
                "model": "emulated",
                "prompt": "shared prefix " * 20 + str(i),
                "max_tokens": 5,
                "stream": i == 2,
            }
            r = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200
    finally:
        gateway.stop()
        worker.stop()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert line["input_length"] // line["block_size"] == len(line["hash_ids"])
        assert line["output_length"] == 5 and line["tenant"] == "acme" and line["worker"]
        assert line["cached_tokens"] is not None and line["timestamp"] >= 0
    assert lines[1]["hash_ids"][:10] == lines[0]["hash_ids"][:10]
