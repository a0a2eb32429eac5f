"""Who holds what in the unified index (docs/index.md): each `(worker, kv_group)` (a resident)
owns one bit of a run's mask; a hold ends by remove, clear, expiry or LRU eviction."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import NamedTuple, cast

from router.run_tree import Run, RunTree


class Resident(NamedTuple):
    worker: str
    kv_group: str


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class ResidencyTree(RunTree):
    """The run tree with each run's residents: bits, counts, approximate and pending marks."""

    def __init__(self, max_blocks: int) -> None:
        super().__init__()
        self.max_blocks = max_blocks  # 0: unbounded
        self._bit_of: dict[str, dict[str, int]] = {}  # worker -> kv_group -> bit
        self._resident_of: list[Resident | None] = []  # bit -> resident
        self._free_bits: list[int] = []
        self._held: list[int] = []  # bit -> blocks held
        self._stored: list[int] = []  # bit -> blocks it came to hold so far (its cache inflow)
        self._group_mask: dict[str, int] = {}
        # approximate residency: key -> {bit: expiry}; sweep queues in expiry order (one per
        # TTL, each fixed); pending: key -> bits whose approximate hold awaits confirmation
        self._approx: dict[int, dict[int, float]] = {}
        self._approx_queue: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self._pending: dict[int, int] = {}
        self._pending_queue: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self._evicted = 0

    def _find(self, worker: str, kv_group: str) -> int | None:
        """The resident's bit; None while it holds nothing."""
        groups = self._bit_of.get(worker)
        return None if groups is None else groups.get(kv_group)

    def _bit(self, worker: str, kv_group: str) -> int:
        """The resident's bit, given one if it has none."""
        bit = self._find(worker, kv_group)
        if bit is None:
            resident = Resident(worker, kv_group)
            if self._free_bits:
                bit = self._free_bits.pop()
                self._resident_of[bit] = resident
                self._stored[bit] = 0
            else:
                bit = len(self._resident_of)
                self._resident_of.append(resident)
                self._held.append(0)
                self._stored.append(0)
            self._bit_of.setdefault(worker, {})[kv_group] = bit
            self._group_mask[kv_group] = self._group_mask.get(kv_group, 0) | (1 << bit)
        return bit

    def _forget(self, bit: int) -> None:
        resident = self._resident_of[bit]
        assert resident is not None and self._held[bit] == 0
        groups = self._bit_of[resident.worker]
        del groups[resident.kv_group]
        if not groups:
            del self._bit_of[resident.worker]
        self._resident_of[bit] = None
        self._free_bits.append(bit)
        group_mask = self._group_mask[resident.kv_group] & ~(1 << bit)
        if group_mask:
            self._group_mask[resident.kv_group] = group_mask
        else:
            del self._group_mask[resident.kv_group]

    def blocks_held(self, worker: str, kv_group: str) -> int:
        bit = self._find(worker, kv_group)
        return 0 if bit is None else self._held[bit]

    def sizes(self, worker: str, kv_group: str) -> tuple[int, int]:
        """(blocks held, blocks stored so far: the cache's inflow), read for every candidate."""
        bit = self._find(worker, kv_group)
        return (0, 0) if bit is None else (self._held[bit], self._stored[bit])

    def set_inflow(self, worker: str, kv_group: str, stored: int) -> None:
        """The resident's inflow (`sizes`) as another index counts it (router/kv_delta.py)."""
        bit = self._find(worker, kv_group)
        if bit is not None:
            self._stored[bit] = stored

    def _release(self, run: Run, bit: int) -> None:
        """The resident no longer holds any block of `run`."""
        run.mask &= ~(1 << bit)
        self._held[bit] -= len(run.keys)
        if self._approx:
            self._drop_approx(run.keys, bit)
        if run.mask == 0 and run.children == 0:
            self._delete(run)

    def _drop_approx(self, keys: list[int], bit: int) -> int:
        """Drop the resident's approximate marks on `keys`; returns how many were pending."""
        approx, pending = self._approx, self._pending
        unpended = 0
        for key in keys:
            times = approx.get(key)
            if times is not None and times.pop(bit, None) is not None:
                if not times:
                    del approx[key]
                mask = pending.get(key, 0) if pending else 0
                if mask >> bit & 1:
                    mask &= ~(1 << bit)
                    if mask:
                        pending[key] = mask
                    else:
                        del pending[key]
                    unpended += 1
        return unpended

    def _release_tails(self, keys: list[int], bit: int) -> int:
        """Release the leading keys that are run tails, deepest first, as an LRU cache evicts
        them: one lookup per run. Returns how many it released (`_release_keys` does the rest)."""
        flag = 1 << bit
        where, by_id = self._where, self._runs
        boxed = cast(list[object], keys)
        n = len(keys)
        i = 0
        while i < n:
            run = by_id.get(where.get(boxed[i], 0))
            if run is None or not run.mask & flag:
                break
            run_keys = run.keys
            boxed_run = cast(list[object], run_keys)
            last = len(run_keys) - 1
            if boxed_run[last] != boxed[i]:
                break
            m = 1
            while m <= last and i + m < n and boxed[i + m] == boxed_run[last - m]:
                m += 1
            if m > last or run.mask != flag or run.children:  # not a leaf of its own
                self._release(run if m > last else self._cut_tail(run, m), bit)
            else:
                gone = run_keys[last + 1 - m :]
                del run_keys[last + 1 - m :]
                where.discard(cast(list[object], gone))
                self._held[bit] -= m
                if self._approx:
                    self._drop_approx(gone, bit)
            i += m
        return i

    def _release_keys(self, keys: list[int], bit: int) -> int:
        """Release the resident's hold on these keys, splitting runs at the range edges."""
        done = self._release_tails(keys, bit)
        if done == len(keys):
            return done
        if done:
            keys = keys[done:]
        flag = 1 << bit
        where, by_id = self._where, self._runs
        whole = by_id.get(where.get(cast(list[object], keys)[0], 0))
        if whole is not None and whole.mask & flag and whole.keys == keys:
            self._release(whole, bit)  # a whole run, root first: one lookup, no positions
            return done + len(keys)
        # each run's keys, in order of first appearance; holding the runs keeps their ids unique
        found: dict[object, list[int]] = {}
        for key in keys:
            rid = where.get(key, 0)
            if rid:
                listed = found.get(rid)
                if listed is None:
                    found[rid] = [key]
                else:
                    listed.append(key)
        runs = [(by_id[rid], run_keys) for rid, run_keys in found.items()]
        released = done
        for run, run_keys in runs:
            if not run.mask & flag:
                continue
            if len(run_keys) == len(run.keys) and len(set(run_keys)) == len(run_keys):
                released += len(run_keys)  # the whole run: no positions, no splits
                self._release(run, bit)
                continue
            size, n = len(run.keys), len(run_keys)
            if n < size and run.keys[size - n] in (run_keys[-1], run_keys[0]):
                tail = run.keys[size - n :]
                if tail == run_keys[::-1] or tail == run_keys:  # a tail, as LRU evictions go
                    released += n
                    self._release(self._cut_tail(run, n), bit)
                    continue
            if len(run_keys) == 1:
                offsets = [run.keys.index(run_keys[0])]
            else:
                position = {k: i for i, k in enumerate(run.keys)}
                offsets = sorted({position[k] for k in run_keys})
            ranges: list[list[int]] = []
            for off in offsets:
                if ranges and ranges[-1][1] == off:
                    ranges[-1][1] = off + 1
                else:
                    ranges.append([off, off + 1])
            cur = run
            for a, b in reversed(ranges):  # from the tail, so lower offsets stay in `cur`
                if b < len(cur.keys):
                    cur = self._split(cur, b)
                target = cur
                if a > 0:
                    cur = self._split(target, a)
                released += b - a
                self._release(target, bit)
        return released

    def _confirm(self, keys: list[int], bit: int, expiry: float | None) -> int:
        """Held keys: refresh approximate ones, or make them exact (None: returns those pending)."""
        if expiry is None:
            return self._drop_approx(keys, bit)
        approx = self._approx
        for key in keys:  # exact ones stay exact: an approximate sighting does not demote them
            times = approx.get(key)
            if times is not None and bit in times and expiry > times[bit]:
                times[bit] = expiry  # TTLs differ (pending vs approximate): keep the later
        return 0

    def remove(self, keys: Iterable[int], worker: str, kv_group: str) -> int:
        """The resident no longer holds these keys. Returns how many it held."""
        bit = self._find(worker, kv_group)
        if bit is None:
            return 0
        removed = self._release_keys(keys if isinstance(keys, list) else list(keys), bit)
        if self._held[bit] == 0:
            self._forget(bit)
        return removed

    def clear(self, worker: str, kv_group: str | None = None) -> int:
        """Drop everything a worker holds (in one kv_group, or in all). Walks the runs."""
        groups = self._bit_of.get(worker, {})
        bits = [bit for group, bit in groups.items() if kv_group in (None, group)]
        if not bits:
            return 0
        removed, _ = self._release_runs(list(self._runs.values()), sum(1 << b for b in bits))
        for bit in bits:
            self._forget(bit)
        return removed

    def _release_runs(self, runs: Iterable[Run], mask: int) -> tuple[int, int]:
        """Release all holds in `mask` on `runs`: (residencies dropped, bits that lost any)."""
        dropped = touched = 0
        for run in runs:
            held = run.mask & mask  # a run deleted on the way has an empty mask
            touched |= held
            for bit in _bits(held):
                dropped += len(run.keys)
                self._release(run, bit)
        return dropped, touched

    def expire(self, now: float) -> int:
        """Drop approximate (and pending) residency past its TTL; cheap when nothing is due."""
        return self._expire(self._approx_queue, now) + self._expire(self._pending_queue, now)

    def _expire(self, queue: deque[tuple[float, int, tuple[int, ...]]], now: float) -> int:
        approx = self._approx
        dropped = 0
        while queue and queue[0][0] <= now:
            _, bit, keys = queue.popleft()
            due = [k for k in keys if (t := approx.get(k)) and t.get(bit, now + 1) <= now]
            if due:
                dropped += self._release_keys(due, bit)
            if self._resident_of[bit] is not None and self._held[bit] == 0:
                self._forget(bit)
        return dropped

    def _evict(self) -> None:
        """Drop the blocks over `max_blocks`, from the tails of the least recently used leaves."""
        count = len(self._where) - self.max_blocks if self.max_blocks else 0
        head, where = self._lru, self._where
        while count > 0 and head.next is not head:
            run = head.next
            assert run is not None and run.children == 0
            take = min(count, len(run.keys))
            gone = run.keys[-take:]
            for bit in _bits(run.mask):
                self._held[bit] -= take
            for key in gone:
                self._approx.pop(key, None)
            if self._pending:
                for key in gone:
                    self._pending.pop(key, None)
            before = len(where)
            if take == len(run.keys):
                run.mask = 0
                self._delete(run)
            else:
                del run.keys[-take:]
                where.discard(cast(list[object], gone))
            deleted = before - len(where)
            self._evicted += deleted
            count -= deleted
