"""The compressed tree under the unified index (docs/index.md): runs of chained block keys, with
the leaf runs in an intrusive LRU list (oldest at the head) so that eviction never scans."""

from __future__ import annotations

from typing import cast

from core.key_table import KeyMap, KeyTable


class Run:
    __slots__ = ("keys", "parent", "mask", "children", "ts", "prev", "next")

    def __init__(self, keys: list[int], parent: Run | None, mask: int, ts: float) -> None:
        self.keys = keys  # consecutive chained keys: keys[i] is the parent block of keys[i + 1]
        self.parent = parent  # the run whose last key is the parent of keys[0]
        self.mask = mask  # bit i set: resident i holds every block of the run
        self.children = 0
        self.ts = ts
        self.prev: Run | None = None  # LRU leaf list links; None when not a listed leaf
        self.next: Run | None = None


class RunTree:
    """Runs by key, parent links, child counts and the LRU leaf list."""

    def __init__(self) -> None:
        # every key -> id() of its run, in a C table of uint64s (core/key_table.py): one probe
        # per key and a chain's keys in one call; nothing the garbage collector walks
        self._where: KeyMap = KeyTable()
        self._runs: dict[object, Run] = {}  # id(run) -> run
        self._lru = Run([], None, 0, 0.0)  # sentinel: .next is the oldest leaf, .prev the newest
        self._lru.prev = self._lru.next = self._lru

    def run_of(self, key: int) -> Run | None:
        return self._runs.get(self._where.get(key, 0))  # 0: no object's id

    def _unlink(self, run: Run) -> None:
        if run.prev is not None:
            run.prev.next = run.next
            run.next.prev = run.prev  # type: ignore[union-attr]
            run.prev = run.next = None

    def _link_newest(self, run: Run) -> None:
        self._unlink(run)
        head = self._lru
        run.prev, run.next = head.prev, head
        head.prev.next = run  # type: ignore[union-attr]
        head.prev = run

    def _link_oldest(self, run: Run) -> None:
        head = self._lru
        run.prev, run.next = head, head.next
        head.next.prev = run  # type: ignore[union-attr]
        head.next = run

    def _register(self, run: Run) -> Run:
        """List `run` and map its keys to it."""
        rid: object = id(run)
        self._where.assign(cast(list[object], run.keys), rid)
        self._runs[rid] = run
        return run

    def _new_run(self, parent: Run | None, mask: int, now: float) -> Run:
        """A new empty run under `parent`; `_claim` gives it its keys."""
        run = self._register(Run([], parent, mask, now))
        if parent is not None:
            self._adopt(parent)
        return run

    def _claim(self, keys: list[int], i: int, run: Run) -> int:
        """Map keys[i:] to `run` up to the first key mapped already (one probe per
        key, in one call); returns where it stopped. The caller appends keys[i:stop] to
        `run.keys`."""
        return self._where.claim(cast(list[object], keys), i, id(run))

    @staticmethod
    def _descends(run: Run | None, ancestor: Run) -> bool:
        """Whether `run` is `ancestor` or below it (walks up: for rare repairs only)."""
        while run is not None:
            if run is ancestor:
                return True
            run = run.parent
        return False

    def _adopt(self, parent: Run) -> None:
        if parent.children == 0:
            self._unlink(parent)  # no longer a leaf
        parent.children += 1

    def _split(self, run: Run, at: int) -> Run:
        """Cut `run` before keys[at]: a new head run takes keys[:at] and `run` keeps the rest,
        so the children's parent links stay valid. Returns the head."""
        head = self._register(Run(run.keys[:at], run.parent, run.mask, run.ts))
        del run.keys[:at]
        head.children = 1
        run.parent = head
        return head

    def _cut_tail(self, run: Run, n: int) -> Run:
        """`_split(run, len(run.keys) - n)`, returning the tail of `n` keys; a leaf's shorter
        tail becomes the new run instead (fewer keys to re-map; it takes the leaf's LRU place)."""
        at = len(run.keys) - n
        if run.children or n >= at:
            self._split(run, at)
            return run
        tail = self._register(Run(run.keys[at:], run, run.mask, run.ts))
        del run.keys[at:]
        tail.prev, tail.next = run.prev, run.next
        tail.prev.next = tail.next.prev = tail  # type: ignore[union-attr]
        run.prev = run.next = None
        run.children = 1
        return tail

    def _delete(self, run: Run) -> None:
        """Delete an empty leaf run, and its ancestors that become empty leaves."""
        while True:
            self._unlink(run)
            del self._runs[id(run)]
            self._where.discard(cast(list[object], run.keys))
            parent = run.parent
            if parent is None:
                return
            parent.children -= 1
            if parent.children:
                return
            if parent.mask:
                self._link_oldest(parent)  # a leaf again; its recency went with its children
                return
            run = parent

    def _check_tree(self) -> int:
        """Integrity check (tests): keys, runs, parent links, child counts and the leaf list
        agree. Returns the number of blocks."""
        children: dict[int, int] = {}
        blocks = 0
        for run in self._runs.values():
            assert run.keys, "empty run"
            blocks += len(run.keys)
            assert all(self._where[k] == id(run) for k in run.keys), "key map"
            if run.parent is not None:
                assert self._runs.get(id(run.parent)) is run.parent, "dangling parent"
                children[id(run.parent)] = children.get(id(run.parent), 0) + 1
        assert blocks == len(self._where), "stray keys"
        listed = set()
        cur = self._lru.next
        while cur is not self._lru:
            assert cur is not None and cur.children == 0 and id(cur) not in listed
            listed.add(id(cur))
            cur = cur.next
        for run in self._runs.values():
            assert run.children == children.get(id(run), 0), "child count"
            assert (run.children == 0) == (id(run) in listed), "leaf list"
            assert run.mask or run.children, "empty leaf kept"
        return blocks
