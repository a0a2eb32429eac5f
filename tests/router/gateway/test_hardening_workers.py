"""Workers that hang, come back, or lose their client, on real processes: a hung worker's
requests fail over within the time to first byte and its load counters come back to 0; a
restarted worker is routed to as soon as it is up; a client that leaves a non-streamed request
stops the worker's generation."""

from __future__ import annotations

import concurrent.futures as cf
import re
import signal
import socket
import threading
import time

import httpx

from tests.gateway import ADMIN, admin_workers, all_exact
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

FAST = ("--decode-base-ms", "2")


def loads(gateway: str) -> dict[str, dict[str, int]]:
    return {w["name"]: w["load"] for w in admin_workers(gateway)}


def closed_loop(url: str, stop: threading.Event, i: int, stream: bool) -> list[tuple[int, float]]:
    """Requests one after another until `stop`: (status, seconds to the first byte) of each
    (a non-streamed answer's first byte is its last)."""
    out: list[tuple[int, float]] = []
    with httpx.Client(timeout=60) as client:
        for n in range(2000):
            if stop.is_set():
                break
            body = {
                "model": "emulated",
                "prompt": f"client {i} asks question {n} " * 8,
                "max_tokens": 8,
                "stream": stream,
            }
            t0 = time.monotonic()
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                first = 0.0
                for _ in r.iter_raw():
                    first = first or time.monotonic() - t0
            out.append((r.status_code, first))
    return out


def test_a_hung_worker_fails_over_within_the_time_to_first_byte_and_load_returns_to_zero():
    workers = [start_worker(*FAST) for _ in range(3)]
    ttfb = 2.0
    flags = ("--admin-key", "admin-secret", "--ttfb-timeout", str(ttfb), "--policy", "round_robin")
    gateway = start_gateway([w.url for w in workers], *flags)
    victim = workers[0]
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 3), 20)
        stop = threading.Event()
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(closed_loop, url, stop, i, i % 2 == 0) for i in range(8)]
            time.sleep(1.0)
            victim.popen.send_signal(signal.SIGSTOP)
            time.sleep(6.0)
            stop.set()
            # a stream whose first byte had reached its client stays with the worker
            victim.popen.send_signal(signal.SIGCONT)
            results = [r for f in futures for r in f.result()]
        statuses = {s for s, _ in results}
        slowest = max(t for _, t in results)
        assert statuses == {200}, statuses
        # the time to first byte, the deadline sweep (0.25 s) and one more try elsewhere, on a
        # busy machine
        assert slowest < ttfb + 3.0, slowest  # well before the 6 s the worker is stopped
        assert wait_for(lambda: all(w["up"] for w in admin_workers(url)), 10)
        # every counter went through its requests' own lifecycle: none is left or negative
        assert wait_for(lambda: all(v == 0 for lo in loads(url).values() for v in lo.values()))
    finally:
        victim.popen.send_signal(signal.SIGCONT)
        gateway.stop()
        for w in workers:
            w.stop()


def test_a_restarted_worker_is_routed_to_once_it_is_up():
    workers = [start_worker(*FAST) for _ in range(2)]
    gateway = start_gateway([w.url for w in workers], "--admin-key", "admin-secret")
    victim = workers[0]
    port = int(victim.url.rsplit(":", 1)[1])
    reborn: Child | None = None
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 2), 20)
        stop = threading.Event()
        seen: list[tuple[float, str]] = []  # (when, worker) of every answer

        def load(i: int) -> None:
            with httpx.Client(timeout=60) as client:
                for n in range(3000):
                    if stop.is_set():
                        return
                    body = {"model": "emulated", "prompt": f"new {i} {n} " * 30, "max_tokens": 4}
                    r = client.post(f"{url}/v1/completions", json=body)
                    worker = re.search(r"worker=([^;]+)", r.headers.get("x-urc-route", ""))
                    seen.append((time.monotonic(), worker.group(1) if worker else ""))

        threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        victim.stop(signal.SIGKILL)  # mid-request: its requests fail over, its counters stay right
        name = f"127.0.0.1:{port}"
        assert wait_for(lambda: not {w["name"]: w for w in admin_workers(url)}[name]["up"], 10)
        reborn = start_worker(*FAST, port=port)
        assert wait_for(lambda: all_exact(url, 2), 10)
        up_at = time.monotonic()
        assert wait_for(lambda: any(t > up_at and w == name for t, w in seen), 5)
        stop.set()
        for t in threads:
            t.join(30)
        assert wait_for(lambda: all(v == 0 for lo in loads(url).values() for v in lo.values()))
    finally:
        stop.set()
        gateway.stop()
        for w in (*workers, reborn):
            if w is not None:
                w.stop()


def running_requests(worker: str) -> float:
    text = httpx.get(f"{worker}/metrics", timeout=5).text
    found = re.search(r"^urc_engine_running_requests(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert found, text[:500]
    return float(found.group(1))


def test_a_client_that_leaves_a_non_streamed_request_stops_the_workers_generation():
    worker = start_worker("--decode-base-ms", "10")
    gateway = start_gateway([worker.url], "--admin-key", "admin-secret")
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 1), 20)
        host, port = url.removeprefix("http://").split(":")
        body = b'{"model":"emulated","prompt":"tell me a long story","max_tokens":3000}'
        for _ in range(3):  # ~30 s of generation each, were it to run on
            sock = socket.create_connection((host, int(port)))
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            assert wait_for(lambda: running_requests(worker.url) == 1, 5)
            sock.close()  # the client gives up
            assert wait_for(lambda: running_requests(worker.url) == 0, 3)
        assert all(v == 0 for lo in loads(url).values() for v in lo.values())
        assert httpx.get(f"{url}/admin/workers", headers=ADMIN).json()["workers"][0]["up"]
    finally:
        gateway.stop()
        worker.stop()
