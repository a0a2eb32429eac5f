"""The workers' KV cache (docs/workers.md, "The radix cache"): a radix tree of blocks per kv_group
in one pool (pool.py), keyed by the gateway's own chained block keys, SGLang's design made
block-granular.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from backends.cache.nodes import CacheStats, InsertResult, MatchResult, Run, Tree
from backends.cache.pool import Pool, RemovedCallback
from core.blocks import DEFAULT_BLOCK_SIZE

# (kv_group, parent key or None for a root block, keys, token ids of exactly those blocks or
# None, salt)
StoredCallback = Callable[[str, int | None, list[int], list[int] | None, str | None], None]


def _part(items: list[int] | None, start: int, stop: int | None) -> list[int] | None:
    return None if items is None else items[start:stop]


class RadixCache(Pool):
    """The pool with its trees. `keep_tokens` keeps the blocks' token ids to confirm matches on;
    `on_stored` / `on_removed` hear every change to the cached keys, as KV events must say it."""

    def __init__(
        self,
        capacity_tokens: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        page_ids: list[int] | None = None,
        keep_tokens: bool = False,
        on_stored: StoredCallback | None = None,
        on_removed: RemovedCallback | None = None,
    ) -> None:
        super().__init__(capacity_tokens, block_size, page_ids, on_removed)
        self.keep_tokens = keep_tokens
        self.on_stored = on_stored
        self.trees: dict[str, Tree] = {}
        self._tick = 0
        self.stored_blocks = 0
        # key that starts a salted namespace -> its salt (may name evicted keys; scopes.py)
        self.namespaces: dict[int, str] = {}

    def __len__(self) -> int:
        return self._blocks

    def root(self, kv_group: str = "") -> Run:
        """The root of the group's tree (made on first use)."""
        tree = self.trees.get(kv_group)
        if tree is None:
            tree = self.trees[kv_group] = Tree(kv_group)
        return tree.root

    def starts_run(self, key: int, kv_group: str = "") -> bool:
        """Whether a cached run starts at `key` (a cached prefix ending before it goes on)."""
        tree = self.trees.get(kv_group)
        return tree is not None and key in tree.heads

    def keys(self, kv_group: str = "") -> set[int]:
        """Every key the group's tree holds, invalidated ones not (walks its runs)."""
        tree = self.trees.get(kv_group)
        return set() if tree is None else {k for run in tree.runs for k in run.keys if k >= 0}

    def stats(self) -> CacheStats:
        return CacheStats(
            self.capacity_tokens,
            self.free_tokens,
            self.evictable_tokens,
            self.protected_tokens,
            self.allocated_tokens,
            self._blocks,
            sum(len(tree.runs) for tree in self.trees.values()),
            self.stored_blocks,
            self.evicted_blocks,
        )

    def path_pages(self, node: Run, top: Run | None = None) -> list[int]:
        """The pages of the blocks from below `top` (None: the root) down to `node`."""
        parts: list[list[int]] = []
        while node is not top and node.parent is not None:
            assert node.pages is not None, "a cache without pages"
            parts.append(node.pages)
            node = node.parent
        return [page for part in reversed(parts) for page in part]

    def match(
        self,
        keys: list[int],
        max_blocks: int | None = None,
        kv_group: str = "",
        tokens: Sequence[int] | None = None,
    ) -> MatchResult:
        """The longest cached prefix of `keys` (confirmed on `tokens` where the cache keeps them),
        as a run split to end exactly there; safe to use only once `lock(result.node)` is held."""
        limit = len(keys) if max_blocks is None else min(max_blocks, len(keys))
        self._tick += 1
        node, matched = self._descend(self.root(kv_group), keys, 0, limit, tokens)
        return MatchResult(node, matched)

    def _descend(
        self, node: Run, keys: list[int], i: int, limit: int, tokens: Sequence[int] | None
    ) -> tuple[Run, int]:
        """Follow keys[i:limit] down from `node`: the run ending exactly there, the index after."""
        heads = node.tree.heads
        tick = self._tick
        confirm = self.keep_tokens and tokens is not None
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
            if confirm:
                m = self._confirmed(run, cast(Sequence[int], tokens), i, m)
                if m == 0:
                    break  # same key, other tokens: a hash collision is never shared
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

    def _confirmed(self, run: Run, tokens: Sequence[int], i: int, m: int) -> int:
        """How many of the first `m` blocks of `run` hold the tokens of blocks i, i + 1, ..."""
        bs = self.block_size
        held = run.tokens
        assert held is not None, "a run without its tokens"
        for j in range(m):
            if list(tokens[(i + j) * bs : (i + j + 1) * bs]) != held[j * bs : (j + 1) * bs]:
                return j
        return m

    def _split(self, run: Run, at: int) -> Run:
        """Cut `run` after `at` blocks; returns the new head. The tail stays `run`, as requests
        holding it expect, in its place in the LRU list."""
        tree = run.tree
        head = Run(run.keys[:at], run.parent, run.lock_ref, run.stamp, tree)
        head.children = 1
        del run.keys[:at]
        if run.pages is not None:
            head.pages = run.pages[:at]
            del run.pages[:at]
        if run.tokens is not None:
            head.tokens = run.tokens[: at * self.block_size]
            del run.tokens[: at * self.block_size]
        tree.heads[cast(list[object], head.keys)[0]] = head
        tree.heads[cast(list[object], run.keys)[0]] = run
        run.parent = head
        tree.runs.add(head)
        return head

    def lock(self, node: Run) -> None:
        """Protect `node` and its ancestors from eviction (counted: lock as often as unlock)."""
        self._lock_path(node, None)

    def _lock_path(self, node: Run, top: Run | None) -> None:
        """Lock the runs from `node` up to, not including, `top` (None: the root)."""
        bs = self.block_size
        while node is not top and node.parent is not None:
            if node.lock_ref == 0:
                tokens = len(node.keys) * bs
                self.evictable_tokens -= tokens
                self.protected_tokens += tokens
                if node.prev is not None:
                    self._unlink(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Run) -> None:
        """Release one lock of `node` and its ancestors; the path counts as used now."""
        bs = self.block_size
        self._tick += 1
        tick = self._tick
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            node.stamp = tick
            if node.lock_ref == 0:
                tokens = len(node.keys) * bs
                self.evictable_tokens += tokens
                self.protected_tokens -= tokens
                if node.children == 0:
                    self._link_newest(node)
            node = node.parent

    def move_lock(self, node: Run, down_to: Run) -> None:
        """`lock(down_to)` then `unlock(node)` in one walk, for `down_to` at or below `node`."""
        self._lock_path(down_to, node)
        self._tick += 1
        tick = self._tick
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.stamp = tick
            node = node.parent

    def insert(
        self,
        parent: Run,
        keys: list[int],
        tokens: Sequence[int] | None = None,
        salt: str | None = None,
        salt_at: int | None = None,
        pages: list[int] | None = None,
    ) -> InsertResult:
        """Cache blocks `keys` under `parent` (locked, or a root) whose KV the caller computed in
        its allocated room (a paged cache: into its `pages`):

            [0, cached_blocks)          cached meanwhile by someone else: our copy is freed
            [cached_blocks, inserted)   added as a new leaf run: allocated -> evictable
            [inserted, len(keys))       still the caller's: a hash collision, or `parent` was
                                        invalidated

        `tokens` (not to be changed after) travel to `on_stored`; `salt` starts its namespace at
        the root, or at keys[salt_at] after a public prefix (core/blocks.py)."""
        n = len(keys)
        bs = self.block_size
        assert self.allocated_tokens >= n * bs, "insert needs its tokens allocated first"
        self._tick += 1
        if parent.keys and parent.keys[-1] < 0:  # an invalidated run: cache nothing under it
            return InsertResult(parent, 0, 0, [] if pages is not None else None)
        heads = parent.tree.heads
        if n and cast(list[object], keys)[0] not in heads:  # all new (the common case)
            node, i = parent, 0
        else:
            node, i = self._descend(parent, keys, 0, n, tokens)
        end = n
        if self.keep_tokens and i < n and cast(list[object], keys)[i] in heads:
            end = i  # a hash collision: never shared, the rest stays the caller's
        self.allocated_tokens -= end * bs
        self.free_tokens += i * bs  # our copy of blocks cached meanwhile
        held: list[int] | None = None
        if pages is not None:
            free = self.page_ids
            assert free is not None, "a cache without pages"
            free.extend(pages[:i])
            held = self.path_pages(node, parent)
            held.extend(pages[i:end])
        if i < end:
            node = self._store(node, keys, tokens, i, end, salt, salt_at, pages)
        return InsertResult(node, i, end - i, held)

    def _store(
        self,
        node: Run,
        keys: list[int],
        tokens: Sequence[int] | None,
        i: int,
        end: int,
        salt: str | None,
        salt_at: int | None,
        pages: list[int] | None,
    ) -> Run:
        """Add keys[i:end] under `node` as a new leaf (two runs when a public prefix ends
        inside them) and announce them."""
        bs = self.block_size
        fresh = keys[i:end]
        # where in `fresh` the salt's namespace starts, if it does (None: at the root)
        at = (0 if node.parent is None else -1) if salt_at is None else salt_at - i
        public = bool(salt) and 0 < at < len(fresh)  # a public prefix, then the rest
        kept = None
        if self.keep_tokens:
            assert tokens is not None, "this cache keeps the blocks' tokens"
            kept = list(tokens[i * bs : end * bs])
        part = _part(pages, i, end)
        parent_key = node.keys[-1] if node.keys else None
        if public:  # the namespace starts a run of its own (the module doc)
            head = self._add_run(node, fresh[:at], _part(part, 0, at), _part(kept, 0, at * bs))
            run = self._add_run(head, fresh[at:], _part(part, at, end), _part(kept, at * bs, None))
        else:  # the run's list changes; events' must not
            run = self._add_run(node, fresh[:], part, kept)
        self._link_newest(run)
        if salt and 0 <= at < len(fresh):
            self._note_namespace(fresh[at], salt)
        if self.on_stored is not None:
            group = node.tree.kv_group
            block_tokens = None
            if tokens is not None:  # handed on, not copied, when all of it is new
                span = tokens[i * bs : end * bs] if i or end < len(keys) else tokens
                block_tokens = span if type(span) is list else list(span)
            if not public:
                self.on_stored(group, parent_key, fresh, block_tokens, salt if at == 0 else None)
            else:  # two events, as keyed
                head_tokens = _part(block_tokens, 0, at * bs)
                self.on_stored(group, parent_key, fresh[:at], head_tokens, None)
                tail_tokens = _part(block_tokens, at * bs, None)
                self.on_stored(group, fresh[at - 1], fresh[at:], tail_tokens, salt)
        return run

    def _add_run(
        self, parent: Run, keys: list[int], pages: list[int] | None, tokens: list[int] | None
    ) -> Run:
        """A new run of blocks under `parent`, computed in allocated room: now evictable."""
        tree = parent.tree
        first = cast(list[object], keys)[0]
        assert first not in tree.heads, "block key collision"
        run = Run(keys, parent, 0, self._tick, tree)
        run.pages = pages
        run.tokens = tokens
        tree.heads[first] = run
        if parent.prev is not None:  # an unlocked leaf (cached meanwhile) is one no longer
            self._unlink(parent)
        parent.children += 1
        tree.runs.add(run)
        tree.blocks += len(keys)
        self._blocks += len(keys)
        self.evictable_tokens += len(keys) * self.block_size
        self.stored_blocks += len(keys)
        return run

    def _note_namespace(self, key: int, salt: str) -> None:
        """`key` starts the namespace of `salt`; notes of evicted keys are pruned now and then."""
        namespaces = self.namespaces
        namespaces[key] = salt
        if len(namespaces) > 2 * self._blocks + 8192:
            trees = list(self.trees.values())
            self.namespaces = {
                k: s for k, s in namespaces.items() if any(k in t.heads for t in trees)
            }
