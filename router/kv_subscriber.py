"""A WorkerMirror's asyncio shell (docs/kv-events.md): a SUB socket follows the worker's stream,
a fresh DEALER per replay request asks for what was missed, and whenever the mirror may be
behind it catches up from the last seq it applied."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
import zmq.backend
from zmq.utils.monitor import parse_monitor_message

from core.kv_events import KVEventDecodeError, decode_for_ingest
from router.kv_mirror import WorkerMirror
from router.kv_outcomes import Apply, Outcome

log = logging.getLogger(__name__)

_END = -1
YIELD_EVERY = 32  # messages applied in a row before the event loop gets a turn
REPLAY_DEADLINE_S = 30.0  # the longest replay
POLL_MS = 100  # how often run() looks at its stop flag
RCVHWM = 100_000

# the backend's getsockopt: an int, where the socket's own wraps it in an enum (~1 µs more)
_get = zmq.backend.Socket.get
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _waiting(sock: zmq.Socket) -> list[bytes] | None:
    """The message waiting on `sock`, or None; asks the socket's events first (cheaper than a
    failed non-blocking recv, which raises)."""
    if not _get(sock, _EVENTS) & _POLLIN:
        return None
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None


class KVEventSubscriber:
    """Follows one worker's KV events into its mirror: `run()` until `stop()`."""

    def __init__(
        self,
        mirror: WorkerMirror,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.mirror = mirror
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s  # the longest silence within a replay
        self.clock = clock  # the index's `now` (the gateway's clock)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._stopping = False
        self.synced = asyncio.Event()  # set once the start-up catch-up is done (or impossible)
        self.messages = self.bad_frames = self.reconnects = 0
        self.replays = self.replay_failures = 0
        self.connected = False  # the SUB socket's connection to the worker is up

    def stop(self) -> None:
        """Ask run() to return; it does within POLL_MS (or after a replay)."""
        self._stopping = True

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        # plain views of the sockets read a waiting message in one C call (an asyncio recv costs
        # a future and callbacks); the poller is awaited only once both are drained
        live = zmq.Socket.shadow(sub.underlying)
        changes = zmq.Socket.shadow(monitor.underlying)
        in_a_row = 0
        try:
            self.mirror.reset()  # whatever the index held for this worker may be stale
            await self._guarded(self._catch_up())
            self.synced.set()
            while not self._stopping:
                frames = _waiting(live)
                # looked at after the recv: a new incarnation's first message is never taken
                # for a continuation (a connection is reported before its messages)
                if self._reconnected(changes):
                    await self._guarded(self._catch_up())
                if frames is not None:
                    await self._guarded(self._on_message(frames))
                    in_a_row += 1
                    if in_a_row == YIELD_EVERY:
                        in_a_row = 0
                        await asyncio.sleep(0)
                elif not self._stopping:
                    in_a_row = 0
                    await poller.poll(POLL_MS)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _reconnected(self, monitor: zmq.Socket) -> bool:
        """Drain the SUB socket's monitor: did it (re)connect (messages lost, or a restart)?"""
        connected = False
        while (frames := _waiting(monitor)) is not None:
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_CONNECTED:
                self.reconnects += 1
                self.connected = connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
        return connected

    async def _guarded(self, step: Awaitable[None]) -> None:
        """Run one step; never die on bad input: what it left half done is reset."""
        try:
            await step
        except Exception:
            log.exception("kv events from %s: failed", self.mirror.worker)
            self.mirror.reset()

    async def _on_message(self, frames: list[bytes]) -> None:
        self.messages += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_frames += 1
            log.warning("kv events from %s: bad frames (%d)", self.mirror.worker, len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        result = self._apply(seq, frames[2])
        if result is not None and result.resume_from is not None:
            await self._catch_up()
            self._apply(seq, frames[2], baseline=True)  # a duplicate by now, unless it was lost

    def _apply(self, seq: int, payload: bytes, *, baseline: bool = False) -> Apply | None:
        """Decode and apply one batch (None: undecodable); `baseline` gives up missing history:
        the mirror is reset and this batch starts it afresh."""
        try:
            batch = decode_for_ingest(payload)
        except KVEventDecodeError as exc:
            log.warning("kv events from %s: seq %d undecodable: %s", self.mirror.worker, seq, exc)
            self.mirror.undecodable(seq)
            return None
        result = self.mirror.apply(seq, batch, self.clock())
        if baseline and result.resume_from is not None:
            self.mirror.reset()
            result = self.mirror.apply(seq, batch, self.clock())
        return result

    async def _catch_up(self) -> None:
        """Replay from our last seq (or 0) until the mirror is current (docs/kv-events.md)."""
        mirror = self.mirror
        for _ in range(2):  # the second round only after finding a new incarnation
            last = mirror.last_seq
            entries = await self._replay(0 if last is None or last < 0 else last)
            if entries is None:
                if last is not None:  # history may be missing and cannot be had
                    mirror.reset()
                return
            if not entries:
                if last is None or last < 0:
                    return  # nothing published yet
                mirror.new_incarnation()  # our last seq is not in its stream
                continue
            for i, (seq, payload) in enumerate(entries):
                result = self._apply(seq, payload)
                if result is None or result.resume_from is None:
                    continue
                if result.outcome is Outcome.RESTART and i == 0:
                    break  # the overlap batch differs: a new incarnation; replay from 0
                self.replay_failures += 1  # the replay cannot cover what is missing
                for seq_, payload_ in entries[i:]:
                    self._apply(seq_, payload_, baseline=True)
                return
            else:
                return
        self.replay_failures += 1
        mirror.reset()

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The worker's buffered batches from `start` on; None when no replay can be had."""
        if self.replay_endpoint is None:
            return None
        self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(self.replay_endpoint)
        entries: list[tuple[int, bytes]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_DEADLINE_S
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                wait_s = min(self.replay_timeout_s, deadline - loop.time())
                if wait_s <= 0 or not await dealer.poll(max(1, int(wait_s * 1000))):
                    log.warning("kv events from %s: replay timed out", self.mirror.worker)
                    self.replay_failures += 1
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) == 4:  # vLLM today: (empty, topic, seq, payload)
                    frames = [frames[0], frames[2], frames[3]]
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kv events from %s: bad replay frames", self.mirror.worker)
                    self.replay_failures += 1
                    return None
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END:
                    return entries
                entries.append((seq, frames[2]))
        finally:
            dealer.close(linger=0)
