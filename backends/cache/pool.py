"""The room of the radix cache (radix.py): a pool of tokens, or of pages, and eviction. Every
token of the pool is in exactly one of four states (check.py asserts it):

    free         in no one's hands
    evictable    cached in a run no request locks (lock_ref == 0)
    protected    cached in a run some request locks (on the path of a locked node)
    allocated    private to a request (not in a tree): computed KV not yet inserted

Eviction frees only the shortfall of an `allocate`, from the oldest unlocked leaf of any tree."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from backends.cache.nodes import Run, Tree

RemovedCallback = Callable[[str, list[int]], None]  # (kv_group, keys)
# (run, keep): eviction is about to drop run.keys[keep:] (their pages still hold their KV)
EvictCallback = Callable[[Run, int], None]


class Pool:
    """`capacity_tokens` tokens in blocks of `block_size` (rounded down to whole blocks);
    `page_ids`, one per block, make it paged (`allocate_pages`, eviction takes them back)."""

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int,
        page_ids: list[int] | None,
        on_removed: RemovedCallback | None,
    ) -> None:
        if block_size <= 0 or capacity_tokens < block_size:
            raise ValueError("need block_size > 0 and capacity_tokens >= block_size")
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens // block_size * block_size
        if page_ids is not None and len(page_ids) * block_size != self.capacity_tokens:
            raise ValueError("a paged cache needs one page id per block of its capacity")
        self.page_ids = None if page_ids is None else list(page_ids)  # the free pages: a stack
        self.on_removed = on_removed
        self.on_evict: EvictCallback | None = None  # a host tier demotes what eviction drops
        self.free_tokens = self.capacity_tokens
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.allocated_tokens = 0
        self._blocks = 0  # blocks in all trees
        self.evicted_blocks = 0
        self._lru = Run([], None, 0, -1, Tree(""))  # sentinel: .next is the oldest unlocked leaf
        self._lru.prev = self._lru.next = self._lru
        self.next_tombstone = -1  # invalidated locked runs are re-keyed below zero

    def can_allocate(self, tokens: int) -> bool:
        return tokens <= self.free_tokens + self.evictable_tokens

    def allocate(self, tokens: int) -> bool:
        """Take `tokens` of private room, evicting unlocked leaves for the shortfall only.
        False (and nothing evicted) when even evicting everything unlocked would not do."""
        if tokens > self.free_tokens:
            if tokens > self.free_tokens + self.evictable_tokens:
                return False
            self._evict(-(-(tokens - self.free_tokens) // self.block_size))  # the shortfall
        self.free_tokens -= tokens
        self.allocated_tokens += tokens
        return True

    def free(self, tokens: int) -> None:
        """Give back private room."""
        assert 0 <= tokens <= self.allocated_tokens, "freeing more than allocated"
        self.allocated_tokens -= tokens
        self.free_tokens += tokens

    def allocate_pages(self, n: int) -> list[int] | None:
        """`allocate` of `n` whole pages, and their ids (a paged cache); None as False."""
        free = self.page_ids
        assert free is not None, "a cache without pages"
        if not self.allocate(n * self.block_size):
            return None
        pages = free[len(free) - n :]
        del free[len(free) - n :]
        return pages

    def free_pages(self, pages: list[int]) -> None:
        """Give back private pages (never pages that are in a tree)."""
        assert self.page_ids is not None, "a cache without pages"
        self.free(len(pages) * self.block_size)
        self.page_ids.extend(pages)

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
        """List a run that became an unlocked leaf under an older stamp (a parent left a leaf by
        an eviction) in stamp order: one tick stamps one path, so no two leaves share one."""
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

    def _relist(self, run: Run) -> None:
        """List `run` if it has just become an unlocked leaf."""
        if run.parent is None or run.prev is not None or not run.alive:
            return  # a root, listed already, or gone
        if run.children == 0 and run.lock_ref == 0:
            self._link_by_stamp(run)

    def _evict(self, blocks: int) -> None:
        """Drop `blocks` blocks from the tails of the least recently used unlocked leaves."""
        lru = self._lru
        removed: list[int] = []
        tree: Tree | None = None
        while blocks > 0:
            run = lru.next
            assert run is not None and run is not lru, "evictable count out of step with leaves"
            if run.tree is not tree:  # one BlockRemoved per stretch of one kv_group
                if tree is not None:
                    self._removed(tree, removed)
                tree, removed = run.tree, []
            run_keys = run.keys
            take = min(blocks, len(run_keys))
            gone = run_keys[len(run_keys) - take :]
            gone.reverse()  # deepest first
            removed.extend(gone)
            parent = run.parent
            assert parent is not None
            if self.on_evict is not None:
                self.on_evict(run, len(run_keys) - take)
            self._cut_tail(run, take)
            self._relist(parent)
            blocks -= take
        if tree is not None:
            self._removed(tree, removed)

    def _cut_tail(self, run: Run, take: int) -> None:
        """Free the last `take` blocks of an unlocked run (all of them: the run goes)."""
        bs = self.block_size
        tree = run.tree
        keys = run.keys
        keep = len(keys) - take
        pages = run.pages
        if pages is not None:
            free = self.page_ids
            assert free is not None
            free.extend(pages[keep:])
            del pages[keep:]
        if run.tokens is not None:
            del run.tokens[keep * bs :]
        if keep == 0:
            del tree.heads[cast(list[object], keys)[0]]
            if run.prev is not None:
                self._unlink(run)
            run.alive = False
            run.keys = []
            tree.runs.discard(run)
            parent = run.parent
            assert parent is not None
            parent.children -= 1
        else:
            del keys[keep:]
        tree.blocks -= take
        self._blocks -= take
        self.evictable_tokens -= take * bs
        self.free_tokens += take * bs

    def _removed(self, tree: Tree, keys: list[int]) -> None:
        self.evicted_blocks += len(keys)
        if self.next_tombstone != -1:  # invalidated runs were announced removed already
            keys = [k for k in keys if k >= 0]
        if self.on_removed is not None and keys:
            self.on_removed(tree.kv_group, keys)
