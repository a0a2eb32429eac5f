"""The unified radix index (DESIGN §2): one tree of block keys for the whole fleet.

Keys are chained (core/blocks.py), so a key names its whole prefix and the token path of a
prompt is stored once however many workers and models hold it. The tree is compressed, as
SGLang's radix cache is: a node is a *run* of consecutive blocks with the same residency, and
`_where` maps every key to its run's id (router/run_tree.py keeps that shape). Matching a prompt
costs one dict lookup per run plus a list comparison of the run's keys, not a lookup per block.

Residency is a bitmask per run: each `(worker, kv_group)` pair (a *resident*) owns one bit.
Exact residency comes from KV events and lasts until removed; approximate residency comes from
routing history and expires `approx_ttl_s` after it was last confirmed. A run's `ts` is the
last time it was confirmed or matched. *Pending* residency bridges the gap between sending a
request to a worker with KV events and its events arriving: the request's keys are held at once,
approximate with the short `pending_ttl_s`, until the worker's own store confirms them (exact)
or they expire. A pending block counts as stored (`blocks_stored`) only when confirmed.

Memory is bounded by `max_blocks`: blocks go from the tail of the least recently used leaf run,
only as many as the shortfall. Leaf runs sit in an intrusive doubly linked list (oldest at the
head), so neither eviction nor matching scans the index; only `clear` and `residency` walk the
runs (worker loss and tests, never the request path).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, cast

from router.run_tree import Run, RunTree


class Resident(NamedTuple):
    worker: str
    kv_group: str


class IndexStats(NamedTuple):
    blocks: int  # keys in the tree
    runs: int  # tree nodes (runs of blocks with one residency)
    residencies: int  # (block, resident) pairs
    approximate: int  # of which approximate (pending ones included)
    residents: int  # (worker, kv_group) pairs holding anything
    evicted: int  # blocks dropped by the memory budget so far
    pending: int = 0  # approximate residencies routed to an exact worker, not yet confirmed


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class UnifiedIndex(RunTree):
    """Residency of every block on every `(worker, kv_group)` in one tree.

    All methods are synchronous and take time as an argument: the gateway passes its clock,
    the simulator its virtual time.
    """

    def __init__(
        self, max_blocks: int = 0, approx_ttl_s: float = 120.0, pending_ttl_s: float = 10.0
    ) -> None:
        if max_blocks < 0 or approx_ttl_s <= 0 or pending_ttl_s < 0:
            raise ValueError("max_blocks, pending_ttl_s must be >= 0 and approx_ttl_s > 0")
        super().__init__()
        self.max_blocks = max_blocks  # 0: unbounded
        self.approx_ttl_s = approx_ttl_s
        self.pending_ttl_s = pending_ttl_s  # 0: pending residency off (such inserts do nothing)
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
        # key that starts a salted namespace -> its salt: what router/index_scopes.py finds a
        # tenant's (user's, session's) blocks by; may name keys no longer (or not yet) indexed
        self.namespaces: dict[int, str] = {}

    def tag_namespace(self, key: int, salt: str) -> None:
        """`key` starts the namespace of `salt`: a root block, or the first private block after
        a public prefix. Untagged keys of gone blocks are pruned now and then."""
        ns = self.namespaces
        if key in ns:
            return
        ns[key] = salt
        if len(ns) > 2 * len(self._where) + 8192:
            where = self._where
            recent = list(ns.items())[-4096:]  # perhaps not indexed yet: keep them
            self.namespaces = {k: v for k, v in ns.items() if k in where}
            self.namespaces.update(recent)

    # -- residents ---------------------------------------------------------------------------

    def _find(self, worker: str, kv_group: str) -> int | None:
        """The resident's bit; None while it holds nothing."""
        groups = self._bit_of.get(worker)
        return None if groups is None else groups.get(kv_group)

    def _bit(self, worker: str, kv_group: str) -> int:
        """The resident's bit, given one if it has none."""
        groups = self._bit_of.get(worker)
        bit = None if groups is None else groups.get(kv_group)
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

    def residents(self) -> list[Resident]:
        return [r for r in self._resident_of if r is not None]

    def blocks_held(self, worker: str, kv_group: str) -> int:
        bit = self._find(worker, kv_group)
        return 0 if bit is None else self._held[bit]

    def sizes(self, worker: str, kv_group: str) -> tuple[int, int]:
        """(blocks_held, blocks_stored) in one lookup: read for every candidate."""
        bit = self._find(worker, kv_group)
        return (0, 0) if bit is None else (self._held[bit], self._stored[bit])

    def blocks_stored(self, worker: str, kv_group: str) -> int:
        """Blocks the resident came to hold so far: the inflow of its cache."""
        bit = self._find(worker, kv_group)
        return 0 if bit is None else self._stored[bit]

    def _release(self, run: Run, bit: int) -> None:
        """The resident no longer holds any block of `run`."""
        run.mask &= ~(1 << bit)
        self._held[bit] -= len(run.keys)
        if self._approx:
            self._drop_approx(run.keys, bit)
        if run.mask == 0 and run.children == 0:
            self._delete(run)

    def _drop_approx(self, keys: list[int], bit: int) -> None:
        approx, pending = self._approx, self._pending
        for key in keys:
            times = approx.get(key)
            if times is not None and times.pop(bit, None) is not None:
                if not times:
                    del approx[key]
                if pending and pending.get(key, 0) >> bit & 1:
                    self._unpend(key, bit)

    def _release_tails(self, keys: list[int], bit: int) -> int:
        """Release the leading keys that are tails of runs the resident holds, deepest key
        first: what an LRU cache evicts, so what most BlockRemoved events say. One lookup per
        run, and a leaf only this resident holds is trimmed in place. Returns how many keys
        it released (the rest takes `_release_keys`'s general path)."""
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
                for key in cast(list[object], gone):
                    del where[key]
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
        # each run's keys, runs in order of first appearance; the runs are held here, so that
        # no run made by a split below can take the id of one deleted on the way
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

    # -- writes ------------------------------------------------------------------------------

    def insert(
        self,
        keys: Sequence[int],
        worker: str,
        kv_group: str,
        now: float,
        *,
        parent: int | None = None,
        approximate: bool = False,
        pending: bool = False,
    ) -> int:
        """Mark a chain of keys (keys[0] a child of `parent`, None: a root) as held by the
        resident. Exact residency overrides approximate. `pending`: a request with these keys
        was just sent to a worker whose KV events will confirm them; new holds are approximate
        for `pending_ttl_s` and count as stored only once an exact insert confirms them.
        Returns blocks newly held, plus (exact) pending blocks this insert confirmed."""
        chain = keys if isinstance(keys, list) else list(keys)  # native indexing below
        n = len(chain)
        if n == 0 or pending and not self.pending_ttl_s:
            return 0
        bit = self._bit(worker, kv_group)
        flag = 1 << bit
        where = self._where
        by_id = self._runs
        if pending:
            approximate = True
            expiry = now + self.pending_ttl_s
        else:
            expiry = now + self.approx_ttl_s
        confirmed = 0
        prev: Run | None = None  # the run that ends with the parent of chain[i]
        if parent is not None and (prev := by_id.get(where.get(parent, 0))) is not None:
            at = len(prev.keys) if prev.keys[-1] == parent else prev.keys.index(parent) + 1
            if at < len(prev.keys):
                prev = self._split(prev, at)
        added = 0
        boxed = cast(list[object], chain)  # keys stay objects (core/native.py)
        i = 0
        while i < n:
            run = by_id.get(where.get(boxed[i], 0))
            if run is None:  # new blocks up to the next known key
                if prev is not None and prev.children == 0 and prev.mask == flag:
                    run = prev  # a leaf only this resident holds grows in place
                    run.ts = now
                else:
                    run = self._new_run(prev, flag, now)
                j = self._claim(chain, i, run)
                fresh = chain[i:j]
                run.keys.extend(fresh)
                if approximate:
                    for key in fresh:
                        self._approx[key] = {bit: expiry}
                    if pending:
                        self._pending.update(dict.fromkeys(fresh, flag))
                added += j - i
                i = j
                prev = run
                continue
            if run.keys[0] != boxed[i]:  # entering mid-run (its parent was unknown to us)
                self._split(run, cast(list[object], run.keys).index(boxed[i]))
            size = len(run.keys)
            boxed_run = cast(list[object], run.keys)
            if chain[i : i + size] == run.keys:
                m = size
            else:
                m = 1
                while m < size and i + m < n and boxed[i + m] == boxed_run[m]:
                    m += 1
                if m < size:
                    run = self._split(run, m)
            if run.parent is None and prev is not None and not self._descends(prev, run):
                run.parent = prev  # an orphan whose parent arrived later (not a malformed
                self._adopt(prev)  # chain that loops back to one of its own ancestors)
            run.ts = now
            if not run.mask & flag:
                run.mask |= flag
                added += m
                if approximate:
                    for key in run.keys:
                        self._approx[key] = {**self._approx.get(key, {}), bit: expiry}
                    if pending:
                        marks = self._pending
                        for key in run.keys:
                            marks[key] = marks.get(key, 0) | flag
            elif self._approx:
                confirmed += self._confirm(run.keys, bit, expiry if approximate else None)
            i += m
            prev = run
        assert prev is not None
        if prev.children == 0:
            self._link_newest(prev)
        self._held[bit] += added
        if pending:
            self._pending_queue.append((expiry, bit, tuple(chain)))
        else:
            self._stored[bit] += added + confirmed
            if approximate:
                self._approx_queue.append((expiry, bit, tuple(chain)))
        if self.max_blocks and len(where) > self.max_blocks:
            self._evict(len(where) - self.max_blocks)
        return added + confirmed

    def _confirm(self, keys: list[int], bit: int, expiry: float | None) -> int:
        """Keys already held: refresh approximate ones, or make them exact (expiry None).
        Returns how many pending ones that made exact."""
        approx = self._approx
        pending = self._pending
        confirmed = 0
        for key in keys:
            times = approx.get(key)
            if times is None or bit not in times:
                continue  # exact already: an approximate sighting does not demote it
            if expiry is not None:
                if expiry > times[bit]:  # TTLs differ (pending vs approximate): keep the later
                    times[bit] = expiry
                continue
            del times[bit]
            if not times:
                del approx[key]
            if pending and pending.get(key, 0) >> bit & 1:
                self._unpend(key, bit)
                confirmed += 1
        return confirmed

    def _unpend(self, key: int, bit: int) -> None:
        mask = self._pending[key] & ~(1 << bit)
        if mask:
            self._pending[key] = mask
        else:
            del self._pending[key]

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
        mask = sum(1 << b for b in bits)
        removed = 0
        for run in list(self._runs.values()):
            if run.mask & mask:  # a run deleted on the way has an empty mask
                for bit in _bits(run.mask & mask):
                    removed += len(run.keys)
                    self._release(run, bit)
        for bit in bits:
            self._forget(bit)
        return removed

    def expire(self, now: float) -> int:
        """Drop approximate (and pending) residency not confirmed within its TTL. Cheap when
        nothing is due."""
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

    def _evict(self, count: int) -> None:
        head = self._lru
        where = self._where
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
                for key in gone:
                    del where[key]
            deleted = before - len(where)
            self._evicted += deleted
            count -= deleted

    # -- reads -------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], kv_group: str, now: float | None = None) -> dict[str, int]:
        """Leading blocks of `keys` held by each worker of `kv_group` (workers with none are
        absent). With `now`, the deepest matched run counts as used (LRU)."""
        active = self._group_mask.get(kv_group, 0)
        n = len(keys)
        if not active or not n:
            return {}
        where = self._where
        by_id = self._runs
        resident_of = self._resident_of
        matched: dict[str, int] = {}
        depth = 0
        boxed = cast(Sequence[object], keys)  # keys stay objects (core/native.py)
        last = None
        run = by_id.get(where.get(boxed[0], 0))  # 0: no object's id
        while run is not None:
            run_keys = cast(list[object], run.keys)
            if run_keys[0] != boxed[depth]:
                break  # the key sits mid-run on another path (an orphan's parent was missing)
            size = len(run_keys)
            if keys[depth : depth + size] == run_keys:
                m = size
            else:
                m = 1
                while m < size and depth + m < n and boxed[depth + m] == run_keys[m]:
                    m += 1
            held = active & run.mask
            if held != active:
                if depth:
                    for bit in _bits(active & ~held):
                        matched[resident_of[bit].worker] = depth  # type: ignore[union-attr]
                if not held:
                    active = 0
                    break
                active = held
            last = run
            depth += m
            if m < size or depth >= n:
                break
            run = by_id.get(where.get(boxed[depth], 0))
        if depth:
            for bit in _bits(active):
                matched[resident_of[bit].worker] = depth  # type: ignore[union-attr]
        if now is not None and last is not None:
            last.ts = now
            if last.children == 0:
                self._link_newest(last)
        return matched

    def holds(self, key: int, worker: str, kv_group: str) -> bool:
        bit = self._find(worker, kv_group)
        run = self.run_of(key)
        return bit is not None and run is not None and bool(run.mask >> bit & 1)

    def residency(self, worker: str, kv_group: str) -> set[int]:
        """Every key the resident holds. Walks the runs: for tests and debugging."""
        bit = self._find(worker, kv_group)
        if bit is None:
            return set()
        return {key for run in self._runs.values() if run.mask >> bit & 1 for key in run.keys}

    def is_approximate(self, key: int, worker: str, kv_group: str) -> bool:
        bit = self._find(worker, kv_group)
        times = self._approx.get(key)
        return bit is not None and times is not None and bit in times

    def confirmed_depth(self, keys: Sequence[int], worker: str, kv_group: str, depth: int) -> int:
        """Of the first `depth` keys (a match), how many lead before the first one the resident
        holds only pending: what it will find even if the request it awaits is not done."""
        bit = self._find(worker, kv_group)
        pending = self._pending
        if not pending or bit is None:
            return depth
        for i in range(depth):
            if pending.get(keys[i], 0) >> bit & 1:
                return i
        return depth

    def is_pending(self, key: int, worker: str, kv_group: str) -> bool:
        bit = self._find(worker, kv_group)
        return bit is not None and bool(self._pending.get(key, 0) >> bit & 1)

    def last_confirmed(self, key: int) -> float | None:
        run = self.run_of(key)
        return None if run is None else run.ts

    def stats(self) -> IndexStats:
        return IndexStats(
            blocks=len(self._where),
            runs=len(self._runs),
            residencies=sum(self._held),
            approximate=sum(len(t) for t in self._approx.values()),
            residents=sum(len(groups) for groups in self._bit_of.values()),
            evicted=self._evicted,
            pending=sum(m.bit_count() for m in self._pending.values()),
        )

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: int) -> bool:
        return key in self._where

    def check(self) -> None:
        """Integrity check (tests): the tree (router/run_tree.py), held counts, approximate
        and pending residency agree."""
        self._check_tree()
        held = [0] * len(self._held)
        for run in self._runs.values():
            for bit in _bits(run.mask):
                held[bit] += len(run.keys)
        assert held == self._held, "held counts"
        for key, times in self._approx.items():
            assert times and all(self._runs[self._where[key]].mask >> b & 1 for b in times)
        for key, mask in self._pending.items():
            assert mask and all(b in self._approx.get(key, ()) for b in _bits(mask)), "pending"
