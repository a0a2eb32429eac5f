"""Operator controls on real processes: the degrade switch under load, degrading by itself
while every KV-event stream is lost, and shadow policies."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx

from core.kv_publisher import KVEventPublisher
from core.ports import free_port
from tests.gateway import ADMIN, all_exact, route
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker


def mode(url: str) -> dict:
    return httpx.get(f"{url}/admin/mode", headers=ADMIN, timeout=5).json()


def test_the_degrade_switch_under_load_loses_nothing_and_acts_within_a_second(start_fleet):
    gateway, _ = start_fleet(2)
    url = gateway.url
    stop = threading.Event()
    seen: list[tuple[float, str, int]] = []  # (sent at, policy, status)
    client = httpx.Client(timeout=30)

    def load(i: int) -> None:
        n = 0
        while not stop.is_set() and n < 500:
            body = {"model": "emulated", "prompt": f"{i} load " * 40 + str(n), "max_tokens": 4}
            sent = time.monotonic()
            r = client.post(f"{url}/v1/completions", json=body)
            policy = route(r)["policy"] if r.status_code == 200 else "-"
            seen.append((sent, policy, r.status_code))
            n += 1

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, i) for i in range(4)]
        time.sleep(0.5)
        flips = []
        for degraded in (True, False):
            r = httpx.post(f"{url}/admin/mode", json={"degraded": degraded}, headers=ADMIN)
            flips.append(time.monotonic())  # switched by the time the call returns
            assert r.json()["active_policy"] == ("least_load" if degraded else "cache_aware")
            time.sleep(1.0)
        stop.set()
        for f in futures:
            f.result()
    assert seen and all(status == 200 for _, _, status in seen)
    degraded_at, restored_at = flips
    # every request sent after a flip returned follows it (so: well within a second)
    assert all(p == "least_load" for t, p, _ in seen if degraded_at < t < restored_at - 0.1)
    assert all(p == "cache_aware" for t, p, _ in seen if t > restored_at)
    assert any(p == "least_load" for _, p, _ in seen)
    text = httpx.get(f"{url}/metrics").text
    assert "urc_routing_degraded 0.0" in text


def test_it_degrades_while_every_event_stream_is_lost(tmp_path):
    worker = start_worker()
    port, replay = free_port(), free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[[workers]]\nurl = "{worker.url}"\nmodels = ["emulated"]\n'
        f'kv_events = "tcp://127.0.0.1:{port}"\nkv_replay = "tcp://127.0.0.1:{replay}"\n'
    )
    gateway = start_gateway([], "--config", str(config), "--admin-key", "admin-secret")
    try:
        url = gateway.url
        assert wait_for(lambda: not mode(url)["degraded_by_index_health"], 10)
        publisher.close()  # the stream is gone
        assert wait_for(lambda: mode(url)["degraded_by_index_health"], 10)
        assert mode(url)["active_policy"] == "least_load"
        publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
        assert wait_for(lambda: not mode(url)["degraded_by_index_health"], 15)
        assert mode(url)["active_policy"] == "cache_aware"
    finally:
        publisher.close()
        gateway.stop()
        worker.stop()


def test_shadow_policies_watch_every_request():
    workers = [start_worker() for _ in range(2)]
    gateway = start_gateway(
        [w.url for w in workers],
        "--admin-key",
        "admin-secret",
        "--shadow-policy",
        "round_robin",
        "--shadow-policy",
        "sglang",
    )
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 2), 20)
        for i in range(12):
            body = {"model": "emulated", "prompt": f"{i % 3} shared " * 50, "max_tokens": 2}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            time.sleep(0.05)  # let the events land, as traffic spaced in time does
        shadows = mode(url)["shadows"]
        assert set(shadows) == {"round_robin", "sglang"}
        for stats in shadows.values():
            assert stats["requests"] == 12 and 0 <= stats["disagreement_rate"] <= 1
            assert stats["predicted_ttft_mean_s"] > 0
        assert shadows["sglang"]["predicted_hit_rate"] > 0  # it follows the prefixes too
        assert "urc_shadow_disagreements_total" in httpx.get(f"{url}/metrics").text
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
