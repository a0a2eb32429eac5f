"""The unified index (docs/index.md): one compressed tree of block keys for the whole fleet; its
shape is router/run_tree.py, who holds each run router/residency.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Final, NamedTuple, cast

from core.scopes import runs_in_scope
from router.residency import ResidencyTree, _bits
from router.run_tree import Run

# seconds a prefix routed to a worker without KV events counts as held there
DEFAULT_APPROX_TTL_S: Final = 120.0
HOST_TIER = "@host"  # a kv_group's blocks in workers' host tiers are resident under this name


def host_group(kv_group: str) -> str:
    """The resident name of `kv_group`'s blocks held in a worker's host tier (docs/tiers.md):
    its own residency, beside the GPU tier's, in the one tree."""
    return kv_group + HOST_TIER


def _followed(chain: Sequence[int], boxed: Sequence[object], i: int, run: list[object]) -> int:
    """How many keys of `run` the chain follows from chain[i] (== run[0]). A key names its whole
    prefix (keys are chained, docs/block-keys.md): where the chain holds the run's key at an
    offset it holds every key before it, so one comparison finds a run followed to its end and a
    binary search where the chain leaves it (`boxed`: the chain, its keys as objects)."""
    last = min(len(run), len(chain) - i)  # keys of the run the chain could follow
    if boxed[i + last - 1] == run[last - 1]:
        return last
    lo, hi = 0, last - 1  # followed at offset lo, not at offset hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if boxed[i + mid] == run[mid]:
            lo = mid
        else:
            hi = mid
    return hi


class IndexStats(NamedTuple):
    blocks: int  # keys in the tree
    runs: int  # tree nodes (runs of blocks with one residency)
    residencies: int  # (block, resident) pairs
    approximate: int  # of which approximate (pending ones included)
    residents: int  # (worker, kv_group) pairs holding anything
    evicted: int  # blocks dropped by the memory budget so far
    pending: int = 0  # approximate residencies routed to an exact worker, not yet confirmed


