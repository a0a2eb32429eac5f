"""sglang-router's and vllm-router's flags and worker endpoints on a real gateway
(docs/migration.md): --worker-urls, --policy, --cache-threshold, --prometheus-port,
--max-concurrent-requests (a 429 past it, counted), a bare --api-key, /add_worker, /list_workers,
/remove_worker."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import httpx

from core.ports import free_port
from tests.gateway import ADMIN, all_exact
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

LIMIT = 2


def body(i: int, stream: bool = False, max_tokens: int = 4) -> dict:
    prompt = f"migration {i} " * 30
    return {"model": "emulated", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


def rejected(metrics_url: str) -> float:
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith('urc_rejected_requests_total{reason="max_concurrent_requests"}'):
            return float(line.split()[-1])
    raise AssertionError("no urc_rejected_requests_total")


@contextlib.contextmanager
def fleet(*workers: Child, extra: tuple[str, ...]) -> Iterator[Child]:
    gateway = start_gateway([], "--worker-urls", *(w.url for w in workers), *extra)
    try:
        yield gateway
    finally:
        gateway.stop()


def test_their_flags_serve_and_limit_requests_in_flight() -> None:
    # slow decode steps: a stream stays in flight for seconds after its first chunk
    workers = [start_worker("--decode-base-ms", "200") for _ in range(2)]
    port = free_port()
    flags = ("--policy", "cache_aware", "--cache-threshold", "0.3", "--prometheus-port", str(port))
    flags += ("--max-concurrent-requests", str(LIMIT), "--admin-key", "admin-secret")
    try:
        with fleet(*workers, extra=flags) as gateway, httpx.Client(timeout=30) as client:
            url, metrics = gateway.url, f"http://127.0.0.1:{port}/metrics"
            assert wait_for(lambda: all_exact(url, 2), 20), gateway.lines[-20:]
            assert any("--cache-threshold ignored" in line for line in gateway.lines)
            for i in range(4):
                r = client.post(f"{url}/v1/completions", json=body(i))
                assert r.status_code == 200, r.text
            assert rejected(metrics) == 0
            with contextlib.ExitStack() as streams:
                lines = []  # held: a dropped iterator closes its connection
                for i in range(LIMIT):  # in flight once their first chunk is here
                    r = streams.enter_context(
                        client.stream("POST", f"{url}/v1/completions", json=body(i, True, 50))
                    )
                    assert r.status_code == 200
                    lines.append(r.iter_lines())
                    next(lines[-1])
                busy = client.post(f"{url}/v1/completions", json=body(9))
                assert busy.status_code == 429, busy.text
                assert busy.json()["error"]["code"] == "rate_limit_exceeded"
                assert busy.headers["retry-after"] == "1"
                assert rejected(metrics) == 1
            # the streams closed: their requests end, and there is room again
            assert wait_for(
                lambda: client.post(f"{url}/v1/completions", json=body(10)).status_code == 200
            )
    finally:
        for w in workers:
            w.stop()


def test_add_list_and_remove_worker_by_url() -> None:
    workers = [start_worker() for _ in range(3)]
    try:
        with fleet(*workers[:2], extra=("--admin-key", "admin-secret")) as gateway:
            url, third = gateway.url, workers[2].url
            listed = httpx.get(f"{url}/list_workers", headers=ADMIN, timeout=5)
            assert sorted(listed.json()["urls"]) == sorted(w.url for w in workers[:2])
            assert httpx.post(f"{url}/add_worker", params={"url": third}).status_code == 401
            added = httpx.post(f"{url}/add_worker", params={"url": third}, headers=ADMIN)
            assert added.status_code == 200, added.text
            assert added.json()["message"] == f"Successfully added worker: {third}"
            again = httpx.post(f"{url}/add_worker", params={"url": third + "/"}, headers=ADMIN)
            assert again.status_code == 409 and again.json()["error"]["code"] == "worker_exists"
            bad = httpx.post(f"{url}/add_worker", params={"url": "w:1"}, headers=ADMIN)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
            listed = httpx.get(f"{url}/list_workers", headers=ADMIN, timeout=5).json()["urls"]
            assert third in listed and len(listed) == 3
            assert wait_for(lambda: all_exact(url, 3), 20)  # discovered like any of ours
            removed = httpx.post(f"{url}/remove_worker", params={"url": third}, headers=ADMIN)
            assert removed.status_code == 200, removed.text
            listed = httpx.get(f"{url}/list_workers", headers=ADMIN, timeout=5).json()["urls"]
            assert third not in listed and len(listed) == 2
            gone = httpx.post(f"{url}/remove_worker", params={"url": third}, headers=ADMIN)
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "worker_not_found"
            served = httpx.post(f"{url}/v1/completions", json=body(0), timeout=30)
            assert served.status_code == 200
    finally:
        for w in workers:
            w.stop()


def test_their_launch_line_with_a_bare_api_key_works_unchanged() -> None:
    workers = [start_worker() for _ in range(2)]
    port = free_port()
    line = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *(w.url for w in workers)]
    line += ["--policy", "cache_aware", "--api-key", "sk-123"]
    gateway = Child("urc gateway", [sys.executable, "-m", "urc.cli", "gateway", *line], "gateway: ")
    try:
        url = gateway.wait_announced().url
        assert url == f"http://127.0.0.1:{port}"
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 20)
        key = {"Authorization": "Bearer sk-123"}
        for i in range(3):
            served = httpx.post(f"{url}/v1/completions", json=body(i), headers=key, timeout=30)
            assert served.status_code == 200, served.text
            assert served.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{url}/v1/models", headers=key, timeout=5).status_code == 200
        missing = httpx.post(f"{url}/v1/completions", json=body(0), timeout=30)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        wrong = {"Authorization": "Bearer sk-124"}
        other = httpx.post(f"{url}/v1/completions", json=body(0), headers=wrong, timeout=30)
        assert other.status_code == 401 and other.json()["error"]["code"] == "invalid_api_key"
        # their worker endpoints are urc's admin API: off without --admin-key (docs/migration.md)
        listed = httpx.get(f"{url}/list_workers", headers=key, timeout=5)
        assert listed.status_code == 403 and listed.json()["error"]["code"] == "admin_disabled"
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
