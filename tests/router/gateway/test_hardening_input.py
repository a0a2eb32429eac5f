"""Hostile input on real processes: a poison request neither takes workers down nor hurts other
tenants; bad input is a 4xx, never a 500; internal fields never come from clients, under any
spelling; one Authorization header, read the same way everywhere."""

from __future__ import annotations

import concurrent.futures as cf
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.gateway import admin_workers, all_exact
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker

KEYS = ("--api-key", "acme:key-acme", "--api-key", "beta:key-beta", "--admin-key", "admin-secret")
ACME = {"Authorization": "Bearer key-acme"}
BETA = {"Authorization": "Bearer key-beta"}
ACME_HEADER = "Authorization: Bearer key-acme"


def raw_exchange(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data` on a fresh connection; everything the gateway answers until it closes (or
    the status line and body, for a connection kept alive)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out or not out.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: gateway", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    workers = [start_worker("--decode-base-ms", "1") for _ in range(2)]
    gateway = start_gateway([w.url for w in workers], *KEYS)
    try:
        assert wait_for(lambda: all_exact(gateway.url, 2), 20)
        yield gateway.url
    finally:
        gateway.stop()
        for w in workers:
            w.stop()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# tool calls whose arguments (a JSON string) nest 800 deep
TOOL_CALLS = '[{"function":{"name":"f","arguments":"' + nested(800) + '"}}]'


@pytest.mark.parametrize(
    "body",
    [
        '{"model":"emulated","prompt":"hi","max_tokens":2,"extra":' + nested(980) + "}",
        '{"model":"emulated","prompt":"hi","extra":' + nested(5000) + "}",
        '{"model":"emulated","prompt":[1, 2, 4294967296]}',
        '{"model":"emulated","prompt":[1, 2, -1]}',
        '{"model":"emulated","prompt":"hi","max_tokens":99999999999999999999999}',
        '{"model":"emulated","messages":[{"role":"assistant","content":"x","tool_calls":'
        + TOOL_CALLS
        + "}]}",
        '{"model":"emulated","messages":[{"role":"user","content":' + nested(800) + "}]}",
        '{"model":"emulated","messages":[1, 2]}',
        '{"model":"emulated","prompt":"\\ud800"}',
    ],
)
def test_bad_input_is_a_4xx_and_hurts_no_worker(fleet: str, body: str) -> None:
    r = httpx.post(f"{fleet}/v1/completions", content=body, headers=ACME, timeout=10)
    chat = httpx.post(f"{fleet}/v1/chat/completions", content=body, headers=ACME, timeout=10)
    for answer in (r, chat):
        assert 400 <= answer.status_code < 500, answer.text
        assert answer.json()["error"]["message"]
    assert all(w["up"] for w in admin_workers(fleet))


def test_odd_headers_get_an_answer(fleet: str) -> None:
    body = json.dumps({"model": "emulated", "prompt": "hello", "max_tokens": 2}).encode()
    # what `curl --http2` sends: the upgrade is declined, the request answered over HTTP/1.1
    upgrade = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABk")
    answer = raw_exchange(fleet, post("/v1/completions", body, *upgrade, ACME_HEADER))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    # a non-ASCII admin key is a wrong key, not a crash
    answer = raw_exchange(
        fleet,
        "GET /admin/workers HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer clé\r\n\r\n".encode(
            "latin-1"
        ),
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    # two Authorization headers: refused alike on inference and admin endpoints
    two = (ACME_HEADER, "Authorization: Bearer nobody")
    for request in (post("/v1/completions", body, *two), post("/admin/route", body, *two)):
        answer = raw_exchange(fleet, request)
        assert answer.startswith(b"HTTP/1.1 400") and b"Authorization" in answer, answer[:300]


def test_an_escaped_internal_field_reaches_no_worker(fleet: str) -> None:
    """`urc\\u005fpublic_tokens` is `urc_public_tokens`: a client's never moves its prompt into
    the shared namespace, where another tenant would find it."""
    secret = json.dumps("beta's confidential contract, clause by clause. " * 40)
    escaped = (
        f'{{"model":"emulated","prompt":{secret},"max_tokens":2,"urc\\u005fpublic_tokens":1024}}'
    )
    for _ in range(2):  # parked, then beta finds its own
        r = httpx.post(f"{fleet}/v1/completions", content=escaped, headers=BETA, timeout=10)
        assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000
    r = httpx.post(f"{fleet}/v1/completions", content=escaped, headers=ACME, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


class _PoisonWorker(http.server.BaseHTTPRequestHandler):
    """A worker whose engine crashes on one prompt (500), and serves the rest."""

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, b'{"status":"ok"}')

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "poison" in json.dumps(body):
            self._send(500, b'{"error":{"message":"engine crashed","type":"server_error"}}')
            return
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        self._send(200, json.dumps({"choices": [{"text": "ok"}], "usage": usage}).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@contextmanager
def poison_workers(n: int) -> Iterator[list[str]]:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PoisonWorker) for _ in range(n)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for server in servers:
            server.shutdown()


def test_a_poison_request_repeated_by_one_tenant_takes_no_worker_down() -> None:
    with poison_workers(2) as urls:
        attach = [f for u in urls for f in ("--attach", f"{u},model=m")]
        gateway = start_gateway([], *attach, *KEYS, "--parity-interval", "0")
        try:
            url = gateway.url
            assert wait_for(lambda: sum(w["up"] for w in admin_workers(url)) == 2, 20)
            stop = threading.Event()

            def normal(headers: dict[str, str]) -> list[int]:
                statuses: list[int] = []
                with httpx.Client(timeout=30) as client:
                    for n in range(2000):
                        if stop.is_set():
                            break
                        body = {"model": "m", "prompt": f"normal {n}", "max_tokens": 1}
                        statuses.append(
                            client.post(
                                f"{url}/v1/completions", json=body, headers=headers
                            ).status_code
                        )
                return statuses

            poison = {"model": "m", "prompt": "poison pill", "max_tokens": 1}
            with cf.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(normal, h) for h in (ACME, BETA, BETA)]
                bad = []
                for _ in range(40):  # a pair every 0.1 s: the pair every 2 s, faster
                    for _ in range(2):
                        bad.append(
                            httpx.post(
                                f"{url}/v1/completions", json=poison, headers=ACME, timeout=10
                            ).status_code
                        )
                    time.sleep(0.1)
                    assert all(w["up"] for w in admin_workers(url))
                stop.set()
                others = [s for f in futures for s in f.result()]
            assert set(bad) == {500}, set(bad)  # the engine's own answer, passed on
            assert others and set(others) == {200}, set(others)
            assert all(w["up"] and w["failures"] == 0 for w in admin_workers(url))
        finally:
            gateway.stop()
