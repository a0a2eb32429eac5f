"""A host tier seen through the gateway (docs/tiers.md): a worker's KV-event stream announces
blocks in its host tier (medium "CPU"); the dry run, `x-urc-route` and `/metrics` show them per
tier, cache_aware routes to them as a host hit, and their removal is seen. Real processes on
127.0.0.1; the events come from a publisher the test drives."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from core.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from core.kv_publisher import KVEventPublisher
from core.ports import free_port
from router.gateway.fleet import _host_copy_rate
from router.policies import make_policy
from tests.gateway import ADMIN, admin_workers, all_exact, route
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker

BS = 16
PROMPT = list(range(1, 8 * BS + 2))  # eight whole blocks and one more token
HASHES = list(range(101, 109))  # the engine's block hashes (not our keys: the mirror maps them)


def _dry_run(url: str) -> dict:
    body = {"model": "emulated", "prompt": PROMPT, "max_tokens": 2}
    return httpx.post(f"{url}/admin/route", json=body, headers=ADMIN, timeout=5).json()


def _sample(text: str, name: str, worker: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("worker") == worker:
                return s.value
    return 0.0


def test_host_tier_events_route_explain_and_count_per_tier(tmp_path) -> None:
    workers = [start_worker() for _ in range(2)]
    ports = [(free_port(), free_port()) for _ in workers]
    publishers = [
        KVEventPublisher(f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}") for p, r in ports
    ]
    config = tmp_path / "gateway.toml"
    config.write_text(
        "".join(
            f'[[workers]]\nurl = "{w.url}"\nmodels = ["emulated"]\n'
            f'kv_events = "tcp://127.0.0.1:{p}"\nkv_replay = "tcp://127.0.0.1:{r}"\n'
            for w, (p, r) in zip(workers, ports, strict=True)
        )
    )
    gateway = start_gateway([], "--config", str(config), "--admin-key", "admin-secret")
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 2), 20)
        name = {w["url"]: w["name"] for w in admin_workers(url)}[workers[0].url]
        stored = BlockStored(HASHES, None, PROMPT[: 8 * BS], BS, medium=MEDIUM_CPU)
        publishers[0].publish([stored])

        def host_tokens() -> int:
            scores = {c["worker"]: c for c in _dry_run(url)["candidates"]}
            return scores[name]["host_tokens"]

        assert wait_for(lambda: host_tokens() == 8 * BS, 10)
        plan = _dry_run(url)
        assert (plan["worker"], plan["reason"]) == (name, "host_hit")
        for c in plan["candidates"]:
            expected = 8 * BS if c["worker"] == name else 0
            assert (c["matched_tokens"], c["host_tokens"]) == (expected, expected)

        body = {"model": "emulated", "prompt": PROMPT, "max_tokens": 2}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200
        header = route(answer)
        assert header["worker"] == name and header["reason"] == "host_hit"
        assert (header["matched_tokens"], header["host_tokens"]) == (str(8 * BS), str(8 * BS))
        text = httpx.get(f"{url}/metrics", timeout=5).text
        assert _sample(text, "urc_predicted_host_cached_tokens_total", name) == 8 * BS
        assert _sample(text, "urc_predicted_cached_tokens_total", name) == 8 * BS
        assert _sample(text, "urc_worker_host_cached_blocks", name) == 8
        assert _sample(text, "urc_worker_cached_blocks", name) == 0
        held = {w["name"]: w["host_cached_blocks"] for w in admin_workers(url)}
        assert held[name] == 8

        publishers[0].publish([BlockRemoved(HASHES, MEDIUM_CPU)])
        assert wait_for(lambda: host_tokens() == 0, 10)
    finally:
        gateway.stop()
        for p in publishers:
            p.close()
        for w in workers:
            w.stop()


def test_the_copy_rate_workers_report_prices_host_hits() -> None:
    assert _host_copy_rate({"host_capacity_tokens": 1000, "host_copy_tokens_per_s": 2e5}) == 2e5
    assert _host_copy_rate({"host_copy_tokens_per_s": 3e5}) == 3e5
    assert _host_copy_rate({"host_capacity_tokens": 0, "host_copy_tokens_per_s": 2e5}) == 0.0
    for bad in (True, "fast", -1, None):
        assert _host_copy_rate({"host_copy_tokens_per_s": bad}) == 0.0
    policy = make_policy("cache_aware")
    policy.price_host_copies(1e5)
    assert policy.host_copy_tokens_per_s == 1e5
