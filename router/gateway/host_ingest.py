"""One KV-event ingest per host for `--processes N` (docs/scale-out.md, "One ingest per host"):
the process holding the host's ingest lock (the leader) follows the workers' streams, decodes
and keys each batch once, and publishes what its mirrors wrote to its index as keyed deltas
(router/kv_delta.py) on a local PUB socket; every other process (a follower) applies them to
its own index. A follower that misses a delta (a gap in their seq, a new leader, a stream it
starts following) asks the leader for a snapshot of those streams and goes on from there. When
the leader dies its lock is free: the first follower to take it becomes the leader and follows
the workers itself (replaying their buffers, as a process that starts does)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from router.gateway.config import GatewayConfig
from router.gateway.siblings import Siblings
from router.index import UnifiedIndex
from router.kv_delta import FollowedStream, Op, apply_ops, decode_ops, encode_ops, snapshot

log = logging.getLogger(__name__)

StreamKey = tuple[str, str]  # (worker, kv_group) of one stream
HEARTBEAT_S = 0.5  # the leader's heartbeat: its last seq and which streams are connected
LEADER_SILENT_S = 2.0  # a follower without a heartbeat this long: events count as lost
TRY_LOCK_S = 0.2  # how often a follower tries to take the lock (takes over a dead leader)
SYNC_TIMEOUT_S = 5.0  # a snapshot asked for and not answered: asked again
# the longest the leader keeps its mirrors' writes before sending them: fewer, larger deltas
# cost the followers less (CPU per block, bench/kv_ingest.py), and their index lags this more
FLUSH_S = 0.02
SNDHWM = 10_000  # deltas queued per follower; beyond, that follower misses some and resyncs
_DELTA, _BEAT = b"d", b"h"
_streams = msgspec.msgpack.Decoder(list[tuple[str, str]])
_encode = msgspec.msgpack.Encoder().encode


class Stream(Protocol):
    """What the ingest needs of an event stream (router/gateway/event_streams.py)."""

    def lead(self) -> None: ...  # follow the worker itself from now on

    def snapshot_groups(self) -> list[str] | None: ...  # the groups its mirror fed

    @property
    def connected(self) -> bool: ...


def _header(leader: bytes, seq: int, kind: bytes) -> bytes:
    return leader + seq.to_bytes(8, "big") + kind


class HostIngest:
    """This process's side of the host's one ingest; `directory` is private to the gateway."""

    def __init__(self, index: UnifiedIndex, directory: str) -> None:
        self.index = index
        self._lock_path = os.path.join(directory, "ingest.lock")
        self._pub_end = f"ipc://{os.path.join(directory, 'ingest-pub')}"
        self._sync_end = f"ipc://{os.path.join(directory, 'ingest-sync')}"
        self._ctx = zmq.asyncio.Context.instance()
        self._lock_fd = -1
        self.leading = False
        self.identity = os.urandom(8)  # this process as a leader: a new one means resync
        self.streams: dict[StreamKey, Stream] = {}  # this process's streams under way
        # leader: the ops its mirrors wrote since the last send, and the seq of that send
        self.ops: list[Op] = []
        self.seq = 0
        self._flush_soon = False
        self._pub: zmq.asyncio.Socket | None = None
        # follower
        self.followed: dict[StreamKey, FollowedStream] = {}
        self.leader: bytes | None = None
        self._expected: int | None = None  # the next delta's seq (None: a full sync needed)
        self._want: set[StreamKey] = set()  # streams to snapshot in the next sync
        self._asked: tuple[bytes, set[StreamKey], bool, float] | None = None  # id, keys, full
        self._held: list[tuple[int, bytes]] = []  # deltas while a sync is under way
        self._beat_at = 0.0
        self._connected: set[StreamKey] = set()
        self.syncs = self.gaps = 0
        self._task: asyncio.Task[None] | None = None

    # -- both ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Take the lead if the lock is free (before any stream starts), then run."""
        self._try_lock()
        if self.leading:
            self._bind()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None  # a flush still timed finds it gone
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the lock is free: a follower takes the lead
            self._lock_fd = -1

    def _try_lock(self) -> None:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return
        self._lock_fd = fd
        self.leading = True

    def role(self) -> str:
        return "leader" if self.leading else "follower"

    def add(self, key: StreamKey, stream: Stream) -> FollowedStream | None:
        """A stream of this process starts: as a follower, its FollowedStream (synced soon)."""
        self.streams[key] = stream
        if self.leading:
            return None
        followed = self.followed[key] = FollowedStream(*key)
        self._want.add(key)
        return followed

    def remove(self, key: StreamKey) -> None:
        self.streams.pop(key, None)
        self.followed.pop(key, None)
        self._want.discard(key)

    def connected(self, key: StreamKey) -> bool:
        """A followed stream's worker connection, as the leader's last heartbeat said (before
        the first: taken as connected, not lost)."""
        if not self._beat_at:
            return True
        fresh = time.monotonic() - self._beat_at < LEADER_SILENT_S
        return fresh and key in self._connected

    async def _run(self) -> None:
        """Follow until this process takes the lead, then lead; never die on bad input: a
        follower starts over from a snapshot."""
        while True:
            try:
                if self.leading:
                    await self._lead()
                else:
                    await self._follow()
            except Exception:
                log.exception("kv events: the host's ingest failed; starting over")
                self._new_leader(None)
                await asyncio.sleep(TRY_LOCK_S)

    # -- the leader ---------------------------------------------------------------------------

    def _bind(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, SNDHWM)
        pub.setsockopt(zmq.LINGER, 0)
        for end in (self._pub_end, self._sync_end):  # a dead leader's socket file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(end[len("ipc://") :])
        pub.bind(self._pub_end)
        self._pub = pub

    def wrote(self) -> None:
        """A mirror journaled its first op since the last send: send them in FLUSH_S (one
        delta for all the batches applied meanwhile)."""
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        if not self.ops or self._pub is None:
            return
        body = encode_ops(self.ops)
        self.ops.clear()
        self.seq += 1
        # PUB never blocks: a follower whose queue is full misses this one, and resyncs
        self._pub.send_multipart((_header(self.identity, self.seq, _DELTA), body), copy=False)

    async def _lead(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self._sync_end)
        try:
            beat_at = 0.0
            while True:
                if await router.poll(int(HEARTBEAT_S * 1000)):
                    frames = await router.recv_multipart()
                    if len(frames) == 3:  # (the follower, its request's id, the streams)
                        await router.send_multipart((*frames[:2], *self._snapshot(frames[2])))
                now = time.monotonic()
                if now - beat_at >= HEARTBEAT_S and self._pub is not None:
                    beat_at = now
                    up = [key for key, s in self.streams.items() if s.connected]
                    beat = _header(self.identity, self.seq, _BEAT)
                    self._pub.send_multipart((beat, _encode(up)))
        finally:
            router.close(linger=0)

    def _snapshot(self, body: bytes) -> tuple[bytes, bytes]:
        """The answer to a sync: our seq and the asked streams' ops (after sending what the
        mirrors wrote since the last delta, so that the seq covers all the index holds)."""
        self._flush()
        ops: list[Op] = []
        try:
            keys = _streams.decode(body)
        except msgspec.DecodeError:
            keys = []
        for key in keys:
            stream = self.streams.get(key)
            groups = stream.snapshot_groups() if stream is not None else None
            if groups:
                ops += snapshot(self.index, key[0], key[1], groups)
        return _header(self.identity, self.seq, _DELTA), encode_ops(ops)

    def _take_lead(self) -> None:
        """The lock is ours: follow the workers ourselves; the followers resync from us."""
        log.warning("kv events: this process now follows the workers for the host")
        self._bind()
        for key, followed in list(self.followed.items()):
            followed.forget(self.index)
            self.followed.pop(key, None)
            stream = self.streams.get(key)
            if stream is not None:
                stream.lead()

    # -- a follower ---------------------------------------------------------------------------

    async def _follow(self) -> None:
        """Follow the leader until this process takes the lock."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, SNDHWM)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._pub_end)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._sync_end)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        live = zmq.Socket.shadow(sub.underlying)  # reads a waiting message in one C call
        tried = time.monotonic()
        try:
            while True:
                self._maybe_sync(dealer)
                ready = dict(await poller.poll(int(TRY_LOCK_S * 1000)))
                for _ in range(64 if sub in ready else 0):  # what is waiting, then a turn
                    try:
                        frames = live.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
                if dealer in ready:
                    self._on_answer(await dealer.recv_multipart())
                if time.monotonic() - tried >= TRY_LOCK_S:
                    tried = time.monotonic()
                    self._try_lock()
                    if self.leading:
                        self._take_lead()
                        return
        finally:
            sub.close(linger=0)
            dealer.close(linger=0)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != 17:
            return
        header, body = frames
        leader, seq, kind = header[:8], int.from_bytes(header[8:16], "big"), header[16:]
        if leader != self.leader:
            self._new_leader(leader)
        if kind == _BEAT:
            self._beat_at = time.monotonic()
            with contextlib.suppress(msgspec.DecodeError):
                self._connected = set(_streams.decode(body))
            if self._asked is None and self._expected is not None and seq >= self._expected:
                self._lost()  # a delta we never got: its ops are in a snapshot now
            return
        self._delta(seq, body)

    def _delta(self, seq: int, body: bytes) -> None:
        if self._asked is not None:
            self._held.append((seq, body))
            return
        expected = self._expected
        if expected is None or seq < expected:
            return  # in the snapshot under way, or in the one taken
        if seq > expected:
            self._lost()  # the snapshot asked for next covers this one
            return
        self._expected = seq + 1
        try:
            ops = decode_ops(body)
        except msgspec.DecodeError:
            self._lost()
            return
        apply_ops(self.index, ops, self.followed, time.monotonic(), seq)

    def _new_leader(self, leader: bytes | None) -> None:
        """Another process leads: everything is synced afresh from it."""
        self.leader = leader
        self._asked = None
        self._held.clear()
        self._expected = None
        for followed in self.followed.values():
            followed.synced_at = None

    def _lost(self) -> None:
        self.gaps += 1
        self._expected = None

    def _maybe_sync(self, dealer: zmq.asyncio.Socket) -> None:
        """Ask for a snapshot of what needs one: every stream after a loss, else new ones."""
        asked = self._asked
        if asked is not None:
            if time.monotonic() - asked[3] < SYNC_TIMEOUT_S:
                return
            self._asked = None  # the leader died, or the answer was lost: ask again, all
            self._expected = None
        full = self._expected is None
        keys = set(self.followed) if full else self._want & set(self.followed)
        if not keys and not full:
            return
        self._want.clear()
        ident = os.urandom(8)
        self._asked = (ident, keys, full, time.monotonic())
        dealer.send_multipart((ident, _encode(sorted(keys))))

    def _on_answer(self, frames: list[bytes]) -> None:
        asked = self._asked
        if asked is None or len(frames) != 3 or frames[0] != asked[0] or len(frames[1]) != 17:
            return  # a late answer to a request given up
        _, keys, full, _ = asked
        leader, seq = frames[1][:8], int.from_bytes(frames[1][8:16], "big")
        self._asked = None
        if leader != self.leader:
            self._new_leader(leader)  # sent by a new leader: what it holds is new too
        try:
            ops = decode_ops(frames[2])
        except msgspec.DecodeError:
            self._lost()
            return
        self.syncs += 1
        for key in keys:
            followed = self.followed.get(key)
            if followed is not None:
                followed.forget(self.index)
                followed.synced_at = seq
                followed.syncs += 1
        apply_ops(self.index, ops, self.followed, time.monotonic(), seq + 1)
        if full:
            self._expected = seq + 1
        held, self._held = self._held, []
        for held_seq, body in held:
            self._delta(held_seq, body)


def host_ingest(
    index: UnifiedIndex, config: GatewayConfig, siblings: Siblings | None
) -> HostIngest | None:
    """A process's share of its host's one ingest (None: it follows the workers on its own)."""
    if siblings is None or siblings.count < 2 or config.ingest_per_process:
        return None
    return HostIngest(index, siblings.directory)
