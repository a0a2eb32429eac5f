"""A worker's KV-event streams as the gateway follows them (docs/kv-events.md): where each
is (configured, or discovered from /urc/info), one per kv_group, and its subscriber feeding a
mirror of the worker in the index."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from router.gateway.host_ingest import HostIngest
from router.index import UnifiedIndex
from router.kv_delta import FollowedStream, StreamJournal
from router.kv_mirror import WorkerMirror
from router.kv_subscriber import KVEventSubscriber

_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", "127.0.0.1", "localhost"}


def reachable(endpoint: str | None, worker_host: str) -> str | None:
    """A worker reports its bind address (tcp://*:5557, tcp://127.0.0.1:5557); seen from the
    gateway its events live on the host of its URL (a container name, another machine)."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if sep and host in _WILDCARD_HOSTS:
        return f"tcp://{worker_host}:{port}"
    return endpoint


@dataclass(slots=True, eq=False)
class EventStream:
    """One kv_group's KV events of a worker, followed by this process (its own mirror and
    subscriber) or, as a follower of the host's one ingest (`ingest`, --processes N), applied
    from the leader's deltas (docs/scale-out.md, "One ingest per host")."""

    kv_group: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    mirror: WorkerMirror | None = None
    subscriber: KVEventSubscriber | None = None
    task: asyncio.Task[None] | None = None
    followed: FollowedStream | None = None
    active: bool = False  # started: the worker's residency here comes from these events
    index: UnifiedIndex | None = None
    worker: str = ""
    block_size: int = 0
    ingest: HostIngest | None = None

    def start(
        self, index: UnifiedIndex, worker: str, block_size: int, ingest: HostIngest | None = None
    ) -> None:
        self.index, self.worker, self.block_size, self.ingest = index, worker, block_size, ingest
        self.active = True
        if ingest is not None:
            self.followed = ingest.add((worker, self.kv_group), self)
        if self.followed is None:
            self.lead()

    def lead(self) -> None:
        """Follow the worker's events ourselves (as the host's leader, journaled for the
        other processes)."""
        assert self.index is not None
        self.followed = None
        self.mirror = WorkerMirror(self.index, self.worker, self.kv_group, self.block_size)
        if self.ingest is not None:
            ops, wrote = self.ingest.ops, self.ingest.wrote
            self.mirror.journal = StreamJournal(self.worker, self.kv_group, ops, wrote)
        self.subscriber = KVEventSubscriber(
            self.mirror, self.endpoint, self.replay_endpoint, topic=self.topic, clock=time.monotonic
        )
        self.task = asyncio.get_running_loop().create_task(self.subscriber.run())

    def snapshot_groups(self) -> list[str] | None:
        """The kv_groups our mirror fed (None: we follow no mirror of it)."""
        return sorted(self.mirror.groups) if self.mirror is not None else None

    @property
    def connected(self) -> bool:
        """Whether the worker's stream is connected (as the leader says, for a follower)."""
        if self.subscriber is not None:
            return self.subscriber.connected
        return self.ingest is not None and self.ingest.connected((self.worker, self.kv_group))

    async def stop(self) -> None:
        self.active = False
        if self.ingest is not None:
            self.ingest.remove((self.worker, self.kv_group))
        if self.mirror is not None and self.mirror.journal is not None:
            self.mirror.journal.gone()  # the followers forget what it fed
        if self.subscriber is not None:
            self.subscriber.stop()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        self.subscriber = self.task = self.mirror = self.followed = None

    def describe(self) -> dict[str, Any]:
        role = "own" if self.ingest is None else "leader" if self.followed is None else "follower"
        return {
            "kv_group": self.kv_group,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "ingest": role,
            "mirror": self.mirror.stats()._asdict() if self.mirror is not None else None,
            "followed": self.followed.stats()._asdict() if self.followed is not None else None,
        }


def discovered_streams(
    info: dict[str, Any], served: dict[str, str], host: str
) -> list[EventStream]:
    """The streams a worker's /urc/info describes: per model, or one for a single kv_group."""
    streams: dict[str, EventStream] = {}
    for entry in info.get("models", []):
        events = entry.get("kv_events")
        group = served.get(entry.get("name", ""))
        if events and group and events.get("endpoint"):
            streams.setdefault(group, _stream(group, events, host))
    top = info.get("kv_events")
    groups = set(served.values())
    if not streams and top and top.get("endpoint") and len(groups) == 1:
        group = groups.pop()
        streams[group] = _stream(group, top, host)
    return list(streams.values())


def _stream(group: str, events: dict[str, Any], host: str) -> EventStream:
    endpoint = reachable(events["endpoint"], host) or ""
    replay = reachable(events.get("replay_endpoint"), host)
    return EventStream(group, endpoint, replay, events.get("topic", ""))
