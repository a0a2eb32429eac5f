"""Gateway replicas that agree without talking to each other (docs/scale-out.md): three
replicas, and one gateway with --processes 3, behind a real Envoy route like one gateway; a
replica that joins mid-run follows the same index; one killed mid-run costs no non-streamed
request. Real processes on 127.0.0.1: emulated workers, gateways, Envoy."""

from __future__ import annotations

import asyncio
import signal
import time
from itertools import islice

import httpx
import pytest

from loadgen.workloads import make_workload
from urc.replicas import Fleet, admin_get, closed_loop, start_fleet, start_replica, summary

pytestmark = pytest.mark.timeout(300)
REQUESTS, CONCURRENCY = 360, 32
WORKER_ARGS = ("--capacity-tokens", "60000")


def workload(n: int = REQUESTS, seed: int = 0) -> list:
    params = {"groups": 12, "prefix_tokens": 1500, "hot_share": 0.4, "max_tokens": 16}
    return list(islice(make_workload("system-prompts", **params).requests(seed, ["emulated"]), n))


def run(replicas: int, processes: int = 1) -> dict:
    fleet = start_fleet(4, replicas, processes, worker_args=WORKER_ARGS)
    try:
        assert fleet.envoy is not None
        return summary(asyncio.run(closed_loop(fleet.envoy.url, workload(), CONCURRENCY, 3)))
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def single() -> dict:
    return run(1)


@pytest.mark.parametrize(
    ("replicas", "processes"), [(3, 1), (1, 3)], ids=["3-replicas", "processes-3"]
)
def test_replicas_route_like_one_gateway(single: dict, replicas: int, processes: int) -> None:
    many = run(replicas, processes)
    assert single["failed"] == many["failed"] == 0, (single["errors"], many["errors"])
    assert abs(many["hit_rate"] - single["hit_rate"]) <= 0.02, (single, many)
    assert abs(many["busiest_share"] - single["busiest_share"]) <= 0.05, (single, many)


def index_of(fleet: Fleet, port: int) -> dict:
    answer = asyncio.run(admin_get(f"http://127.0.0.1:{port}", "/admin/workers", fleet.admin_key))
    held = {w["name"]: w["cached_blocks"] for w in answer["workers"]}
    return {"held": held, "blocks": answer["index"]["blocks"]}


def dry_run(fleet: Fleet, port: int, spec) -> str:
    body = {"model": spec.model, "messages": spec.messages, "max_tokens": spec.max_tokens}
    headers = {"Authorization": f"Bearer {fleet.admin_key}"}
    url = f"http://127.0.0.1:{port}/admin/route"
    return httpx.post(url, json=body, headers=headers, timeout=10).json()["worker"]


def test_replica_joins_and_one_is_killed() -> None:
    fleet = start_fleet(4, 3, spare=1, worker_args=WORKER_ARGS)
    spare = fleet.gateway_ports[-1]
    joined: list[float] = []

    def join() -> None:
        start_replica(fleet, spare)
        joined.append(time.monotonic())

    at = {REQUESTS // 3: join, 2 * REQUESTS // 3: lambda: fleet.gateways[1].stop(signal.SIGKILL)}
    try:
        assert fleet.envoy is not None
        outcomes = asyncio.run(closed_loop(fleet.envoy.url, workload(), CONCURRENCY, 3, at))
        result = summary(outcomes)
        assert result["failed_non_streamed"] == 0, result["errors"]
        assert joined and fleet.gateways[1].popen.poll() is not None
        # the joiner's index is the survivors' (every replica follows every worker's events)
        survivors = [fleet.gateway_ports[0], fleet.gateway_ports[2], spare]
        deadline = time.monotonic() + 2.0
        while True:
            indexes = [index_of(fleet, port) for port in survivors]
            if all(index == indexes[0] for index in indexes) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert indexes[2] == indexes[0] == indexes[1]
        assert sum(indexes[0]["held"].values()) > 0
        # and it routes like them: the same worker for each group's prompt (dry runs)
        firsts = {spec.group_id: spec for spec in reversed(workload())}
        choices = [[dry_run(fleet, port, spec) for spec in firsts.values()] for port in survivors]
        assert choices[2] == choices[0], choices
        served_by_joiner = asyncio.run(
            admin_get(f"http://127.0.0.1:{spare}", "/admin/workers", fleet.admin_key)
        )
        assert sum(w["load"]["in_flight"] for w in served_by_joiner["workers"]) == 0
    finally:
        fleet.stop()
