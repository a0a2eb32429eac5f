"""The worker side of KV events: vLLM's ZmqEventPublisher, a PUB stream plus a ROUTER replay of
the last `buffer_steps` batches (docs/kv-events.md), answered by a daemon thread."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from core.kv_events import EventBatch, KVEvent, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 100  # how often the replay thread looks at its stop flag
_HWM = 100_000  # batches queued per subscriber before PUB drops (the replay then recovers them)
_BIND_TIMEOUT_S = 2.0


def _bind(kind: int, endpoint: str, send_hwm: int) -> tuple[zmq.Socket, str]:
    """A socket bound to `endpoint` (tcp://host:0: any free port) and the address bound, retried
    a little: ZMQ's I/O thread may still hold a port closed a moment ago."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.LINGER, 0)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"  # how ZMQ spells "any port"
    deadline = time.monotonic() + _BIND_TIMEOUT_S
    while True:
        try:
            sock.bind(endpoint)
            return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class KVEventPublisher:
    """Publishes batches as vLLM's ZmqEventPublisher does (tagged-map events, its data-parallel
    rank 0, its default topic "") and serves replays; `endpoint` and `replay_endpoint` become
    the addresses bound."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
    ) -> None:
        self.topic = topic.encode()
        self._lock = threading.Lock()  # guards the PUB socket, the seq and the buffer
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0  # the seq of the next batch
        self._pub, self.endpoint = _bind(zmq.PUB, endpoint, _HWM)
        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket | None = None
        self._running = True
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            # a replay is bounded by the buffer: never drop (SNDHWM 0)
            self._replay, self.replay_endpoint = _bind(zmq.ROUTER, replay_endpoint, 0)
            self._thread = threading.Thread(
                target=self._serve_replay, args=(self._replay,), name="kv-event-replay", daemon=True
            )
            self._thread.start()

    def publish(
        self, events: Sequence[KVEvent], ts: float | None = None, *, live: bool = True
    ) -> int:
        """Send one batch (thread-safe); returns its seq. `live=False`: for replay only (tests)."""
        batch = EventBatch(time.time() if ts is None else ts, list(events), dp_rank=0)
        return self.publish_payload(encode_batch(batch, array_like=False), live=live)

    def publish_payload(self, payload: bytes, *, live: bool = True) -> int:
        """Send an already encoded batch; returns its seq."""
        with self._lock:
            if not self._running:
                raise RuntimeError("publisher is closed")
            seq = self.next_seq
            self.next_seq += 1
            self._buffer.append((seq, payload))
            if live:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def _serve_replay(self, sock: zmq.Socket) -> None:
        while self._running:
            try:
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                if self._running:
                    log.exception("kv-event replay socket failed")
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self._buffer if s >= start_seq]
            try:
                for seq, payload in items:
                    sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                sock.send_multipart((client, b"", END_SEQ, b""))
            except zmq.ZMQError:
                log.warning("replay to a client failed", exc_info=True)

    def close(self) -> None:
        """Stop serving replays and close both sockets. Idempotent."""
        with self._lock:
            if not self._running:
                return
            self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2 * _POLL_MS / 1000 + 1.0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=0)
