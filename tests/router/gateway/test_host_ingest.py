"""One KV-event ingest per host (docs/scale-out.md, "One ingest per host"): of `--processes 3`
one process follows the workers' streams and the others apply its keyed deltas, so each holds
the same index and routes alike; when the leader is killed another takes over and the restarted
process follows it. Real processes on 127.0.0.1 (emulated workers, a real gateway), and the
ingest's own sequencing over its real sockets in one process."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.gateway.host_ingest import HostIngest
from router.index import UnifiedIndex
from router.kv_delta import StreamJournal
from router.kv_mirror import WorkerMirror
from tests.processes import wait_for
from tests.router.test_kv_mirror import BS, G, RefEngine, W, feed, record
from urc.processes import Child, start_gateway, start_worker

ADMIN = {"Authorization": "Bearer admin-secret"}
PROCESSES = 3


@pytest.fixture(scope="module")
def workers():
    children = [start_worker("--kv-events-port", "0") for _ in range(2)]
    yield [c.url for c in children]
    for child in children:
        child.stop()


def by_replica(url: str) -> dict[str, dict[str, Any]]:
    """Every process's `GET /admin/workers` (fresh connections until each has answered)."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(200):
        answer = httpx.get(url + "/admin/workers", headers=ADMIN, timeout=10).json()
        seen[answer["replica"]] = answer
        if len(seen) == PROCESSES:
            return seen
    raise AssertionError(f"only {sorted(seen)} answered")


def held(answer: dict[str, Any]) -> tuple[Any, ...]:
    """What a process's index holds from the events: its exact residencies, and per worker."""
    index = answer["index"]
    per_worker = sorted((w["name"], w["cached_blocks"]) for w in answer["workers"])
    return index["residencies"] - index["pending"], index["pending"], tuple(per_worker)


def all_alike(url: str) -> bool:
    states = {held(a) for a in by_replica(url).values()}
    return len(states) == 1 and next(iter(states))[1] == 0


def send(url: str, prefixes: range, turns: int) -> None:
    for turn in range(turns):
        for p in prefixes:
            prompt = f"prefix {p}: " + "a long shared system prompt " * 30 + f"turn {turn} " * 8
            body = {"model": "emulated", "prompt": prompt, "max_tokens": 2}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200


def dry_runs(url: str, prefixes: range) -> set[str]:
    """The dry-run decisions of the prefixes (each on a fresh connection: any process)."""
    decisions = set()
    for _ in range(3):
        for p in prefixes:
            prompt = f"prefix {p}: " + "a long shared system prompt " * 30 + "new question"
            body = {"model": "emulated", "prompt": prompt, "max_tokens": 2}
            answer = httpx.post(url + "/admin/route", json=body, headers=ADMIN, timeout=10).json()
            scores = sorted((c["worker"], c["matched_tokens"]) for c in answer["candidates"])
            decisions.add(f"{p} {answer['worker']} {scores}")
    return decisions


def test_one_process_ingests_and_every_process_holds_the_same_index(workers: list[str]) -> None:
    gateway = start_gateway(workers, "--processes", str(PROCESSES), "--admin-key", "admin-secret")
    try:
        send(gateway.url, range(6), 3)
        assert wait_for(lambda: all_alike(gateway.url), 20)
        answers = by_replica(gateway.url)
        roles = sorted(a["kv_ingest"] for a in answers.values())
        assert roles == ["follower", "follower", "leader"]
        for answer in answers.values():
            streams = [s for w in answer["workers"] for s in w["kv_events"]]
            assert len(streams) == 2 and all(s["ingest"] == answer["kv_ingest"] for s in streams)
            if answer["kv_ingest"] == "follower":  # no mirror: nothing decoded, nothing keyed
                assert all(s["mirror"] is None and s["followed"]["syncs"] >= 1 for s in streams)
                assert sum(s["followed"]["blocks_stored"] for s in streams) > 0
        exact, _, per_worker = held(next(iter(answers.values())))
        assert exact > 0 and all(blocks > 0 for _, blocks in per_worker)
        # the processes route alike: the same matches and choice whichever answers
        assert len(dry_runs(gateway.url, range(6))) == 6

        leader = next(a for a in answers.values() if a["kv_ingest"] == "leader")
        os.kill(leader["pid"], signal.SIGKILL)  # the supervisor restarts it, as a follower

        def new_leader() -> bool:
            now = by_replica(gateway.url)
            leaders = [a for a in now.values() if a["kv_ingest"] == "leader"]
            return len(leaders) == 1 and leaders[0]["replica"] != leader["replica"]

        assert wait_for(new_leader, 20)
        assert wait_for(lambda: leader["pid"] not in pids(gateway), 20)
        send(gateway.url, range(4, 10), 2)
        assert wait_for(lambda: all_alike(gateway.url), 20)
        assert len(dry_runs(gateway.url, range(4, 10))) == 6
        assert held(by_replica(gateway.url).popitem()[1])[0] > 0
    finally:
        assert gateway.stop(signal.SIGTERM) == 0


