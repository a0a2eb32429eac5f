"""A worker killed under load: nothing non-streamed fails, its residency leaves the index, and
a restarted worker comes back with a resynced mirror."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time

import httpx

from tests.gateway import admin_workers
from tests.processes import wait_for
from urc.processes import start_worker


def by_name(gateway: str) -> dict[str, dict]:
    return {w["url"]: w for w in admin_workers(gateway)}


def test_killed_worker_fails_over_and_comes_back(start_fleet):
    gateway, workers = start_fleet(3)
    victim = workers[0]
    url = gateway.url
    model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
    stop = threading.Event()
    client = httpx.Client(timeout=60)

    def load(i: int) -> list[int]:
        statuses = []
        n = 0
        while not stop.is_set() and n < 400:
            prompt = f"conversation {i % 6} " * 60 + f"turn {n}"
            body = {"model": model, "prompt": prompt, "max_tokens": 16}
            statuses.append(client.post(f"{url}/v1/completions", json=body).status_code)
            n += 1
        return statuses

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load, i) for i in range(6)]
        assert wait_for(lambda: by_name(url)[victim.url]["cached_blocks"] > 0, 10)
        time.sleep(0.5)
        victim.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        assert wait_for(
            lambda: (
                not by_name(url)[victim.url]["up"]
                and by_name(url)[victim.url]["cached_blocks"] == 0
            ),
            5,
        )
        left_after = time.monotonic() - killed_at
        time.sleep(0.5)
        stop.set()
        statuses = [s for f in futures for s in f.result()]
    assert left_after <= 2.0, left_after
    assert statuses and all(s == 200 for s in statuses), (
        sorted(set(statuses)),
        gateway.lines[-40:],  # the gateway's log: what failed
    )

    port = int(victim.url.rsplit(":", 1)[1])
    workers[0] = start_worker(port=port)  # the same address, a new incarnation
    victim_name = victim.url.split("//")[1]
    for i in range(40):  # distinct cold prompts until one lands on it (rendezvous spreads them)
        body = {"model": model, "prompt": f"{i:03d} fresh conversation " * 20, "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        if r.headers["x-urc-route"].startswith(f"worker={victim_name};"):
            break
    else:
        raise AssertionError("no request reached the restarted worker")
    assert wait_for(lambda: by_name(url)[victim.url]["cached_blocks"] > 0, 5)
    mirror = by_name(url)[victim.url]["kv_events"][0]["mirror"]
    assert mirror["last_seq"] is not None
