"""`urc gateway --processes N` (docs/scale-out.md): one port, N full replicas; an admin change
reaches every process and says so, one /metrics covers all of them, SIGTERM drains them all;
and `--kv-groups`, which makes a gateway follow only some kv_groups. Real processes on
127.0.0.1."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest

from router.gateway.siblings import merge_expositions
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def workers():
    children = [start_worker("--kv-events-port", "0") for _ in range(2)]
    yield [c.url for c in children]
    for child in children:
        child.stop()


def completion(url: str, model: str = "emulated") -> httpx.Response:
    body = {"model": model, "prompt": "a shared prefix " * 40, "max_tokens": 4}
    # a fresh connection each: the kernel spreads them over the processes
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_admin_changes_and_metrics_reach_every_process(workers: list[str]) -> None:
    flags = ("--processes", "3", "--admin-key", "admin-secret", "--metrics-port", "0")
    gateway = start_gateway(workers, *flags)
    try:
        answer = httpx.post(gateway.url + "/admin/mode", json={"degraded": True}, headers=ADMIN)
        assert answer.status_code == 200
        applied = answer.json()["applied_to"]
        assert applied["processes"] == {"0": 200, "1": 200, "2": 200}
        assert "other gateway replicas" in applied["note"]
        replicas = set()
        for _ in range(24):  # new connections: the kernel spreads them over the processes
            mode = httpx.get(gateway.url + "/admin/mode", headers=ADMIN).json()
            assert mode["mode"] == "degraded"
            replicas.add(httpx.get(gateway.url + "/admin/workers", headers=ADMIN).json()["replica"])
            assert completion(gateway.url).status_code == 200
        assert len(replicas) > 1  # the answers came from more than one process

        metrics_url = metrics_announced(gateway)
        text = httpx.get(metrics_url).text
        degraded = [line for line in text.splitlines() if line.startswith("urc_routing_degraded{")]
        assert sorted(degraded) == [f'urc_routing_degraded{{replica="{i}"}} 1.0' for i in range(3)]
        served = [line for line in text.splitlines() if line.startswith("urc_requests_total{")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in served) == 24
        # each process's own process_* series, told apart by their replica label
        started = [line for line in text.splitlines() if line.startswith("process_start_time_")]
        assert sorted(line.split(" ")[0] for line in started) == [
            f'process_start_time_seconds{{replica="{i}"}}' for i in range(3)
        ]
        assert "_created" not in text
        keyed = httpx.get(gateway.url + "/metrics", headers=ADMIN).text
        assert keyed.count("# TYPE urc_routing_degraded gauge") == 1

        missing = httpx.delete(gateway.url + "/admin/workers/nobody", headers=ADMIN)
        assert missing.status_code == 404  # a refused change is not fanned out
        assert "applied_to" not in missing.json()
    finally:
        assert gateway.stop(signal.SIGTERM) == 0  # every process drained and exited


def exact_residencies(metrics_url: str) -> list[float]:
    """Each process's index residencies confirmed by KV events (pending ones left out)."""
    by_process: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        for name, sign in (("urc_index_residencies", 1), ("urc_index_pending_residencies", -1)):
            if line.startswith((name + " ", name + "{")):
                labels = line[len(name) :].rsplit(" ", 1)[0]
                by_process[labels] = by_process.get(labels, 0.0) + sign * float(line.split()[-1])
    return list(by_process.values())


def metrics_announced(gateway: Child) -> str:
    """The metrics URL the gateway prints after `gateway:` (maybe a moment later)."""

    def announced() -> list[str]:
        return [line for line in gateway.lines if line.startswith("metrics: ")]

    assert wait_for(announced, 10)
    return announced()[0][9:]


def hot_prefix_hit_rate(workers: list[str], processes: str) -> float:
    """Cached over prompt tokens of one tenant's hot-prefix load (4 prefixes, 6 requests each,
    each on a fresh connection), every process's index caught up before the next request."""
    flags = ("--processes", processes, "--api-key", "acme:sk-acme", "--metrics-port", "0")
    gateway = start_gateway(workers, *flags)
    try:
        metrics_url = metrics_announced(gateway)
        cached = prompt = 0
        before = max(exact_residencies(metrics_url))
        for i in range(24):
            text = f"hot prefix {i % 4}: " + "a shared system prompt " * 40
            body = {"model": "emulated", "prompt": text + f"question {i}: " * 12, "max_tokens": 2}
            auth = {"Authorization": "Bearer sk-acme"}
            answer = httpx.post(gateway.url + "/v1/completions", json=body, headers=auth)
            usage = answer.json()["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            prompt += usage["prompt_tokens"]

            def caught_up(floor: float = before) -> bool:
                seen = exact_residencies(metrics_url)
                return len(set(seen)) == 1 and seen[0] > floor

            assert wait_for(caught_up, 20)  # the suffix's new blocks reached every index
            before = exact_residencies(metrics_url)[0]
        return cached / prompt
    finally:
        gateway.stop()


def test_processes_share_one_salt_secret(workers: list[str]) -> None:
    """Tenants and no salt_secret: the supervisor draws one secret for all its processes, so
    they salt a tenant alike and the load hits the workers' caches as through one process."""
    one = hot_prefix_hit_rate(workers, "1")
    three = hot_prefix_hit_rate(workers, "3")
    assert one > 0.6  # every request but each prefix's first hits its whole prefix
    assert abs(three - one) <= 0.02, (one, three)


def test_merge_expositions_labels_each_process() -> None:
    one = b'# HELP x_total X\n# TYPE x_total counter\nx_total{w="a"} 1.0\n'
    two = b'# HELP x_total X\n# TYPE x_total counter\nx_total{w="a"} 2.0\n'
    merged = merge_expositions({"0": one, "1": two}).decode()
    assert merged.count("# TYPE x_total counter") == 1
    assert 'x_total{replica="0",w="a"} 1.0' in merged
    assert 'x_total{replica="1",w="a"} 2.0' in merged


def test_kv_groups_follows_only_those_groups() -> None:
    a = start_worker("--model", "alpha", "--kv-group", "ga", "--kv-events-port", "0")
    b = start_worker("--model", "beta", "--kv-group", "gb", "--kv-events-port", "0")
    gateway = start_gateway([a.url, b.url], "--kv-groups", "ga", "--admin-key", "admin-secret")
    try:
        models = [m["id"] for m in httpx.get(gateway.url + "/v1/models").json()["data"]]
        assert models == ["alpha"]
        assert completion(gateway.url, "alpha").status_code == 200
        refused = completion(gateway.url, "beta")
        assert refused.status_code == 404 and refused.json()["error"]["message"]
        workers = httpx.get(gateway.url + "/admin/workers", headers=ADMIN).json()["workers"]
        by_models = {tuple(w["models"]): w for w in workers}
        assert set(by_models) == {("alpha",), ()}
        assert by_models[()]["kv_events"] == []  # beta's events are not followed
    finally:
        for child in (gateway, a, b):
            child.stop()


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_taken_port_is_a_clear_error(processes: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = [sys.executable, "-m", "urc.cli", "gateway", "--worker", "http://127.0.0.1:1"]
        argv += ["--port", port, "--processes", processes]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "urc gateway: cannot listen" in done.stderr and "Traceback" not in done.stderr