def pids(gateway: Child) -> set[int]:
    return {a["pid"] for a in by_replica(gateway.url).values()}


def test_ingest_per_process_keeps_the_old_way(workers: list[str]) -> None:
    flags = ("--processes", str(PROCESSES), "--admin-key", "admin-secret", "--ingest-per-process")
    gateway = start_gateway(workers, *flags)
    try:
        send(gateway.url, range(3), 2)
        assert wait_for(lambda: all_alike(gateway.url), 20)
        for answer in by_replica(gateway.url).values():
            assert answer["kv_ingest"] == "own"
            streams = [s for w in answer["workers"] for s in w["kv_events"]]
            assert all(s["ingest"] == "own" and s["mirror"] is not None for s in streams)
    finally:
        gateway.stop()


class _Stream:
    """A process's stream as the ingest sees it: the leader's with its mirror."""

    def __init__(self, mirror: WorkerMirror | None = None) -> None:
        self.mirror = mirror
        self.led = False
        self.connected = True

    def lead(self) -> None:
        self.led = True

    def snapshot_groups(self) -> list[str] | None:
        return sorted(self.mirror.groups) if self.mirror is not None else None


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_follower_resyncs_after_a_lost_delta_and_takes_over(tmp_path: Path) -> None:
    """In one process, over the real sockets: a follower that starts late gets a snapshot, one
    that misses a delta (a seq skipped) resyncs, and when the leader goes it takes the lead."""
    leading, followed_index = UnifiedIndex(), UnifiedIndex()
    leader = HostIngest(leading, str(tmp_path))
    leader.start()
    mirror = WorkerMirror(leading, W, G, BS)
    mirror.journal = StreamJournal(W, G, leader.ops, leader.wrote)
    leader.add((W, G), _Stream(mirror))
    stream = record(RefEngine("int", seed=9), 90, seed=10, array_like=True)
    for seq, payload, _ in stream[:30]:  # before the follower starts
        feed(mirror, seq, payload)
    follower = HostIngest(followed_index, str(tmp_path))
    follower.start()
    mine = _Stream()
    followed = follower.add((W, G), mine)
    assert leader.leading and not follower.leading and followed is not None

    def alike() -> bool:
        return followed_index.residency(W, G) == leading.residency(W, G)

    try:
        for seq, payload, _ in stream[30:60]:
            feed(mirror, seq, payload)
            await asyncio.sleep(0.005)
        assert await until(alike) and followed.syncs == 1 and follower.gaps == 0
        leader.seq += 1  # a delta the follower never gets (as when its queue is full)
        for seq, payload, _ in stream[60:]:
            feed(mirror, seq, payload)
            await asyncio.sleep(0.005)
        assert await until(lambda: alike() and followed.syncs == 2)
        assert follower.gaps == 1 and followed_index.residency(W, G) == stream[-1][2]
        await leader.close()  # the lock is free: the follower takes the lead
        assert await until(lambda: follower.leading and mine.led)
        assert not followed_index.residency(W, G)  # what it held from the old leader: cleared
    finally:
        await follower.close()
        await leader.close()
