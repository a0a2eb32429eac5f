"""The host tier under a worker's radix cache (docs/tiers.md). Blocks the GPU cache evicts are
demoted here, their KV copied to host pages, instead of dropped; a prefix found here is promoted
back (copied to fresh GPU pages and inserted into the GPU tree) before its prefill. One LRU over
the blocks of every kv_group with a budget of its own, as the GPU pool is shared. A promoted
block keeps its host copy until the host LRU drops it, so a block may live in both tiers, as
vLLM's CPU offloading keeps it; KV events say which (`medium`).

Every block of the tier's budget is in exactly one state (`check` asserts it):

    free      its page on the free stack
    cached    held, evictable (least recently used first)
    pinned    held and being copied back to the GPU: not evictable until the copy is done
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from backends.cache.nodes import Run
from backends.cache.pool import RemovedCallback
from backends.cache.radix import RadixCache, StoredCallback

# (source pages, destination pages): the KV of each source page copied to the one beside it
CopyPages = Callable[[list[int], list[int]], None]
SaltTest = Callable[[str], bool]


class HostBlock:
    __slots__ = ("page", "tokens", "salt")

    def __init__(self, page: int, tokens: list[int] | None, salt: str | None) -> None:
        self.page = page  # -1: an unpaged tier (the emulated engine keeps no KV)
        self.tokens = tokens  # the block's token ids (keep_tokens: matches are confirmed)
        self.salt = salt  # the namespace it is in (None: shared): scoped invalidation


class HostStats(NamedTuple):
    capacity_tokens: int
    free_tokens: int
    cached_tokens: int  # held and evictable
    pinned_tokens: int  # held and being promoted
    demoted_blocks: int  # ever stored here from the GPU
    promoted_blocks: int  # ever copied back to the GPU
    evicted_blocks: int  # ever dropped by the host LRU


class HostTier:
    """`capacity_tokens` of host memory in blocks of `block_size`; `page_ids` (one per block)
    make it paged, and `attach(gpu, copy_out, copy_in)` moves KV between the two pools."""

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int,
        *,
        page_ids: list[int] | None = None,
        keep_tokens: bool = False,
        on_stored: StoredCallback | None = None,
        on_removed: RemovedCallback | None = None,
    ) -> None:
        blocks = capacity_tokens // block_size if block_size > 0 else 0
        if blocks <= 0:
            raise ValueError("a host tier needs block_size > 0 and room for one block")
        if page_ids is not None and len(page_ids) != blocks:
            raise ValueError("a paged host tier needs one page id per block of its capacity")
        self.block_size = block_size
        self.capacity_blocks = blocks
        self.free_blocks = blocks
        self.page_ids = None if page_ids is None else list(page_ids)  # the free pages: a stack
        self.keep_tokens = keep_tokens
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._lru: OrderedDict[tuple[str, int], HostBlock] = OrderedDict()  # oldest first
        self._pinned: dict[tuple[str, int], int] = {}  # block -> pin count
        self._gpu: RadixCache | None = None
        self._copy_out: CopyPages | None = None
        self._copy_in: CopyPages | None = None
        self.demoted_blocks = self.promoted_blocks = self.evicted_blocks = 0

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    def attach(
        self, gpu: RadixCache, copy_out: CopyPages | None = None, copy_in: CopyPages | None = None
    ) -> None:
        """Sit under `gpu`: what it evicts is demoted here. A paged tier needs a paged GPU
        cache and both copies (GPU pages -> host pages, host pages -> GPU pages)."""
        if gpu.block_size != self.block_size:
            raise ValueError("the host tier and the GPU cache need one block size")
        if (self.page_ids is None) != (gpu.page_ids is None):
            raise ValueError("a paged host tier goes with a paged GPU cache, and only with one")
        if self.page_ids is not None and (copy_out is None or copy_in is None):
            raise ValueError("a paged host tier needs copy_out and copy_in")
        if self.keep_tokens and not gpu.keep_tokens:
            raise ValueError("a host tier that keeps tokens needs a GPU cache that keeps them")
        self._gpu = gpu
        self._copy_out = copy_out
        self._copy_in = copy_in
        gpu.on_evict = self._demote

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self, kv_group: str = "") -> set[int]:
        return {key for group, key in self._lru if group == kv_group}

    # -- demotion: what the GPU cache evicts comes here --------------------------------------

    def _demote(self, run: Run, keep: int) -> None:
        """The GPU cache is about to drop run.keys[keep:]: store them here first."""
        keys = run.keys
        if keys[0] < 0:
            return  # an invalidated run (all its keys are tombstones): nothing to keep
        gpu = self._gpu
        assert gpu is not None
        bs = self.block_size
        parent = run.parent
        assert parent is not None
        parent_key = keys[keep - 1] if keep else parent.keys[-1] if parent.keys else None
        fresh = keys[keep:]
        tokens = None if run.tokens is None else run.tokens[keep * bs :]
        pages = None if run.pages is None else run.pages[keep:]
        # a namespace starts only at a run's first key (radix.py), so only a whole run's
        # BlockStored may need to carry its salt
        starts = gpu.namespaces.get(fresh[0]) if keep == 0 else None
        self.store(run.tree.kv_group, parent_key, fresh, tokens, pages, self._salt_of(run), starts)

    def _salt_of(self, run: Run) -> str | None:
        """The namespace `run` is in: the salt noted at the first key of it or of an ancestor."""
        gpu = self._gpu
        assert gpu is not None
        notes = gpu.namespaces
        at: Run | None = run
        while at is not None and at.parent is not None:
            salt = notes.get(at.keys[0])
            if salt is not None:
                return salt
            at = at.parent
        return None

    def store(
        self,
        kv_group: str,
        parent_key: int | None,
        keys: list[int],
        tokens: list[int] | None,
        gpu_pages: list[int] | None,
        salt: str | None,
        starts_salt: str | None = None,
    ) -> int:
        """Hold the chain `keys` (continuing `parent_key`), copied from `gpu_pages`; blocks held
        already are only marked used. `starts_salt`: keys[0] starts that namespace. Returns the
        blocks stored; the deepest are left out when the tier has no room for all."""
        lru = self._lru
        bs = self.block_size
        keep = tokens if self.keep_tokens else None
        stored = i = 0
        n = len(keys)
        while i < n:
            k = (kv_group, keys[i])
            if k in lru:
                lru.move_to_end(k)
                i += 1
                continue
            j = i + 1
            while j < n and (kv_group, keys[j]) not in lru:
                j += 1
            put = self._make_room(j - i)  # keys[i : i + put] are stored now, a run of new ones
            pages: list[int] | None = None
            if self.page_ids is not None and put:
                free = self.page_ids
                pages = free[len(free) - put :]
                del free[len(free) - put :]
                assert gpu_pages is not None and self._copy_out is not None
                self._copy_out(gpu_pages[i : i + put], pages)
            self.free_blocks -= put
            for b in range(i + put - 1, i - 1, -1):  # deepest first: a chain's head is the newest
                block_tokens = None if keep is None else keep[b * bs : (b + 1) * bs]
                page = -1 if pages is None else pages[b - i]
                lru[(kv_group, keys[b])] = HostBlock(page, block_tokens, salt)
            self.demoted_blocks += put
            stored += put
            if put and self.on_stored is not None:
                span = None if tokens is None else tokens[i * bs : (i + put) * bs]
                parent = keys[i - 1] if i else parent_key
                self.on_stored(
                    kv_group, parent, keys[i : i + put], span, None if i else starts_salt
                )
            if put < j - i:
                break  # no room for the rest: deeper blocks would have no parent here
            i = j
        return stored

    def _make_room(self, n: int) -> int:
        """Free room for up to `n` blocks, dropping the least recently used unpinned ones;
        returns how many fit."""
        short = n - self.free_blocks
        if short > 0:
            self._drop(min(short, len(self._lru) - len(self._pinned)))
        return min(n, self.free_blocks)

    def _drop(self, count: int) -> None:
        """Evict the `count` least recently used unpinned blocks."""
        lru, pinned = self._lru, self._pinned
        gone: list[tuple[str, int]] = []
        while len(gone) < count:
            k, block = lru.popitem(last=False)
            if k in pinned:
                lru[k] = block  # in use: now the newest
                continue
            self._free(block)
            gone.append(k)
        self._removed(gone)

    def _free(self, block: HostBlock) -> None:
        self.free_blocks += 1
        if self.page_ids is not None:
            self.page_ids.append(block.page)

    def _removed(self, gone: list[tuple[str, int]]) -> None:
        """Count the blocks dropped and announce them, one BlockRemoved per kv_group."""
        self.evicted_blocks += len(gone)
        if self.on_removed is not None:
            for group in dict.fromkeys(g for g, _ in gone):
                self.on_removed(group, [k for g, k in gone if g == group])

    # -- promotion: a prefix found here goes back to the GPU ---------------------------------

    def match(
        self,
        keys: Sequence[int],
        start: int,
        limit: int,
        kv_group: str = "",
        tokens: Sequence[int] | None = None,
    ) -> int:
        """How many of keys[start:limit] this tier holds in a row (confirmed on `tokens` where
        it keeps them); marks nothing used."""
        lru = self._lru
        bs = self.block_size
        confirm = self.keep_tokens and tokens is not None
        i = start
        while i < limit:
            block = lru.get((kv_group, keys[i]))
            if block is None:
                break
            if confirm:
                assert tokens is not None
                if list(tokens[i * bs : (i + 1) * bs]) != block.tokens:
                    break  # same key, other tokens: a hash collision is never shared
            i += 1
        return i - start

    def promote(
        self,
        node: Run,
        keys: list[int],
        start: int,
        limit: int,
        kv_group: str = "",
        tokens: Sequence[int] | None = None,
        salt: str | None = None,
        public_blocks: int = 0,
    ) -> tuple[Run, int]:
        """Copy keys[start:limit]'s leading blocks held here into the GPU cache under `node`
        (locked: it ends at keys[start - 1], or is the root), as far as the GPU has room. The
        lock moves down to them; returns the node now locked and the blocks promoted. `salt`
        and `public_blocks` are the request's (as for RadixCache.insert)."""
        gpu = self._gpu
        assert gpu is not None, "a host tier not attached"
        bs = self.block_size
        room = (gpu.free_tokens + gpu.evictable_tokens) // bs
        n = min(self.match(keys, start, limit, kv_group, tokens), room)
        if n == 0:
            return node, 0
        held = [(kv_group, k) for k in keys[start : start + n]]
        pinned = self._pinned
        for k in held:  # the GPU's evictions below demote here: these must stay put meanwhile
            pinned[k] = pinned.get(k, 0) + 1
        try:
            pages: list[int] | None = None
            if gpu.page_ids is not None:
                pages = gpu.allocate_pages(n)
                if pages is None:
                    return node, 0
                assert self._copy_in is not None
                self._copy_in([self._lru[k].page for k in held], pages)
            elif not gpu.allocate(n * bs):
                return node, 0
            span = None if tokens is None else tokens[start * bs : (start + n) * bs]
            fresh = keys[start : start + n]
            ins = gpu.insert(node, fresh, span, salt, public_blocks - start, pages)
            left = n - ins.inserted
            if left:  # a collision or an invalidated path: the copies go back
                if pages is not None:
                    gpu.free_pages(pages[ins.inserted :])
                else:
                    gpu.free(left * bs)
            if ins.inserted:
                gpu.move_lock(node, ins.node)
                node = ins.node
        finally:
            for k in held:
                count = pinned.pop(k) - 1
                if count:
                    pinned[k] = count
        lru = self._lru
        for k in reversed(held[: ins.inserted]):  # used now; the chain's head the newest
            lru.move_to_end(k)
        self.promoted_blocks += ins.inserted
        return node, ins.inserted

    # -- invalidation, integrity --------------------------------------------------------------

    def invalidate(self, scope: SaltTest | None, kv_group: str | None = None) -> int:
        """Drop the blocks of the namespaces `scope` passes (None: every block) of `kv_group`
        (None: every group). Blocks being promoted now are not in a namespace being dropped:
        the worker invalidates on the thread that promotes. Returns the blocks dropped."""
        lru = self._lru
        doomed = [
            k
            for k, block in lru.items()
            if (kv_group is None or k[0] == kv_group)
            and (scope is None or (block.salt is not None and scope(block.salt)))
            and k not in self._pinned
        ]
        for k in doomed:
            self._free(lru.pop(k))
        self._removed(doomed)
        return len(doomed)

    def stats(self) -> HostStats:
        bs = self.block_size
        pinned = len(self._pinned)
        return HostStats(
            self.capacity_tokens,
            self.free_blocks * bs,
            (len(self._lru) - pinned) * bs,
            pinned * bs,
            self.demoted_blocks,
            self.promoted_blocks,
            self.evicted_blocks,
        )

    def check(self) -> None:
        """free + cached + pinned == capacity; pages and tokens where kept."""
        assert self.free_blocks >= 0, "free count"
        assert self.free_blocks + len(self._lru) == self.capacity_blocks, "free + held != total"
        assert all(k in self._lru for k in self._pinned), "a pinned block not held"
        bs = self.block_size
        if self.keep_tokens:
            assert all(b.tokens is not None and len(b.tokens) == bs for b in self._lru.values()), (
                "a block without its tokens"
            )
        free = self.page_ids
        if free is None:
            return
        held = [b.page for b in self._lru.values()]
        assert len(free) == self.free_blocks and len(set(free)) == len(free), "free pages"
        assert len(set(held)) == len(held) and not set(held) & set(free), "a page in two places"
