"""The load the workers report (docs/dispatch.md, "Load the workers report"): the delta merge
into the gateway's ledger, the parsing of vLLM's and SGLang's /metrics, and, end to end, a
gateway that sees a queue another client built on a worker behind its back."""

from __future__ import annotations

import concurrent.futures as cf
import random

import httpx
import pytest

from router.gateway.load_report import (
    STALE_AFTER,
    Reported,
    Sample,
    merge,
    missed,
    parse_prometheus,
    parse_urc,
)
from router.policies import WorkerLoad
from router.route import LoadShare
from tests.gateway import ADMIN, admin_workers, route
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker


def sample(waiting: int, running: int, queued: int | None, decode: int) -> Sample:
    return Sample(waiting, running, queued, decode, None, None, 0.0)


def test_the_merge_adds_what_others_sent_and_keeps_the_own_ledger_live():
    load, reported = WorkerLoad("a"), Reported("urc")
    own = LoadShare(load, 100)  # one request of ours, queued
    # the worker: ours and 3 of others waiting, 2 of others decoding
    merge(load, reported, sample(4, 2, 700, 2), now=1.0)
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (6, 700, 2)
    assert reported.own(load) == (1, 100, 0)
    # ours moves between samples: the ledger moves with it, the others' part stays
    own.first_token()
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (6, 600, 3)
    second = LoadShare(load, 50)
    assert reported.own(load) == (2, 50, 1)
    # the next sample: others' requests finished; the worker has not seen our second one yet
    merge(load, reported, sample(0, 1, 0, 1), now=2.0)
    assert (reported.others_in_flight, reported.others_queued, reported.others_running) == (0, 0, 0)
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (2, 50, 1)
    own.finish()
    second.finish()
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (0, 0, 0)


def test_a_lone_gateway_sees_its_own_ledger():
    load, reported = WorkerLoad("a"), Reported("urc")
    shares = [LoadShare(load, 200) for _ in range(3)]
    merge(load, reported, sample(1, 2, 600, 0), now=1.0)  # the worker counts the same three
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (3, 600, 0)
    assert reported.others_in_flight == reported.others_queued == 0
    for share in shares:
        share.finish()
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (0, 0, 0)


def test_missed_samples_keep_the_others_part_a_while_then_drop_it():
    load, reported = WorkerLoad("a"), Reported("urc")
    share = LoadShare(load, 10)
    merge(load, reported, sample(5, 0, 900, 0), now=1.0)
    assert load.in_flight == 5
    for _ in range(STALE_AFTER - 1):
        missed(load, reported)
        assert load.in_flight == 5 and load.queued_prefill_tokens == 900
    missed(load, reported)
    assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (1, 10, 0)
    share.finish()
    assert (load.in_flight, load.queued_prefill_tokens) == (0, 0)


def test_engines_without_queued_tokens_get_them_estimated_from_our_requests():
    load, reported = WorkerLoad("a"), Reported("prometheus")
    shares = [LoadShare(load, 400) for _ in range(2)]  # ours: 400 uncached tokens each
    merge(load, reported, sample(6, 0, None, 0), now=1.0)  # 6 waiting, 2 of them ours
    assert reported.tokens_per_request == 400
    assert load.queued_prefill_tokens == 6 * 400
    for share in shares:
        share.finish()
    merge(load, reported, sample(4, 0, None, 0), now=2.0)  # nothing of ours: the learnt size
    assert (load.in_flight, load.queued_prefill_tokens) == (4, 1600)


VLLM_METRICS = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="0",model_name="llama-lora"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:num_requests_waiting{engine="0",model_name="llama-lora"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="llama",reason="capacity"} 99.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 12.0
"""

SGLANG_METRICS = b"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="0"} 5.0
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="1"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="1"} 1.0 1700000000000
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="0"} 0.25
sglang:token_usage{model_name="Qwen/Qwen3-8B",tp_rank="0",dp_rank="1"} 0.5
"""


def test_vllm_metrics_are_summed_over_models_and_read_name_exactly():
    got = parse_prometheus(VLLM_METRICS)
    assert got == Sample(7, 4, None, 4, None, None, 0.42)


def test_older_vllm_and_sglang_metrics():
    older = b'vllm:num_requests_waiting{model_name="m"} 2\nvllm:gpu_cache_usage_perc{a="b"} 0.1\n'
    assert parse_prometheus(older) == Sample(2, 0, None, 0, None, None, 0.1)
    assert parse_prometheus(SGLANG_METRICS) == Sample(3, 9, None, 9, None, None, 0.5)


def test_metrics_of_neither_engine_are_no_sample():
    assert parse_prometheus(b"# HELP x y\nurc_engine_running_requests 3.0\n") is None
    assert parse_prometheus(b"") is None


def test_urc_load_is_read_strictly():
    body = (
        b'{"waiting": 2, "running": 3, "queued_prefill_tokens": 900, "running_decode": 1,'
        b' "free_kv_pages": 25, "total_kv_pages": 100, "time": 1.5, "later": "ignored"}'
    )
    assert parse_urc(body) == Sample(2, 3, 900, 1, 25, 100, 0.75)
    for bad in (b"[]", b'{"waiting": "2"}', b"not json"):
        with pytest.raises(ValueError):
            parse_urc(bad)


# -- end to end -------------------------------------------------------------------------------

# slow workers, one request at a time: a burst of long prompts queues for seconds
SLOW = ("--prefill-tokens-per-s", "4000", "--max-batch", "1")
BURST, BURST_TOKENS = 6, 4000  # 6 s of prefill queued on the worker


