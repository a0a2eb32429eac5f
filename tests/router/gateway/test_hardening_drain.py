"""SIGTERM under load, on real processes: readiness goes false, kept-alive connections are told
`Connection: close`, and every request under way (streams included) finishes within the drain
timeout before the gateway exits."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time

import httpx

SLOW = ("--decode-base-ms", "25")  # 120 tokens: about 3 s


def long_request(url: str, stream: bool) -> tuple[int, str, str | None]:
    """Status, the answer's tail and its `Connection` header."""
    body = {"model": "emulated", "prompt": "a long answer, please", "max_tokens": 120}
    with httpx.Client(timeout=60) as client:
        if not stream:
            r = client.post(f"{url}/v1/completions", json=body)
            tail = str(r.json()["usage"]["completion_tokens"])
            return r.status_code, tail, r.headers.get("connection")
        with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            text = "".join(r.iter_text())
        return r.status_code, text[-40:], r.headers.get("connection")


def test_sigterm_finishes_the_requests_under_way_and_closes_kept_alive_connections(start_fleet):
    # readiness is read on a kept-alive connection: idle ones close once the delay is over
    gateway, _ = start_fleet(2, *SLOW, gateway_args=("--shutdown-delay", "1"))
    url = gateway.url
    kept = httpx.Client(timeout=30)  # one kept-alive connection to each server
    assert kept.get(f"{url}/health").status_code == 200
    quick_statuses: list[int] = []
    stop = threading.Event()

    def quick() -> None:
        """Short requests on one kept-alive connection until the gateway says close (or,
        idle at the drain's start, closes it: the next connect is refused)."""
        body = {"model": "emulated", "prompt": "quick", "max_tokens": 2}
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                try:
                    r = client.post(f"{url}/v1/completions", json=body)
                except httpx.ConnectError:
                    return  # the listener is closed: nothing was accepted
                quick_statuses.append(r.status_code)
                if r.headers.get("connection") == "close":
                    return

    with cf.ThreadPoolExecutor(12) as pool:
        long = [pool.submit(long_request, url, i % 2 == 0) for i in range(10)]
        quicks = [pool.submit(quick) for _ in range(2)]
        time.sleep(1.0)
        gateway.popen.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        health = kept.get(f"{url}/health")
        results = [f.result() for f in long]
        stop.set()
        for f in quicks:
            f.result()
    assert health.status_code == 503 and health.json()["status"] == "draining"
    for i, (status, tail, connection) in enumerate(results):
        assert status == 200, (i, status, tail)
        assert (tail == "120") if i % 2 else ("[DONE]" in tail), (i, tail)
        if i % 2:  # answered whole after the drain began: the client is told, not cut
            assert connection == "close", (i, connection)
    assert quick_statuses and set(quick_statuses) == {200}
    assert gateway.popen.wait(15) == 0
    assert time.monotonic() - sent < 15
