"""The radix cache of KV pages: which pages of a pool hold which token blocks, for every model.

One cache per page pool (page_pool.py), one tree per kv_group inside it: models of one
kv_group produce identical K/V for identical tokens and share nodes; other groups never see
them, even for equal tokens. A node is one page (`page_size` tokens) named by its block key
(core/blocks.py: chained xxh3 in the cache_salt's namespace), so a key names its whole
prefix, tenants never share a node, and the keys are exactly what the KV events publish. A
node also keeps its tokens: a match is confirmed token by token, never on the hash alone.

Every page of the pool is in exactly one state (`check` asserts it):

    free         in the pool's free list
    evictable    in a tree, on no locked path (lock_ref == 0)
    protected    in a tree, on a path some request locks
    in use       handed to a request by `allocate` and not yet inserted or freed

Locks walk to the root, so the evictable pages are exactly what evicting leaves reaches.
Eviction runs only inside `allocate`, only for the shortfall, least recently used unlocked
leaf first, across all the pool's groups: a group's share of the pool follows its traffic. The
leaves sit in a lazy heap (stale entries are skipped when popped), never found by a scan.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple

from backends.engine.page_pool import PagePool

# (kv_group, parent key or None for a root block, keys, their tokens, salt of a root block)
StoredCallback = Callable[[str, int | None, list[int], list[int], str | None], None]
RemovedCallback = Callable[[str, list[int]], None]


class Node:
    __slots__ = (
        "key",
        "page",
        "tokens",
        "group",
        "parent",
        "children",
        "lock_ref",
        "stamp",
        "heap_seq",
    )

    def __init__(
        self,
        key: int,
        page: int,
        tokens: tuple[int, ...],
        group: str,
        parent: Node | None,
        stamp: int,
    ) -> None:
        self.key = key
        self.page = page
        self.tokens = tokens
        self.group = group
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.stamp = stamp
        self.heap_seq = -1  # the seq of this node's one valid heap entry; -1 when not queued


class MatchResult(NamedTuple):
    node: Node  # the deepest matched node (the group's root when nothing matched)
    pages: list[int]  # the matched blocks' pages; safe to use only while `node` is locked


class InsertResult(NamedTuple):
    node: Node  # the node of the last block now in the tree on this path
    pages: list[int]  # the pages now backing the inserted blocks (the tree's, where it had one)
    inserted: int  # blocks of `keys` now in the tree (all of them but after a hash collision)


class CacheStats(NamedTuple):
    capacity_pages: int
    free_pages: int
    evictable_pages: int
    protected_pages: int
    in_use_pages: int
    stored_pages: int  # ever added to a tree
    evicted_pages: int  # ever evicted


class PageRadixCache:
    def __init__(
        self,
        pool: PagePool,
        *,
        on_stored: StoredCallback | None = None,
        on_removed: RemovedCallback | None = None,
    ) -> None:
        self.pool = pool
        self.page_size = pool.layout.page_size
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._roots: dict[str, Node] = {}
        self._heap: list[tuple[int, int, Node]] = []  # (stamp, seq, node): unlocked leaves
        self._seq = 0
        self._tick = 0
        self.evictable_pages = 0
        self.protected_pages = 0
        self.in_use_pages = 0
        self.stored_pages = 0
        self.evicted_pages = 0
        self.group_pages: dict[str, int] = {}
        # key that starts a salted namespace -> its salt (may name evicted keys; cache_scopes.py)
        self.namespaces: dict[int, str] = {}
        self.next_tombstone = -1  # invalidated locked nodes are re-keyed below zero

    # -- reading -----------------------------------------------------------------------------

    def root(self, kv_group: str) -> Node:
        root = self._roots.get(kv_group)
        if root is None:
            root = self._roots[kv_group] = Node(0, -1, (), kv_group, None, 0)
            root.lock_ref = 1  # never evicted
            self.group_pages[kv_group] = 0
        return root

    def groups(self) -> list[str]:
        return list(self._roots)

    def stats(self) -> CacheStats:
        return CacheStats(
            self.pool.capacity,
            self.pool.free_pages,
            self.evictable_pages,
            self.protected_pages,
            self.in_use_pages,
            self.stored_pages,
            self.evicted_pages,
        )

    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def keys(self, kv_group: str) -> set[int]:
        """Every block key the group's tree holds (tests compare it with the gateway's index)."""
        out: set[int] = set()
        stack = [self.root(kv_group)]
        while stack:
            node = stack.pop()
            out.update(node.children)
            stack.extend(node.children.values())
        return out

    def match(
        self, kv_group: str, keys: Sequence[int], tokens: Sequence[int], max_blocks: int
    ) -> MatchResult:
        """The longest cached prefix of the blocks `keys` (covering `tokens`), at most
        `max_blocks`. Marks the path used; does not lock it."""
        bs = self.page_size
        self._tick += 1
        node = self.root(kv_group)
        pages: list[int] = []
        for i, key in enumerate(keys[:max_blocks]):
            child = node.children.get(key)
            if child is None or child.tokens != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            child.stamp = self._tick
            pages.append(child.page)
            node = child
        if not node.children and node.lock_ref == 0 and node.parent is not None:
            self._push(node)  # its stamp changed: re-queue it
        return MatchResult(node, pages)

    # -- locks -------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction (counted: lock as often as unlock)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= 1
                self.protected_pages += 1
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Release one lock of `node` and its ancestors; the path counts as used now."""
        self._tick += 1
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            node.stamp = self._tick
            if node.lock_ref == 0:
                self.evictable_pages += 1
                self.protected_pages -= 1
                if not node.children:
                    self._push(node)
            node = node.parent

    # -- pages -------------------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        return n <= self.pool.free_pages + self.evictable_pages

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages for a request's private use, evicting unlocked leaves for the shortfall
        only. None (and nothing evicted) when even evicting all of them would not do."""
        shortfall = n - self.pool.free_pages
        if shortfall > self.evictable_pages:
            return None
        if shortfall > 0:
            self._evict(shortfall)
        self.in_use_pages += n
        return self.pool.take(n)

    def free(self, pages: list[int]) -> None:
        """Give back private pages (never pages that are in a tree)."""
        assert len(pages) <= self.in_use_pages, "freeing more pages than are in use"
        self.in_use_pages -= len(pages)
        self.pool.give_back(pages)

    # -- insert ------------------------------------------------------------------------------

    def insert(
        self,
        parent: Node,
        keys: Sequence[int],
        tokens: Sequence[int],
        pages: Sequence[int],
        salt: str | None = None,
        salt_at: int | None = None,
    ) -> InsertResult:
        """Put blocks `keys` (keys[0] a child of `parent`, which the caller holds locked or is
        a root; `tokens` exactly their tokens) into `parent`'s tree, their K/V computed into
        the caller's private `pages`. Where another request cached a block meanwhile, that
        node wins:

            [0, dup)          cached meanwhile: our page is freed, theirs backs the block
            [dup, inserted)   new nodes on our pages: in use -> evictable
            [inserted, n)     after a hash collision (tokens differ): still the caller's pages

        New nodes are unlocked: lock the returned node before the next allocation. `salt`
        travels with a root block, or with keys[salt_at] when a public prefix ends before it
        (core/blocks.py); under an invalidated node (cache_scopes.py) nothing is cached."""
        bs = self.page_size
        self._tick += 1
        if parent.key < 0:  # invalidated while the caller held it: its pages stay private
            return InsertResult(parent, [], 0)
        node = parent
        out: list[int] = []
        fresh_keys: list[int] = []
        fresh_from = -1
        for i, key in enumerate(keys):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            assert len(block) == bs, "insert takes whole blocks"
            child = node.children.get(key)
            if child is not None:
                if child.tokens != block:
                    break  # a hash collision: never share, keep the rest private
                self.free([pages[i]])
                child.stamp = self._tick
            else:
                child = Node(key, pages[i], block, parent.group, node, self._tick)
                node.children[key] = child
                self.in_use_pages -= 1
                self.evictable_pages += 1
                if not fresh_keys:
                    fresh_from = i
                fresh_keys.append(key)
            out.append(child.page)
            node = child
        if fresh_keys:
            # where in fresh_keys the salt's namespace starts, if it does (None: at the root)
            if salt_at is None:
                at = 0 if fresh_from == 0 and parent.parent is None else -1
            else:
                at = salt_at - fresh_from
            if salt and 0 <= at < len(fresh_keys):
                self._note_namespace(fresh_keys[at], salt)
            self.stored_pages += len(fresh_keys)
            self.group_pages[parent.group] += len(fresh_keys)
            if self.on_stored is not None:
                if fresh_from > 0:
                    parent_key: int | None = keys[fresh_from - 1]
                else:
                    parent_key = None if parent.parent is None else parent.key
                span = list(tokens[fresh_from * bs : (fresh_from + len(fresh_keys)) * bs])
                self._announce(parent.group, parent_key, fresh_keys, span, salt, at)
        if node is not parent and not node.children and node.lock_ref == 0:
            self._push(node)
        return InsertResult(node, out, len(out))

    def _note_namespace(self, key: int, salt: str) -> None:
        """`key` starts the namespace of `salt`; notes of evicted keys are pruned now and then."""
        namespaces = self.namespaces
        namespaces[key] = salt
        if len(namespaces) > 2 * self.cached_pages + 8192:
            held = {k for group in self._roots for k in self.keys(group)}
            self.namespaces = {k: s for k, s in namespaces.items() if k in held}

    def _announce(
        self,
        group: str,
        parent_key: int | None,
        keys: list[int],
        tokens: list[int],
        salt: str | None,
        at: int,
    ) -> None:
        """BlockStored for new blocks: the salt rides on the block that starts its namespace,
        so a public prefix and its salted rest go as two events."""
        assert self.on_stored is not None
        if not salt or at <= 0 or at >= len(keys):
            self.on_stored(group, parent_key, keys, tokens, salt if at == 0 else None)
            return
        cut = at * self.page_size
        self.on_stored(group, parent_key, keys[:at], tokens[:cut], None)
        self.on_stored(group, keys[at - 1], keys[at:], tokens[cut:], salt)

    # -- eviction ----------------------------------------------------------------------------

    def _push(self, node: Node) -> None:
        self._seq += 1
        node.heap_seq = self._seq
        heapq.heappush(self._heap, (node.stamp, self._seq, node))
        if len(self._heap) > 2 * (self.evictable_pages + self.protected_pages) + 1024:
            self._heap = [e for e in self._heap if self._valid(e[2], e[1])]
            heapq.heapify(self._heap)

    @staticmethod
    def _valid(node: Node, seq: int) -> bool:
        return node.heap_seq == seq and not node.children and node.lock_ref == 0

    def _evict(self, n: int) -> None:
        """Drop `n` unlocked leaves, least recently used first; their pages become free."""
        removed: dict[str, list[int]] = {}
        freed: list[int] = []
        heap = self._heap
        while len(freed) < n:
            assert heap, "evictable count out of step with the leaves"
            _, seq, node = heapq.heappop(heap)
            if not self._valid(node, seq):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.heap_seq = -1
            node.parent = None  # dead: a stale heap entry or handle can never match it again
            freed.append(node.page)
            removed.setdefault(node.group, []).append(node.key)
            self.group_pages[node.group] -= 1
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        self.evictable_pages -= len(freed)
        self.evicted_pages += len(freed)
        self.pool.give_back(freed)
        if self.on_removed is not None:
            for group, keys in removed.items():
                if self.next_tombstone != -1:  # invalidated nodes were announced already
                    keys = [k for k in keys if k >= 0]
                if keys:
                    self.on_removed(group, keys)

    # -- integrity ---------------------------------------------------------------------------

    def check(self) -> set[int]:
        """Assert the invariants (tests run it after every step): free + cached + in use ==
        capacity, counts match the trees, no page is in two places, unlocked leaves are
        queued. Returns the pages in the trees."""
        pool = self.pool
        assert (
            pool.free_pages + self.evictable_pages + self.protected_pages + self.in_use_pages
            == pool.capacity
        ), "free + cached + in use != total"
        free = pool.free_set()
        assert len(free) == pool.free_pages and 0 not in free, "free list holds a page twice"
        queued = {id(e[2]) for e in self._heap if self._valid(e[2], e[1])}
        in_tree: set[int] = set()
        evictable = protected = 0
        for group, root in self._roots.items():
            count = 0
            stack = [root]
            while stack:
                node = stack.pop()
                locks = 0
                for key, child in node.children.items():
                    assert child.key == key and child.parent is node, "tree links"
                    assert child.page not in in_tree and child.page not in free, "page reused"
                    assert len(child.tokens) == self.page_size
                    in_tree.add(child.page)
                    locks += child.lock_ref
                    stack.append(child)
                if node is root:
                    continue
                assert node.lock_ref >= locks, "a locked node under an unlocked one"
                count += 1
                if node.lock_ref:
                    protected += 1
                else:
                    evictable += 1
                    if not node.children:
                        assert id(node) in queued, "an evictable leaf is not in the heap"
            assert count == self.group_pages[group], "pages per group"
        assert evictable == self.evictable_pages, "evictable count"
        assert protected == self.protected_pages, "protected count"
        return in_tree
