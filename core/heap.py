"""A min-heap of items by (key, push order): the event queues of the replay and the emulated
engine. heapq's algorithm over native entries: compiled, ordering two reads two fields, where
heapq over `(key, seq, item)` tuples compared them through the C API (a tenth of the replay's
time). (key, seq) is a total order, so the pops come in heapq's sequence.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Entry(Generic[T]):
    __slots__ = ("key", "seq", "item")

    def __init__(self, key: float, seq: int, item: T) -> None:
        self.key = key
        self.seq = seq  # unique and increasing: ties on key pop in push order
        self.item = item


def _before(a: Entry[T], b: Entry[T]) -> bool:
    return a.key < b.key or (a.key == b.key and a.seq < b.seq)


class Heap(Generic[T]):
    def __init__(self) -> None:
        self._entries: list[Entry[T]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, key: float, item: T) -> int:
        """Add `item` under `key`; returns the entry's sequence number."""
        self._seq += 1
        entry = Entry(key, self._seq, item)
        entries = self._entries
        entries.append(entry)
        i = len(entries) - 1
        while i > 0:  # sift up
            parent = (i - 1) >> 1
            above = entries[parent]
            if not _before(entry, above):
                break
            entries[i] = above
            i = parent
        entries[i] = entry
        return self._seq

    def peek(self) -> Entry[T]:
        """The first entry (IndexError when empty)."""
        return self._entries[0]

    def pop(self) -> Entry[T]:
        """Remove and return the first entry (IndexError when empty)."""
        entries = self._entries
        last = entries.pop()
        if not entries:
            return last
        top = entries[0]
        n = len(entries)
        i = 0
        key, seq = last.key, last.seq
        while True:  # sift `last` down from the root
            child = 2 * i + 1
            if child >= n:
                break
            below = entries[child]
            if child + 1 < n:
                right = entries[child + 1]
                if right.key < below.key or (right.key == below.key and right.seq < below.seq):
                    child += 1
                    below = right
            if key < below.key or (key == below.key and seq < below.seq):
                break
            entries[i] = below
            i = child
        entries[i] = last
        return top
