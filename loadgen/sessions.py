"""SessionQueue: the order in which specs become requests, and multi-turn chaining
(docs/loadgen.md). Pure: the async runner and the offline simulator drive the same object."""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque

from loadgen.workloads import Message, RequestSpec


class SessionQueue:
    def __init__(self) -> None:
        self._ready: list[tuple[int, RequestSpec]] = []  # heap of (order added, spec)
        self._order = 0
        self._waiting: dict[str, deque[tuple[int, RequestSpec]]] = {}
        self._busy: set[str] = set()  # sessions with a turn in flight
        self._history: dict[str, list[Message] | str] = {}  # the next turn's prefix
        self._failed: set[str] = set()
        self.dropped = 0  # turns never sent because an earlier turn of their session failed

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def waiting(self) -> int:
        """Turns held back behind an earlier turn of their session still in flight."""
        return sum(len(q) for q in self._waiting.values())

    def add(self, spec: RequestSpec) -> None:
        self._order += 1
        sid = spec.session_id
        if sid is None:
            heapq.heappush(self._ready, (self._order, spec))
        elif sid in self._failed:
            self.dropped += 1
        elif sid in self._busy or sid in self._waiting:
            self._waiting.setdefault(sid, deque()).append((self._order, spec))
        else:
            self._busy.add(sid)  # reserved from now: its later turns wait behind it
            heapq.heappush(self._ready, (self._order, spec))

    def take(self) -> RequestSpec | None:
        """The next request to send, or None; the caller must `complete` every one it takes."""
        if not self._ready:
            return None
        _, spec = heapq.heappop(self._ready)
        if spec.session_id is None or spec.session_id not in self._history:
            return spec
        prior = self._history.pop(spec.session_id)
        if spec.kind == "chat":
            assert isinstance(prior, list) and spec.messages is not None
            return dataclasses.replace(spec, messages=[*prior, *spec.messages])
        assert isinstance(prior, str) and spec.prompt is not None
        return dataclasses.replace(spec, prompt=prior + spec.prompt)

    def complete(self, sent: RequestSpec, reply: str | None) -> None:
        """`sent` (as returned by `take`) finished with the assistant's text, or failed (None)."""
        sid = sent.session_id
        if sid is None:
            return
        assert sid in self._busy, sid
        queued = self._waiting.pop(sid, deque())
        if reply is None:
            self._busy.discard(sid)
            self._failed.add(sid)
            self.dropped += len(queued)
            return
        if not sent.ends_session:
            if sent.kind == "chat":
                assert sent.messages is not None
                self._history[sid] = [*sent.messages, {"role": "assistant", "content": reply}]
            else:
                assert sent.prompt is not None
                self._history[sid] = sent.prompt + reply
        if queued:
            heapq.heappush(self._ready, queued.popleft())
            if queued:
                self._waiting[sid] = queued
        else:
            self._busy.discard(sid)