class UnifiedIndex(ResidencyTree):
    """Residency of every block on every `(worker, kv_group)`; time is always an argument."""

    def __init__(
        self,
        max_blocks: int = 0,
        approx_ttl_s: float = DEFAULT_APPROX_TTL_S,
        pending_ttl_s: float = 10.0,
    ) -> None:
        if max_blocks < 0 or approx_ttl_s <= 0 or pending_ttl_s < 0:
            raise ValueError("max_blocks, pending_ttl_s must be >= 0 and approx_ttl_s > 0")
        super().__init__(max_blocks)
        self.approx_ttl_s = approx_ttl_s
        self.pending_ttl_s = pending_ttl_s  # 0: pending residency off (such inserts do nothing)
        # key that starts a salted namespace -> its salt (router/index_scopes.py finds by it)
        self.namespaces: dict[int, str] = {}
        self._host_names: dict[str, str] = {}  # kv_group -> host_group(kv_group), made once

    def tag_namespace(self, key: int, salt: str) -> None:
        """`key` starts the namespace of `salt`; tags of gone blocks are pruned now and then."""
        ns = self.namespaces
        if key in ns:
            return
        ns[key] = salt
        if len(ns) > 2 * len(self._where) + 8192:
            where = self._where
            recent = list(ns.items())[-4096:]  # perhaps not indexed yet: keep them
            self.namespaces = {k: v for k, v in ns.items() if k in where}
            self.namespaces.update(recent)

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
        """Mark a chain (keys[0] a child of `parent`, None: a root) held by the resident
        (docs/index.md); returns blocks newly held plus pending ones confirmed."""
        chain = keys if isinstance(keys, list) else list(keys)  # native indexing below
        n = len(chain)
        if n == 0 or pending and not self.pending_ttl_s:
            return 0
        bit = self._bit(worker, kv_group)
        flag = 1 << bit
        where, by_id = self._where, self._runs
        approximate = approximate or pending
        expiry = now + (self.pending_ttl_s if pending else self.approx_ttl_s)
        i = confirmed = added = 0
        prev = self._run_ending(parent)  # the run that ends with the parent of chain[i]
        boxed = cast(list[object], chain)  # keys stay objects (docs/compiled.md)
        while i < n:
            run = by_id.get(where.get(boxed[i], 0))
            if run is None:  # new blocks up to the next known key
                run = self._leaf_for(prev, flag, now)
                j = self._claim(chain, i, run)
                fresh = chain if i == 0 and j == n else chain[i:j]  # a new chain: no copy
                run.keys.extend(fresh)
                if approximate:
                    self._hold_approx(fresh, bit, expiry, pending, True)
                added += j - i
            else:
                run = self._enter(run, chain, i, prev, now)
                j = i + len(run.keys)
                if not run.mask & flag:
                    run.mask |= flag
                    added += j - i
                    if approximate:
                        self._hold_approx(run.keys, bit, expiry, pending, False)
                elif self._approx:
                    confirmed += self._confirm(run.keys, bit, expiry if approximate else None)
            i = j
            prev = run
        assert prev is not None
        if prev.children == 0:
            self._link_newest(prev)
        self._held[bit] += added
        if not pending:
            self._stored[bit] += added + confirmed
        if approximate:
            queue = self._pending_queue if pending else self._approx_queue
            queue.append((expiry, bit, tuple(chain)))
        self._evict()
        return added + confirmed

    def _run_ending(self, parent: int | None) -> Run | None:
        """The run that ends with `parent` (split there if it went on); None for a root."""
        if parent is None or (run := self._runs.get(self._where.get(parent, 0))) is None:
            return None
        at = len(run.keys) if run.keys[-1] == parent else run.keys.index(parent) + 1
        return self._split(run, at) if at < len(run.keys) else run

    def _leaf_for(self, prev: Run | None, flag: int, now: float) -> Run:
        """`prev` if a leaf only this resident holds (it grows in place), else a new run below."""
        if prev is not None and prev.children == 0 and prev.mask == flag:
            prev.ts = now
            return prev
        return self._new_run(prev, flag, now)

    def _enter(self, run: Run, chain: list[int], i: int, prev: Run | None, now: float) -> Run:
        """The known `run` holding chain[i], cut to what chain[i:] follows, under `prev`, used."""
        boxed = cast(list[object], chain)
        if run.keys[0] != boxed[i]:  # entering mid-run (its parent was unknown to us)
            self._split(run, cast(list[object], run.keys).index(boxed[i]))
        m = _followed(chain, boxed, i, cast(list[object], run.keys))
        if m < len(run.keys):
            run = self._split(run, m)
        if run.parent is None and prev is not None and not self._descends(prev, run):
            run.parent = prev  # an orphan whose parent arrived later (not a malformed
            self._adopt(prev)  # chain that loops back to one of its own ancestors)
        run.ts = now
        return run

    def _hold_approx(
        self, keys: list[int], bit: int, expiry: float, pending: bool, fresh: bool
    ) -> None:
        """Mark keys approximate (and pending) until `expiry`; `fresh`: new to the index."""
        approx, flag = self._approx, 1 << bit
        if fresh:
            for key in keys:
                approx[key] = {bit: expiry}
            if pending:
                self._pending.update(dict.fromkeys(keys, flag))
            return
        for key in keys:
            approx[key] = {**approx.get(key, {}), bit: expiry}
        if pending:
            marks = self._pending
            for key in keys:
                marks[key] = marks.get(key, 0) | flag

    def match(self, keys: Sequence[int], kv_group: str, now: float | None = None) -> dict[str, int]:
        """Leading blocks of `keys` held by each worker of `kv_group` holding any; with `now`,
        the deepest matched run counts as used."""
        active = self._group_mask.get(kv_group, 0)
        n = len(keys)
        if not active or not n:
            return {}
        where, by_id, resident_of = self._where, self._runs, self._resident_of
        matched: dict[str, int] = {}
        depth = 0
        boxed = cast(Sequence[object], keys)  # keys stay objects (docs/compiled.md)
        last = None
        run = by_id.get(where.get(boxed[0], 0))  # 0: no object's id
        while run is not None:
            run_keys = cast(list[object], run.keys)
            if run_keys[0] != boxed[depth]:
                break  # the key sits mid-run on another path (an orphan's parent was missing)
            size = len(run_keys)
            m = _followed(keys, boxed, depth, run_keys)
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

    def host_match(
        self, keys: Sequence[int], kv_group: str, matched: dict[str, int]
    ) -> dict[str, int] | None:
        """For each worker with a host tier for `kv_group`: the keys right after its GPU match
        (`matched`, from `match`) it holds in its host tier, in a row (docs/tiers.md). None, at
        the cost of two dict reads, when no worker of the group has a host tier."""
        host = self._host_names.get(kv_group)
        if host is None:  # the name is made once: a concatenation per request costs
            host = self._host_names[kv_group] = host_group(kv_group)
        mask = self._group_mask.get(host, 0)
        if not mask:
            return None
        found: dict[str, int] = {}
        resident_of = self._resident_of
        for bit in _bits(mask):
            worker = resident_of[bit].worker  # type: ignore[union-attr]
            held = self._held_from(keys, matched.get(worker, 0), bit)
            if held:
                found[worker] = held
        return found

    def _held_from(self, keys: Sequence[int], start: int, bit: int) -> int:
        """How many keys of the chain from `start` on the resident `bit` holds, in a row."""
        flag = 1 << bit
        where, by_id = self._where, self._runs
        boxed = cast(Sequence[object], keys)  # keys stay objects (docs/compiled.md)
        n = len(keys)
        i = start
        while i < n:
            run = by_id.get(where.get(boxed[i], 0))
            if run is None or not run.mask & flag:
                break
            run_keys = cast(list[object], run.keys)
            if run_keys[0] != boxed[i]:
                break  # mid-run on another path (an orphan's parent was missing)
            # a run that goes elsewhere: the next key may head one (an orphan's)
            i += _followed(keys, boxed, i, run_keys)
        return i - start

    def holds(self, key: int, worker: str, kv_group: str) -> bool:
        bit = self._find(worker, kv_group)
        run = self.run_of(key)
        return bit is not None and run is not None and bool(run.mask >> bit & 1)

    def residency(self, worker: str, kv_group: str) -> set[int]:
        """Every key the resident holds (walks the runs: tests, debugging)."""
        bit = self._find(worker, kv_group)
        if bit is None:
            return set()
        return {key for run in self._runs.values() if run.mask >> bit & 1 for key in run.keys}

    def exported(self, worker: str, kv_group: str) -> list[tuple[int | None, list[int]]]:
        """What the resident holds exactly (approximate marks left out) as chains `(parent,
        keys)`, each parent's chain before its children's: inserted in this order into another
        index they give the resident there the same residency (router/kv_delta.py)."""
        bit = self._find(worker, kv_group)
        if bit is None:
            return []
        flag = 1 << bit
        approx = self._approx
        held: list[tuple[int, Run]] = []
        for run in self._runs.values():
            if run.mask & flag:
                depth, up = 0, run.parent
                while up is not None:
                    depth, up = depth + 1, up.parent
                held.append((depth, run))
        held.sort(key=lambda pair: pair[0])
        chains: list[tuple[int | None, list[int]]] = []
        for _, run in held:
            parent = run.parent.keys[-1] if run.parent is not None else None
            chain: list[int] = []
            for key in run.keys:
                if approx and bit in approx.get(key, ()):  # held approximately only
                    if chain:
                        chains.append((parent, chain))
                        chain = []
                    parent = key
                else:
                    chain.append(key)
            if chain:
                chains.append((parent, chain))
        return chains

    def runs_in(self, scope: Callable[[str], bool] | None) -> list[Run]:
        """The runs in a namespace whose salt passes `scope` (None: every run), for scoped
        invalidation (router/index_scopes.py); a run a namespace starts inside is split there."""
        if scope is None:
            return list(self._runs.values())
        return runs_in_scope(self.run_of, self.namespaces, self._split, self._runs.values(), scope)

    def release(self, runs: Iterable[Run], kv_group: str | None = None) -> int:
        """Drop the holds of `kv_group`'s residents (None: every resident) on `runs`; a resident
        left holding nothing is forgotten. Returns the block residencies dropped."""
        if kv_group is None:
            mask = sum(1 << bit for groups in self._bit_of.values() for bit in groups.values())
        else:
            mask = self._group_mask.get(kv_group, 0)
        dropped, touched = self._release_runs(runs, mask)
        for bit in _bits(touched):
            if self._resident_of[bit] is not None and self._held[bit] == 0:
                self._forget(bit)
        return dropped

    def confirmed_depth(self, keys: Sequence[int], worker: str, kv_group: str, depth: int) -> int:
        """How many of the first `depth` keys lead before one the resident holds only pending."""
        bit = self._find(worker, kv_group)
        pending = self._pending
        if not pending or bit is None:
            return depth
        for i in range(depth):
            if pending.get(keys[i], 0) >> bit & 1:
                return i
        return depth

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
        """Integrity check (tests): the tree, held counts, approximate and pending marks agree."""
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
