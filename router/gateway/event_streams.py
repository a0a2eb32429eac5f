"""A worker's KV-event streams as the gateway follows them (docs/kv-events.md): where each
is (configured, or discovered from /urc/info), one per kv_group, and its subscriber feeding a
mirror of the worker in the index."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from router.index import UnifiedIndex
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
    kv_group: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    mirror: WorkerMirror | None = None
    subscriber: KVEventSubscriber | None = None
    task: asyncio.Task[None] | None = None

    def start(self, index: UnifiedIndex, worker: str, block_size: int) -> None:
        self.mirror = WorkerMirror(index, worker, self.kv_group, block_size=block_size)
        self.subscriber = KVEventSubscriber(
            self.mirror, self.endpoint, self.replay_endpoint, topic=self.topic, clock=time.monotonic
        )
        self.task = asyncio.get_running_loop().create_task(self.subscriber.run())

    async def stop(self) -> None:
        if self.subscriber is not None:
            self.subscriber.stop()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        self.subscriber = self.task = self.mirror = None

    def describe(self) -> dict[str, Any]:
        return {
            "kv_group": self.kv_group,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "mirror": self.mirror.stats()._asdict() if self.mirror is not None else None,
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
