"""The one dispatch (router/route.py): matched tokens, the load ledger, and that the gateway's
header, its metrics and a shadow policy read the same matched tokens."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.policies import RouteRequest, WorkerLoad
from router.route import LoadShare
from tests.gateway import ADMIN, all_exact, route
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker

BS = 16


def test_matched_tokens_are_whole_blocks_short_of_the_last_prompt_token() -> None:
    whole = RouteRequest([1, 2, 3, 4], 4 * BS, BS, "g")  # a prompt of exactly four blocks
    assert [whole.matched_tokens(b) for b in range(5)] == [0, 16, 32, 48, 48]
    longer = RouteRequest([1, 2, 3, 4], 4 * BS + 1, BS, "g")
    assert longer.matched_tokens(4) == 64
    assert RouteRequest([], 0, BS, "g").matched_tokens(0) == 0
    assert RouteRequest([], 1, BS, "g").matched_tokens(0) == 0


def test_each_load_transition_happens_once() -> None:
    load = WorkerLoad("w")
    share = LoadShare(load, 100)
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (1, 100, 0)
    share.first_token()
    share.first_token()  # the timer and the stream both say so
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (1, 0, 1)
    share.finish()
    share.finish()
    share.first_token()  # too late: it is done
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (0, 0, 0)
    rejected = LoadShare(load, 50)
    rejected.finish()  # never started: its queued tokens leave with it
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (0, 0, 0)


def counter(text: str, name: str) -> float:
    """The sum of a counter's samples over all label sets."""
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name == name + "_total")
    return 0.0


def test_header_metrics_and_shadow_agree_on_a_fully_cached_prompt() -> None:
    worker = start_worker()
    gateway = start_gateway(
        [worker.url], "--admin-key", "admin-secret", "--shadow-policy", "least_load"
    )
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 1), 20)
        body = {"model": "emulated", "prompt": list(range(1, 4 * BS + 1)), "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200

        def held_whole() -> bool:
            plan = httpx.post(f"{url}/admin/route", json=body, headers=ADMIN, timeout=5).json()
            return plan["candidates"][0]["matched_tokens"] == 3 * BS

        assert wait_for(held_whole, 10)  # its KV events reached the index
        before = httpx.get(f"{url}/metrics").text
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        after = httpx.get(f"{url}/metrics").text
        assert route(r)["matched_tokens"] == str(3 * BS)  # the last block is computed
        for name in ("urc_predicted_cached_tokens", "urc_shadow_predicted_hit_tokens"):
            assert counter(after, name) - counter(before, name) == 3 * BS, name
    finally:
        gateway.stop()
        worker.stop()