def cold(i: int) -> dict:
    """A prompt no worker holds (its first block new), a few blocks long."""
    words = " ".join(f"{random.Random(i).getrandbits(40):x}" for _ in range(30))
    return {"model": "emulated", "prompt": f"cold {i} {words}", "max_tokens": 2}


def long_prompt(i: int) -> dict:
    return {"model": "emulated", "prompt": f"burst {i} " + "x" * BURST_TOKENS, "max_tokens": 1}


def chosen(gateway: str, body: dict) -> str:
    plan = httpx.post(f"{gateway}/admin/route", json=body, headers=ADMIN, timeout=5).json()
    return plan["worker"]


def reported_waiting(gateway: str, name: str) -> int:
    worker = next(w for w in admin_workers(gateway) if w["name"] == name)
    return (worker["reported"] or {}).get("waiting") or 0


@pytest.mark.parametrize(
    ("source", "worker_flags"), [("push", ()), ("urc", ("--load-publish-ms", "0"))]
)
def test_a_queue_built_behind_the_gateways_back_steers_cold_prefixes_elsewhere(
    source: str, worker_flags: tuple[str, ...]
):
    """Pushed by our workers (a ZMQ subscription), or polled (`GET /urc/load`) when they
    publish none."""
    workers = [start_worker(*SLOW, *worker_flags) for _ in range(3)]
    urls = [w.url for w in workers]
    gateways = []
    try:
        admin = ("--admin-key", "admin-secret", "--policy", "cache_aware")
        fed = start_gateway(urls, *admin, "--load-interval", "0.05")
        blind = start_gateway(urls, *admin, "--load-interval", "0")
        gateways = [fed, blind]
        for gateway in gateways:
            assert wait_for(lambda g=gateway: sum(w["up"] for w in admin_workers(g.url)) == 3)
        names = {w["url"]: w["name"] for w in admin_workers(fed.url)}
        busy = names[urls[0]]
        assert wait_for(lambda: admin_workers(fed.url)[0]["reported"] is not None, 5)

        # another client sends straight to the first worker: its queue grows there
        direct = httpx.Client(timeout=60)
        with cf.ThreadPoolExecutor(BURST) as pool:
            burst = [  # each its own prompt: none reuses another's prefill
                pool.submit(direct.post, f"{urls[0]}/v1/completions", json=long_prompt(i))
                for i in range(BURST)
            ]
            assert wait_for(lambda: reported_waiting(fed.url, busy) >= BURST - 2, 5)
            described = next(w for w in admin_workers(fed.url) if w["name"] == busy)
            metrics = httpx.get(f"{fed.url}/metrics", timeout=5).text
            fed_choices = [chosen(fed.url, cold(i)) for i in range(30)]
            blind_choices = [chosen(blind.url, cold(i)) for i in range(30)]
            served = [
                httpx.post(f"{fed.url}/v1/completions", json=cold(100 + i), timeout=30)
                for i in range(3)
            ]
            for f in burst:
                assert f.result(timeout=60).status_code == 200
        direct.close()

        assert busy not in fed_choices  # it sees the queue: cold prefixes go elsewhere
        assert busy in blind_choices  # without the feed it cannot (rendezvous spreads them)
        assert all(r.status_code == 200 and route(r)["worker"] != busy for r in served)
        reported = described["reported"]
        assert reported["source"] == source and reported["waiting"] >= 1
        assert reported["queued_prefill_tokens"] >= (BURST - 2) * BURST_TOKENS
        assert reported["others"]["in_flight"] >= BURST - 2
        assert described["load"]["queued_prefill_tokens"] >= (BURST - 2) * BURST_TOKENS
        assert f'urc_worker_reported_waiting{{worker="{busy}"}}' in metrics
        # the burst is over: the others' part goes with it
        assert wait_for(lambda: reported_waiting(fed.url, busy) == 0, 5)
        assert wait_for(
            lambda: (
                next(w for w in admin_workers(fed.url) if w["name"] == busy)["load"]
                == {"in_flight": 0, "queued_prefill_tokens": 0, "running_decode": 0}
            ),
            5,
        )
    finally:
        for child in (*gateways, *workers):
            child.stop()


def test_a_worker_that_reports_nothing_has_no_feed(tmp_path):
    worker = start_worker()
    gateway = None
    try:
        load = httpx.get(f"{worker.url}/urc/load", timeout=5).json()
        assert set(load) == {
            "waiting",
            "running",
            "queued_prefill_tokens",
            "running_decode",
            "free_kv_pages",
            "total_kv_pages",
            "time",
        }
        assert load["free_kv_pages"] == load["total_kv_pages"] > 0
        # configured as vLLM: /metrics has none of vLLM's gauges, so no feed, and no harm
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[[workers]]\nurl = "{worker.url}"\nmodels = ["emulated"]\nengine = "vllm"\n'
        )
        gateway = start_gateway([], "--config", str(config), "--admin-key", "admin-secret")
        assert wait_for(lambda: admin_workers(gateway.url)[0]["reported"] is not None, 5)
        assert wait_for(lambda: admin_workers(gateway.url)[0]["reported"]["source"] == "none", 5)
        r = httpx.post(f"{gateway.url}/v1/completions", json=cold(1), timeout=30)
        assert r.status_code == 200
    finally:
        for child in (gateway, worker):
            if child is not None:
                child.stop()
