"""The emulated worker's KV cache: a radix tree of blocks in a pool of `capacity_tokens` tokens.

As in SGLang's radix cache, but block-granular and keyed by the gateway's own block keys
(core/blocks.py): a block's key IS its identity here and the hash in the KV events it
publishes, so the gateway's mirror maps it by identity. Keys are chained, so a key names its
whole prefix and the cached keys of a prompt always form a prefix of its chain.

The tree is compressed: a node (`Run`) is a run of consecutive blocks; `_heads` maps the first
key of every run to the run, so matching costs one dict lookup and one list comparison per run,
and storing or evicting a run one dict operation, whatever its length. Chained keys make that
enough: a lookup always starts right after a run's last key, so it finds a run's first key or
nothing. A namespace that starts inside new blocks starts a run of its own, so that scoped
invalidation finds it by its first key too.

Every token of the pool is in exactly one of four states (`check` asserts it):

    free         in no one's hands
    evictable    cached in a run no request locks (lock_ref == 0)
    protected    cached in a run some request locks (on the path of a locked node)
    allocated    private to a request (not in the tree): computed KV not yet inserted

Locks walk to the root, so every ancestor of a locked run is locked and all evictable tokens
can be reached by evicting leaves. Eviction runs only inside `allocate`, only for the shortfall,
oldest unlocked leaf first, from the tail of that leaf's run. Recency is a logical tick,
bumped by `match`, `insert` and `unlock`, that stamps the path used. The unlocked leaves sit in
an intrusive doubly linked list in stamp order, never found by scanning the tree: a leaf used
or unlocked takes the newest tick, so it moves to the newest end; only a parent left a leaf
by an eviction keeps an older stamp, and it goes in before the first newer leaf (at the
oldest end, unless it was used after its last child). No two leaves share a stamp (one tick
stamps one path), so the order is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

# (parent key or None for a root block, keys, token ids of exactly those blocks or None, salt)
StoredCallback = Callable[[int | None, list[int], list[int] | None, str | None], None]
RemovedCallback = Callable[[list[int]], None]


class Run:
    """A node of the tree: consecutive blocks that share a parent chain and a lock count."""

    __slots__ = ("keys", "parent", "children", "lock_ref", "stamp", "alive", "prev", "next")

    def __init__(self, keys: list[int], parent: Run | None, lock_ref: int, stamp: int) -> None:
        self.keys = keys  # keys[i] is the parent block of keys[i + 1]
        self.parent = parent
        self.children = 0
        self.lock_ref = lock_ref
        self.stamp = stamp  # the tick of the last use: LRU order of leaves
        self.alive = True
        self.prev: Run | None = None  # LRU list links; None when not a listed leaf
        self.next: Run | None = None

    @property
    def last_key(self) -> int | None:
        return self.keys[-1] if self.keys else None


# results are plain classes, not NamedTuples: compiled, they are built and read natively
class MatchResult:
    __slots__ = ("node", "blocks")

    def __init__(self, node: Run, blocks: int) -> None:
        self.node = node  # the run that ends exactly at the match (the root when nothing matched)
        self.blocks = blocks  # matched blocks; safe to use only while `node` is locked


class InsertResult:
    __slots__ = ("node", "cached_blocks", "new_blocks")

    def __init__(self, node: Run, cached_blocks: int, new_blocks: int) -> None:
        self.node = node  # the run that ends exactly at the last inserted key
        self.cached_blocks = cached_blocks  # offered blocks cached already (their copy is freed)
        self.new_blocks = new_blocks  # blocks added to the tree


class CacheStats(NamedTuple):
    capacity_tokens: int
    free_tokens: int
    evictable_tokens: int
    protected_tokens: int
    allocated_tokens: int
    cached_blocks: int
    runs: int
    stored_blocks: int  # ever added to the tree
    evicted_blocks: int  # ever evicted


def _head(tokens: list[int] | None, cut: int | None) -> list[int] | None:
    return None if tokens is None else tokens[:cut]


def _tail(tokens: list[int] | None, cut: int | None) -> list[int] | None:
    return None if tokens is None else tokens[cut:]


class RadixCache:
    """Blocks of `block_size` tokens in a pool of `capacity_tokens` tokens (rounded down to
    whole blocks). `on_stored` / `on_removed` hear every change to the set of cached keys, in
    order: exactly what a KV event stream must say."""

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int = 16,
        *,
        on_stored: StoredCallback | None = None,
        on_removed: RemovedCallback | None = None,
    ) -> None:
        if block_size <= 0 or capacity_tokens < block_size:
            raise ValueError("need block_size > 0 and capacity_tokens >= block_size")
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens // block_size * block_size
        self.on_stored = on_stored
        self.on_removed = on_removed
        self.root = Run([], None, 1, 0)  # never evicted: lock_ref stays >= 1
        # first key of a run -> the run; keys read as `object`s stay boxed (docs/compiled.md)
        self._heads: dict[object, Run] = {}
        self._blocks = 0  # blocks in the tree
        self._runs: set[Run] = set()
        self._lru = Run([], None, 0, -1)  # sentinel: .next is the oldest unlocked leaf
        self._lru.prev = self._lru.next = self._lru
        self._tick = 0
        self.free_tokens = self.capacity_tokens
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.allocated_tokens = 0
        self.stored_blocks = 0
        self.evicted_blocks = 0
        # key that starts a salted namespace -> its salt (may name evicted keys; see scopes.py)
        self.namespaces: dict[int, str] = {}
        self.next_tombstone = -1  # invalidated locked runs are re-keyed below zero

    # -- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._blocks

    def starts_run(self, key: int) -> bool:
        """Whether a cached run starts at `key`: where a cached prefix that ends right before
        `key` goes on, if it does (chained keys)."""
        return key in self._heads

    def keys(self) -> set[int]:
        """Every cached key (walks the runs)."""
        return {key for run in self._runs for key in run.keys}

    def runs(self) -> list[Run]:
        return list(self._runs)

    def stats(self) -> CacheStats:
        return CacheStats(
            self.capacity_tokens,
            self.free_tokens,
            self.evictable_tokens,
            self.protected_tokens,
            self.allocated_tokens,
            self._blocks,
            len(self._runs),
            self.stored_blocks,
            self.evicted_blocks,
        )

    @property
    def used_tokens(self) -> int:
        return self.capacity_tokens - self.free_tokens

    def match(self, keys: list[int], max_blocks: int | None = None) -> MatchResult:
        """The longest cached prefix of `keys` (at most `max_blocks` blocks), as a run that ends
        exactly there (a run is split if the match ends inside it). Marks the path used; the
        blocks are safe to use only once `lock(result.node)` is held."""
        limit = len(keys) if max_blocks is None else min(max_blocks, len(keys))
        self._tick += 1
        node, matched = self._descend(self.root, keys, 0, limit)
        return MatchResult(node, matched)

    def _descend(self, node: Run, keys: list[int], i: int, limit: int) -> tuple[Run, int]:
        """Follow keys[i:limit] down from `node` (whose last key is the parent of keys[i]).
        Returns the run that ends exactly at the match and the index past it."""
        heads = self._heads
        tick = self._tick
        boxed = cast(list[object], keys)
        while i < limit:
            run = heads.get(boxed[i])
            if run is None:
                break
            run_keys = cast(list[object], run.keys)
            size = len(run_keys)
            if i + size <= limit and boxed[i + size - 1] == run_keys[-1]:
                m = size
            else:
                # chained keys: equal at depth m means equal up to m, so bisect the match
                lo, hi = 1, min(size, limit - i)  # keys[i] == run_keys[0] holds
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if boxed[i + mid - 1] == run_keys[mid - 1]:
                        lo = mid
                    else:
                        hi = mid - 1
                m = lo
                if m < size:
                    run = self._split(run, m)
            run.stamp = tick
            node = run
            i += m
            if m < size:
                break
        if node.prev is not None:  # an unlocked leaf used: now the newest
            self._unlink(node)
            self._link_newest(node)
        return node, i

    def _split(self, run: Run, at: int) -> Run:
        """Cut `run` after `at` blocks; returns the new head. The tail keeps the identity of
        `run` (requests holding it still end there) and its place in the LRU list."""
        head = Run(run.keys[:at], run.parent, run.lock_ref, run.stamp)
        head.children = 1
        del run.keys[:at]
        self._heads[cast(list[object], head.keys)[0]] = head
        self._heads[cast(list[object], run.keys)[0]] = run
        run.parent = head
        self._runs.add(head)
        return head

    # -- locks -------------------------------------------------------------------------------

    def lock(self, node: Run) -> None:
        """Protect `node` and its ancestors from eviction (counted: lock as often as unlock)."""
        bs = self.block_size
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                tokens = len(node.keys) * bs
                self.evictable_tokens -= tokens
                self.protected_tokens += tokens
                if node.prev is not None:
                    self._unlink(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Run) -> None:
        """Release one lock of `node` and its ancestors; the path counts as used now."""
        bs = self.block_size
        root = self.root
        self._tick += 1
        tick = self._tick
        while node is not root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            node.stamp = tick
            if node.lock_ref == 0:
                tokens = len(node.keys) * bs
                self.evictable_tokens += tokens
                self.protected_tokens -= tokens
                if node.children == 0:
                    self._link_newest(node)
            node = node.parent  # type: ignore[assignment]

    def move_lock(self, node: Run, down_to: Run) -> None:
        """`lock(down_to)` then `unlock(node)`, for `down_to` at or below the locked `node`: one
        walk. `node`'s path stays locked (only used now), so nothing becomes evictable."""
        bs = self.block_size
        while down_to is not node:
            if down_to.lock_ref == 0:
                tokens = len(down_to.keys) * bs
                self.evictable_tokens -= tokens
                self.protected_tokens += tokens
                if down_to.prev is not None:
                    self._unlink(down_to)
            down_to.lock_ref += 1
            down_to = down_to.parent  # type: ignore[assignment]
        root = self.root
        self._tick += 1
        tick = self._tick
        while node is not root:
            assert node.lock_ref > 0, "unlock without lock"
            node.stamp = tick
            node = node.parent  # type: ignore[assignment]

    # -- room --------------------------------------------------------------------------------

    def can_allocate(self, tokens: int) -> bool:
        return tokens <= self.free_tokens + self.evictable_tokens

    def allocate(self, tokens: int) -> bool:
        """Take `tokens` of private room, evicting unlocked leaves for the shortfall only.
        False (and nothing evicted) when even evicting everything unlocked would not do."""
        if tokens <= self.free_tokens:
            self.free_tokens -= tokens
            self.allocated_tokens += tokens
            return True
        if tokens > self.free_tokens + self.evictable_tokens:
            return False
        shortfall = tokens - self.free_tokens
        self._evict(-(-shortfall // self.block_size))
        self.free_tokens -= tokens
        self.allocated_tokens += tokens
        return True

    def free(self, tokens: int) -> None:
        """Give back private room."""
        assert 0 <= tokens <= self.allocated_tokens, "freeing more than allocated"
        self.allocated_tokens -= tokens
        self.free_tokens += tokens

    # -- insert ------------------------------------------------------------------------------

    def insert(
        self,
        parent: Run,
        keys: list[int],
        tokens: Sequence[int] | None = None,
        salt: str | None = None,
        salt_at: int | None = None,
    ) -> InsertResult:
        """Cache blocks `keys` (keys[0] a child of `parent`'s last key; `parent` must be locked
        or the root) whose KV the caller computed in its allocated room. Blocks cached meanwhile
        by someone else are matched instead and their private copy is freed:

            [0, cached_blocks)         already in the tree: our allocated room is freed
            [cached_blocks, len(keys)) added as a new leaf run: allocated -> evictable

        `tokens` (exactly the blocks' token ids; not to be changed after) only travel to
        `on_stored`. `salt` is the namespace of the blocks: it travels with a root block, or
        with keys[salt_at] when a public prefix ends before it (core/blocks.py; None: the salt
        starts at the root), and scoped
        invalidation finds the namespace by it. Under an invalidated run nothing is cached."""
        n = len(keys)
        bs = self.block_size
        assert self.allocated_tokens >= n * bs, "insert needs its tokens allocated first"
        self._tick += 1
        if parent.keys and parent.keys[-1] < 0:  # an invalidated run: cache nothing under it
            self.allocated_tokens -= n * bs
            self.free_tokens += n * bs
            return InsertResult(parent, n, 0)
        # all new (the common case): nothing to follow
        if n and cast(list[object], keys)[0] not in self._heads:
            node, i = parent, 0
        else:
            node, i = self._descend(parent, keys, 0, n)
        self.allocated_tokens -= n * bs
        self.free_tokens += i * bs  # our copy of blocks cached meanwhile
        if i < n:
            fresh = keys[i:]
            # where in `fresh` the salt's namespace starts, if it does (None: at the root)
            at = (0 if node is self.root else -1) if salt_at is None else salt_at - i
            public = bool(salt) and 0 < at < len(fresh)  # a public prefix, then the rest
            parent_key = node.last_key
            if public:  # the namespace starts a run of its own (the module doc)
                run = self._add_run(self._add_run(node, fresh[:at]), fresh[at:])
            else:
                run = self._add_run(node, fresh[:])  # the run's list changes; events' must not
            self._link_newest(run)
            if salt and 0 <= at < len(fresh):
                self._note_namespace(fresh[at], salt)
            if self.on_stored is not None:
                block_tokens = None
                if tokens is not None:  # handed on, not copied, when all of it is new
                    part = tokens[i * bs : n * bs] if i else tokens
                    block_tokens = part if type(part) is list else list(part)
                if not public:
                    self.on_stored(parent_key, fresh, block_tokens, salt if at == 0 else None)
                else:  # two events, as keyed
                    cut = None if block_tokens is None else at * bs
                    self.on_stored(parent_key, fresh[:at], _head(block_tokens, cut), None)
                    self.on_stored(fresh[at - 1], fresh[at:], _tail(block_tokens, cut), salt)
            node = run
        return InsertResult(node, i, n - i)

    def _add_run(self, parent: Run, keys: list[int]) -> Run:
        """A new run of blocks under `parent`, computed in allocated room: now evictable."""
        first = cast(list[object], keys)[0]
        assert first not in self._heads, "block key collision"
        run = Run(keys, parent, 0, self._tick)
        self._heads[first] = run
        if parent.prev is not None:  # an unlocked leaf (cached meanwhile) is one no longer
            self._unlink(parent)
        parent.children += 1
        self._runs.add(run)
        self._blocks += len(keys)
        self.evictable_tokens += len(keys) * self.block_size
        self.stored_blocks += len(keys)
        return run

    def _note_namespace(self, key: int, salt: str) -> None:
        """`key` starts the namespace of `salt`; notes of evicted keys are pruned now and then."""
        namespaces = self.namespaces
        namespaces[key] = salt
        if len(namespaces) > 2 * self._blocks + 8192:
            heads = self._heads
            self.namespaces = {k: s for k, s in namespaces.items() if k in heads}

    # -- eviction ----------------------------------------------------------------------------

    def _unlink(self, run: Run) -> None:
        run.prev.next = run.next  # type: ignore[union-attr]
        run.next.prev = run.prev  # type: ignore[union-attr]
        run.prev = run.next = None

    def _link_newest(self, run: Run) -> None:
        """List an unlocked leaf that holds the newest tick."""
        head = self._lru
        run.prev, run.next = head.prev, head
        head.prev.next = run  # type: ignore[union-attr]
        head.prev = run

    def _link_by_stamp(self, run: Run) -> None:
        """List a run that became an unlocked leaf under an older stamp, in stamp order."""
        head = self._lru
        if run.stamp > head.prev.stamp:  # type: ignore[union-attr]
            self._link_newest(run)
            return
        after = head
        while after.next is not head and after.next.stamp < run.stamp:  # type: ignore[union-attr]
            after = after.next  # type: ignore[assignment]
        run.prev, run.next = after, after.next
        after.next.prev = run  # type: ignore[union-attr]
        after.next = run

    def _evict(self, blocks: int) -> None:
        """Drop `blocks` blocks from the tails of the least recently used unlocked leaves."""
        lru = self._lru
        bs = self.block_size
        removed: list[int] = []
        while blocks > 0:
            run = lru.next
            assert run is not None and run is not lru, "evictable count out of step with leaves"
            run_keys = run.keys
            take = min(blocks, len(run_keys))
            gone = run_keys[len(run_keys) - take :]
            gone.reverse()  # deepest first
            removed.extend(gone)
            if take == len(run_keys):
                del self._heads[cast(list[object], run_keys)[0]]
                self._unlink(run)
                run.alive = False
                run.keys = []
                self._runs.discard(run)
                parent = run.parent
                assert parent is not None
                parent.children -= 1
                if parent is not self.root and parent.children == 0 and parent.lock_ref == 0:
                    self._link_by_stamp(parent)
            else:
                del run_keys[-take:]
            self._blocks -= take
            self.evictable_tokens -= take * bs
            self.free_tokens += take * bs
            blocks -= take
        self.evicted_blocks += len(removed)
        if self.next_tombstone != -1:  # invalidated runs were announced removed already
            removed = [k for k in removed if k >= 0]
        if self.on_removed is not None and removed:
            self.on_removed(removed)

    # -- integrity ---------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants (tests call it after every step): token states add up to the
        capacity, counts match the runs, keys map to live runs, unlocked leaves are queued."""
        bs = self.block_size
        assert self.free_tokens >= 0 and self.allocated_tokens >= 0
        assert (
            self.free_tokens + self.evictable_tokens + self.protected_tokens + self.allocated_tokens
            == self.capacity_tokens
        ), "free + evictable + protected + allocated != capacity"
        children: dict[Run, int] = {}
        locks: dict[Run, int] = {}
        evictable = protected = blocks = 0
        for run in self._runs:
            assert run.alive and run.keys, "dead or empty run listed"
            assert self._heads[run.keys[0]] is run, "head map out of step"
            parent = run.parent
            assert parent is not None and (parent is self.root or parent in self._runs)
            children[parent] = children.get(parent, 0) + 1
            locks[parent] = locks.get(parent, 0) + run.lock_ref
            blocks += len(run.keys)
            if run.lock_ref:
                protected += len(run.keys) * bs
            else:
                evictable += len(run.keys) * bs
        assert blocks == self._blocks and len(self._heads) == len(self._runs), "stray heads"
        assert evictable == self.evictable_tokens, "evictable count"
        assert protected == self.protected_tokens, "protected count"
        listed: set[int] = set()
        at = self._lru.next
        stamp = -1
        while at is not self._lru:
            assert at is not None and id(at) not in listed, "LRU list loops"
            assert at.stamp > stamp, "LRU list out of stamp order"
            assert at.alive and at.children == 0 and at.lock_ref == 0, "listed, not a leaf"
            assert at.next is not None and at.next.prev is at, "LRU links"
            listed.add(id(at))
            stamp = at.stamp
            at = at.next
        for run in self._runs:
            assert run.children == children.get(run, 0), "children count"
            assert run.lock_ref >= locks.get(run, 0), "a locked run under an unlocked one"
            evictable_leaf = run.children == 0 and run.lock_ref == 0
            assert evictable_leaf == (id(run) in listed), "LRU list != unlocked leaves"
        assert self.root.children == children.get(self.root, 0), "root children count"
