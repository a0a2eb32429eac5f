"""Flow control on real processes (docs/flow-control.md): a gateway with `flow_control = true`
over an emulated worker whose prefill is slow (2,000 tokens/s), so that a few long prompts
saturate the pool. Budgets give 429s with Retry-After and OpenAI's x-ratelimit headers; a flood
queues in the gateway and every request ends with a 200 or a 429; a quiet tenant's requests go
ahead of the flood's queued ones; sheddable requests are shed; a queue timeout says so; a
tokens-per-minute budget holds, in one process and split over three. Assertions on statuses,
headers, counts, order and token totals, never on timings."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway import ADMIN, all_exact
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

PREFILL = "2000"  # tokens/s: a 1,500-token prompt is 0.75 s of prefill, over 500 ms: saturated
TENANTS = {
    "flood": "",
    "quiet": "",
    "limited": "requests_per_minute = 3",
    "tokens": "tokens_per_minute = 1500",
}
FRESH = itertools.count()
LONG = "Every flood request brings its own long document to read. " * 26  # ~1,500 tokens


def config(path: Path, timeout_s: float) -> str:
    lines = [
        "[gateway]",
        "flow_control = true",
        "flow_saturation_ms = 500",
        f"flow_queue_timeout_s = {timeout_s}",
        f"prefill_tokens_per_s = {PREFILL}",
    ]
    for name, extra in TENANTS.items():
        lines += ["[[tenants]]", f'name = "{name}"', f'api_keys = ["key-{name}"]', extra]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def key(tenant: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{tenant}", **headers}


def chat(text: str, max_tokens: int = 4) -> dict:
    messages = [{"role": "user", "content": text}]
    return {"model": "emulated", "messages": messages, "max_tokens": max_tokens}


def post(url: str, tenant: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=key(tenant, **headers), timeout=60
    )


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def gateway_over(worker: Child, path: Path, *extra: str) -> Child:
    args = ("--config", str(path), "--admin-key", "admin-secret", *extra)
    gateway = start_gateway([worker.url], *args)
    assert wait_for(lambda: all_exact(gateway.url, 1), 20), gateway.lines[-20:]
    return gateway


@pytest.fixture(scope="module")
def worker() -> Iterator[Child]:
    child = start_worker("--prefill-tokens-per-s", PREFILL, "--log-level", "debug")
    yield child
    child.stop()


@pytest.fixture(scope="module")
def fleet(worker: Child, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Child]]:
    path = config(tmp_path_factory.mktemp("flow") / "urc.toml", timeout_s=60.0)
    gateway = gateway_over(worker, Path(path))
    yield gateway.url, gateway
    gateway.stop()


def flood(url: str, n: int, pool: ThreadPoolExecutor, **headers: str) -> list:
    """`n` long prompts at once, each new (uncached: a prefix the worker holds costs nothing)."""
    prompts = [f"{next(FRESH)} {LONG}" for _ in range(n)]
    return [pool.submit(post, url, "flood", chat(p), **headers) for p in prompts]


def test_over_requests_per_minute_429_with_retry_after_and_ratelimit_headers(fleet) -> None:
    url, _ = fleet
    answers = [post(url, "limited", chat(f"question {i}")) for i in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    ok, refused = answers[2], answers[3]
    assert ok.headers["x-ratelimit-limit-requests"] == "3"
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"]
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "requests_per_minute")
    assert post(url, "quiet", chat("unaffected")).status_code == 200
    assert metric(url, "urc_flow_requests_total", tenant="limited", outcome="limited") == 1


def test_a_flood_queues_ends_200_or_429_and_a_quiet_tenant_goes_first(fleet, worker) -> None:
    url, gateway = fleet
    with ThreadPoolExecutor(16) as pool:
        futures = flood(url, 12, pool)
        assert wait_for(lambda: metric(url, "urc_flow_queue_depth", tenant="flood") >= 3, 20)
        assert metric(url, "urc_pool_saturation") >= 1.0
        for i in range(3):  # each while the flood still waits: dispatched ahead of it
            answer = post(url, "quiet", chat(f"a short question {i}"))
            assert answer.status_code == 200, answer.text
        # the quiet ones did not wait for the flood queued before them: 12 x 0.75 s of prefill,
        # against about one flood request's for each quiet one
        assert sum(f.done() for f in futures) < 12
        statuses = [f.result().status_code for f in futures]
    assert len(statuses) == 12 and set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 3
    waited = metric(url, "urc_flow_requests_total", tenant="flood", outcome="admitted_after_wait")
    assert waited >= 2
    # the flood's requests sent after a quiet one, ranked after it (ahead of their share), told
    # the worker to keep protecting the quiet tenant's rank (x-urc-protect)
    logged = [line for line in worker.lines if "/v1/chat/completions" in line]
    assert any("priority=1" in line and "protect=0" in line for line in logged), logged[-5:]
    assert metric(url, "urc_flow_protect_hints_total", tenant="flood") >= 1


def test_sheddable_requests_are_shed_while_saturated(fleet) -> None:
    url, _ = fleet
    with ThreadPoolExecutor(8) as pool:
        futures = flood(url, 4, pool)
        assert wait_for(lambda: metric(url, "urc_pool_saturation") >= 1.0, 20)
        shed = post(url, "quiet", chat("can wait"), **{"x-urc-priority": "-1"})
        assert [f.result().status_code for f in futures].count(200) >= 1
    assert shed.status_code == 429, shed.text
    assert shed.json()["error"]["code"] == "shed"
    assert int(shed.headers["Retry-After"]) >= 1


def test_a_request_that_waits_too_long_gets_429_queue_timeout(worker, tmp_path) -> None:
    gateway = gateway_over(worker, Path(config(tmp_path / "urc.toml", timeout_s=1.0)))
    url = gateway.url
    try:
        with ThreadPoolExecutor(8) as pool:
            statuses = flood(url, 6, pool)  # ~4.5 s of prefill, one at a time: past 1 s, some
            answers = [f.result() for f in statuses]
    finally:
        gateway.stop()
    timed_out = [r for r in answers if r.status_code == 429]
    assert timed_out and all(r.json()["error"]["code"] == "queue_timeout" for r in timed_out)
    assert "waited" in timed_out[0].json()["error"]["message"]
    assert {r.status_code for r in answers} <= {200, 429}


def admitted_tokens(url: str, tenant: str, requests: int, interval_s: float) -> tuple[int, int]:
    """`requests` of ~300 tokens each, one every `interval_s`: (admitted, their tokens less
    the largest request's: what the budget must hold, past which one request may go)."""
    admitted = tokens = largest = 0
    for i in range(requests):
        answer = post(url, tenant, chat(f"{i:02d} " + "q " * 140, 10))
        assert answer.status_code in (200, 429), answer.text
        if answer.status_code == 200:
            usage = answer.json()["usage"]
            admitted += 1
            used = usage["prompt_tokens"] + usage["completion_tokens"]
            tokens += used
            largest = max(largest, used)
        else:
            assert answer.json()["error"]["code"] == "tokens_per_minute"
            assert "x-ratelimit-remaining-tokens" in answer.headers
        time.sleep(interval_s)
    return admitted, tokens - largest


def test_tokens_per_minute_holds_a_tenant_sending_twice_its_budget(fleet) -> None:
    url, _ = fleet
    admitted, tokens = admitted_tokens(url, "tokens", 10, 0.5)  # ~3,000 tokens: twice 1,500
    assert 1 <= admitted < 10
    assert tokens <= 1500, tokens  # the budget, and at most one request past it


def test_tokens_per_minute_over_three_processes_holds_in_all(worker, tmp_path) -> None:
    path = Path(config(tmp_path / "urc.toml", timeout_s=60.0))
    gateway = gateway_over(worker, path, "--processes", "3")
    try:
        admitted, tokens = admitted_tokens(gateway.url, "tokens", 12, 0.1)
        assert 1 <= admitted < 12
        assert tokens <= 1500, tokens  # each process 1/3 of the budget: within it in all
        timed = metric(gateway.url, "urc_flow_requests_total", tenant="tokens", outcome="limited")
        assert timed >= 1  # the processes' metrics, summed over the siblings
    finally:
        gateway.stop()
