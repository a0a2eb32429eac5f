"""The unified radix index (DESIGN §2): one tree of block keys for the whole fleet.

Nodes are block keys. Because keys are chained (router/blocks.py), a key names its whole
prefix, so the tree is a dict `key -> node` with parent pointers; the token path of a prompt is
stored once however many workers and models hold it.

Residency is a bitmask per node: each `(worker, kv_group)` pair (a *resident*) owns one bit.
Exact residency comes from KV events and lasts until removed; approximate residency comes from
routing history and expires `approx_ttl_s` after it was last confirmed. A node's `ts` is the
last time any of its residency was confirmed or matched.

Memory is bounded by `max_blocks` nodes: the least recently used leaves go first. Leaves sit in
an intrusive doubly linked list (oldest at the head), so neither eviction nor matching scans the
index; only `clear` and `residency` walk it (worker loss and tests, never the request path).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple


class _Node:
    __slots__ = ("key", "parent", "mask", "children", "ts", "prev", "next")

    def __init__(self, key: int, parent: _Node | None, mask: int, ts: float) -> None:
        self.key = key
        self.parent = parent
        self.mask = mask  # bit i set: resident i holds this block
        self.children = 0
        self.ts = ts
        self.prev: _Node | None = None  # LRU leaf list links; None when not a listed leaf
        self.next: _Node | None = None


class Resident(NamedTuple):
    worker: str
    kv_group: str


class IndexStats(NamedTuple):
    blocks: int  # nodes in the tree
    residencies: int  # (block, resident) pairs
    approximate: int  # of which approximate
    residents: int  # (worker, kv_group) pairs holding anything
    evicted: int  # blocks dropped by the memory budget so far


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class UnifiedIndex:
    """Residency of every block on every `(worker, kv_group)` in one tree.

    All methods are synchronous and take time as an argument: the gateway passes its clock,
    the simulator its virtual time.
    """

    def __init__(self, max_blocks: int = 0, approx_ttl_s: float = 120.0) -> None:
        if max_blocks < 0 or approx_ttl_s <= 0:
            raise ValueError("max_blocks must be >= 0 and approx_ttl_s > 0")
        self.max_blocks = max_blocks  # 0: unbounded
        self.approx_ttl_s = approx_ttl_s
        self._nodes: dict[int, _Node] = {}
        self._bit_of: dict[Resident, int] = {}
        self._resident_of: list[Resident | None] = []  # bit -> resident
        self._free_bits: list[int] = []
        self._held: list[int] = []  # bit -> blocks held
        self._group_mask: dict[str, int] = {}
        # approximate residency: key -> {bit: expiry}; sweep queue in expiry order (TTL is fixed)
        self._approx: dict[int, dict[int, float]] = {}
        self._approx_queue: deque[tuple[float, int, tuple[int, ...]]] = deque()
        self._lru = _Node(-1, None, 0, 0.0)  # sentinel: .next is the oldest leaf, .prev the newest
        self._lru.prev = self._lru.next = self._lru
        self._evicted = 0

    # -- residents ---------------------------------------------------------------------------

    def _bit(self, worker: str, kv_group: str) -> int:
        resident = Resident(worker, kv_group)
        bit = self._bit_of.get(resident)
        if bit is None:
            if self._free_bits:
                bit = self._free_bits.pop()
                self._resident_of[bit] = resident
            else:
                bit = len(self._resident_of)
                self._resident_of.append(resident)
                self._held.append(0)
            self._bit_of[resident] = bit
            self._group_mask[kv_group] = self._group_mask.get(kv_group, 0) | (1 << bit)
        return bit

    def _forget(self, bit: int) -> None:
        resident = self._resident_of[bit]
        assert resident is not None and self._held[bit] == 0
        del self._bit_of[resident]
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
        bit = self._bit_of.get(Resident(worker, kv_group))
        return 0 if bit is None else self._held[bit]

    # -- LRU leaf list -----------------------------------------------------------------------

    def _unlink(self, node: _Node) -> None:
        if node.prev is not None:
            node.prev.next = node.next
            node.next.prev = node.prev  # type: ignore[union-attr]
            node.prev = node.next = None

    def _link_newest(self, node: _Node) -> None:
        self._unlink(node)
        head = self._lru
        node.prev, node.next = head.prev, head
        head.prev.next = node  # type: ignore[union-attr]
        head.prev = node

    def _link_oldest(self, node: _Node) -> None:
        head = self._lru
        node.prev, node.next = head, head.next
        head.next.prev = node  # type: ignore[union-attr]
        head.next = node

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
    ) -> int:
        """Mark a chain of keys (keys[0] a child of `parent`, None: a root) as held by the
        resident. Exact residency overrides approximate. Returns blocks newly held."""
        if not keys:
            return 0
        bit = self._bit(worker, kv_group)
        flag = 1 << bit
        nodes = self._nodes
        approx = self._approx
        expiry = now + self.approx_ttl_s
        node = nodes.get(parent) if parent is not None else None
        added = 0
        for key in keys:
            child = nodes.get(key)
            if child is None:
                child = _Node(key, node, flag, now)
                nodes[key] = child
                if node is not None:
                    self._adopt(node, child)
                added += 1
                if approximate:
                    approx[key] = {bit: expiry}
            else:
                if child.parent is None and node is not None:
                    child.parent = node  # an orphan whose parent arrived later
                    self._adopt(node, child)
                child.ts = now
                held_before = child.mask & flag
                if not held_before:
                    child.mask |= flag
                    added += 1
                times = approx.get(key)
                if approximate:
                    if not held_before or (times is not None and bit in times):
                        if times is None:
                            approx[key] = {bit: expiry}
                        else:
                            times[bit] = expiry
                elif times is not None and times.pop(bit, None) is not None and not times:
                    del approx[key]  # exact now: it no longer expires
            node = child
        if node.children == 0:  # type: ignore[union-attr]
            self._link_newest(node)  # type: ignore[arg-type]
        self._held[bit] += added
        if approximate:
            self._approx_queue.append((expiry, bit, tuple(keys)))
        if self.max_blocks and len(nodes) > self.max_blocks:
            self._evict(len(nodes) - self.max_blocks)
        return added

    def _adopt(self, node: _Node, child: _Node) -> None:
        if node.children == 0:
            self._unlink(node)  # no longer a leaf
        node.children += 1

    def _drop(self, node: _Node, bit: int) -> None:
        """Remove one resident's hold on a node; delete the node (and empty ancestors) when
        nothing holds it and it has no children."""
        node.mask &= ~(1 << bit)
        self._held[bit] -= 1
        times = self._approx.get(node.key)
        if times is not None and times.pop(bit, None) is not None and not times:
            del self._approx[node.key]
        if node.mask == 0 and node.children == 0:
            self._delete(node)

    def _delete(self, node: _Node) -> None:
        while True:
            self._unlink(node)
            del self._nodes[node.key]
            parent = node.parent
            if parent is None:
                return
            parent.children -= 1
            if parent.children:
                return
            if parent.mask:
                self._link_oldest(parent)  # a leaf again; its recency went with its children
                return
            node = parent

    def remove(self, keys: Iterable[int], worker: str, kv_group: str) -> int:
        """The resident no longer holds these keys. Returns how many it held."""
        bit = self._bit_of.get(Resident(worker, kv_group))
        if bit is None:
            return 0
        flag = 1 << bit
        removed = 0
        for key in keys:
            node = self._nodes.get(key)
            if node is not None and node.mask & flag:
                self._drop(node, bit)
                removed += 1
        if self._held[bit] == 0:
            self._forget(bit)
        return removed

    def clear(self, worker: str, kv_group: str | None = None) -> int:
        """Drop everything a worker holds (in one kv_group, or in all). Walks the index."""
        bits = [
            bit
            for resident, bit in self._bit_of.items()
            if resident.worker == worker and kv_group in (None, resident.kv_group)
        ]
        if not bits:
            return 0
        mask = sum(1 << b for b in bits)
        held = [node for node in self._nodes.values() if node.mask & mask]
        removed = 0
        for node in held:  # a held node is never deleted before its last bit is dropped
            for bit in _bits(node.mask & mask):
                self._drop(node, bit)
                removed += 1
        for bit in bits:
            self._forget(bit)
        return removed

    def expire(self, now: float) -> int:
        """Drop approximate residency not confirmed within the TTL. Cheap when nothing is due."""
        queue = self._approx_queue
        approx = self._approx
        dropped = 0
        while queue and queue[0][0] <= now:
            _, bit, keys = queue.popleft()
            for key in reversed(keys):
                times = approx.get(key)
                if times is None:
                    continue
                expiry = times.get(bit)
                if expiry is None or expiry > now:
                    continue  # exact now, or confirmed again since
                self._drop(self._nodes[key], bit)
                dropped += 1
            resident = self._resident_of[bit]
            if resident is not None and self._held[bit] == 0:
                self._forget(bit)
        return dropped

    def _evict(self, count: int) -> None:
        head = self._lru
        while count > 0 and head.next is not head:
            node = head.next
            assert node is not None and node.children == 0
            for bit in _bits(node.mask):
                self._held[bit] -= 1
            self._approx.pop(node.key, None)
            node.mask = 0
            before = len(self._nodes)
            self._delete(node)
            deleted = before - len(self._nodes)
            self._evicted += deleted
            count -= deleted

    # -- reads -------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], kv_group: str, now: float | None = None) -> dict[str, int]:
        """Leading blocks of `keys` held by each worker of `kv_group` (workers with none are
        absent). With `now`, the deepest matched block counts as used (LRU)."""
        active = self._group_mask.get(kv_group, 0)
        if not active:
            return {}
        get = self._nodes.get
        matched: dict[str, int] = {}
        resident_of = self._resident_of
        depth = 0
        last = None
        for key in keys:
            node = get(key)
            if node is None:
                break
            held = active & node.mask
            if held != active:
                if depth:
                    for bit in _bits(active & ~held):
                        matched[resident_of[bit].worker] = depth  # type: ignore[union-attr]
                if not held:
                    active = 0
                    break
                active = held
            last = node
            depth += 1
        if depth:
            for bit in _bits(active):
                matched[resident_of[bit].worker] = depth  # type: ignore[union-attr]
        if now is not None and last is not None:
            last.ts = now
            if last.children == 0:
                self._link_newest(last)
        return matched

    def holds(self, key: int, worker: str, kv_group: str) -> bool:
        bit = self._bit_of.get(Resident(worker, kv_group))
        node = self._nodes.get(key)
        return bit is not None and node is not None and bool(node.mask >> bit & 1)

    def residency(self, worker: str, kv_group: str) -> set[int]:
        """Every key the resident holds. Walks the index: for tests and debugging."""
        bit = self._bit_of.get(Resident(worker, kv_group))
        if bit is None:
            return set()
        return {key for key, node in self._nodes.items() if node.mask >> bit & 1}

    def is_approximate(self, key: int, worker: str, kv_group: str) -> bool:
        bit = self._bit_of.get(Resident(worker, kv_group))
        times = self._approx.get(key)
        return bit is not None and times is not None and bit in times

    def last_confirmed(self, key: int) -> float | None:
        node = self._nodes.get(key)
        return None if node is None else node.ts

    def stats(self) -> IndexStats:
        return IndexStats(
            blocks=len(self._nodes),
            residencies=sum(self._held),
            approximate=sum(len(t) for t in self._approx.values()),
            residents=len(self._bit_of),
            evicted=self._evicted,
        )

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: int) -> bool:
        return key in self._nodes

    def check(self) -> None:
        """Integrity check (tests): counts, parent links and the leaf list agree."""
        children: dict[int, int] = {}
        held = [0] * len(self._held)
        for key, node in self._nodes.items():
            assert node.key == key
            if node.parent is not None:
                assert self._nodes.get(node.parent.key) is node.parent
                children[node.parent.key] = children.get(node.parent.key, 0) + 1
            for bit in _bits(node.mask):
                held[bit] += 1
        listed = set()
        cur = self._lru.next
        while cur is not self._lru:
            assert cur is not None and cur.children == 0 and cur.key not in listed
            listed.add(cur.key)
            cur = cur.next
        for key, node in self._nodes.items():
            assert node.children == children.get(key, 0), "child count"
            assert (node.children == 0) == (key in listed), "leaf list"
            assert node.mask or node.children, "empty leaf kept"
        assert held == self._held, "held counts"
        for key, times in self._approx.items():
            assert times and all(self._nodes[key].mask >> b & 1 for b in times)
