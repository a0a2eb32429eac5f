"""The one radix cache of both workers (backends/cache/): match, insert, locks, LRU eviction of
unlocked leaves for the shortfall only, kv_groups and salts, pages and token confirmation,
scoped invalidation, the events it reports, and the integrity check after every operation,
plus a property test against a brute-force model of the same cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.cache.check import check
from backends.cache.nodes import Run
from backends.cache.radix import RadixCache
from backends.cache.scopes import invalidate
from core.blocks import block_keys, salt_scope
from core.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent
from router.gateway.isolation import user_salt
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror

BS = 4


def toks(*blocks: int) -> list[int]:
    """One block of BS equal tokens per argument."""
    return [t for b in blocks for t in [b] * BS]


class Recorder:
    """What the callbacks say each tree holds (a KV event stream in miniature)."""

    def __init__(self) -> None:
        self.keys: dict[str, set[int]] = {}
        self.removed: list[tuple[str, list[int]]] = []
        self.events: list[KVEvent] = []

    def stored(
        self,
        group: str,
        parent: int | None,
        keys: list[int],
        tokens: list[int] | None,
        salt: str | None,
    ) -> None:
        held = self.keys.setdefault(group, set())
        assert parent is None or parent in held, "a store under an unknown parent"
        assert tokens is not None and len(tokens) == len(keys) * BS
        assert parent is not None or block_keys(tokens, BS, salt)[0] == keys[0], "root salt"
        assert held.isdisjoint(keys)
        held.update(keys)
        self.events.append(BlockStored(keys, parent, tokens, BS, None, "GPU", cache_salt=salt))

    def gone(self, group: str, keys: list[int]) -> None:
        assert set(keys) <= self.keys[group]
        self.keys[group].difference_update(keys)
        self.removed.append((group, keys))
        self.events.append(BlockRemoved(keys, "GPU"))


def make(blocks: int, paged: bool = False) -> tuple[RadixCache, Recorder]:
    rec = Recorder()
    ids = list(range(blocks, 0, -1)) if paged else None
    cache = RadixCache(
        blocks * BS, BS, page_ids=ids, keep_tokens=paged, on_stored=rec.stored, on_removed=rec.gone
    )
    return cache, rec


def put(
    cache: RadixCache, tokens: list[int], salt: str | None = None, group: str = "", public: int = 0
) -> Run:
    """Allocate, insert and unlock a whole prompt (as a finished request leaves it)."""
    keys = block_keys(tokens, BS, salt, public)
    match = cache.match(keys, None, group, tokens)
    cache.lock(match.node)
    n = len(keys) - match.blocks
    pages = cache.allocate_pages(n) if cache.page_ids is not None else None
    assert pages is not None or cache.allocate(n * BS)
    rest = tokens[match.blocks * BS :]
    ins = cache.insert(match.node, keys[match.blocks :], rest, salt, public - match.blocks, pages)
    cache.unlock(match.node)
    check(cache)
    return ins.node


def test_match_insert_and_split() -> None:
    cache, rec = make(16)
    put(cache, toks(1, 2, 3))
    assert len(cache) == 3 and rec.keys[""] == cache.keys()
    keys = block_keys(toks(1, 2, 9), BS)
    match = cache.match(keys)
    assert match.blocks == 2 and match.node.keys == keys[:2]  # the run was split
    check(cache)
    assert cache.match(block_keys(toks(1, 2, 3, 4), BS), max_blocks=2).blocks == 2
    assert cache.match(block_keys(toks(7), BS)).blocks == 0
    check(cache)


def test_insert_returns_what_was_cached_meanwhile() -> None:
    cache, _ = make(16)
    keys = block_keys(toks(1, 2, 3), BS)
    a = cache.match(keys)
    cache.lock(a.node)
    assert cache.allocate(3 * BS)
    put(cache, toks(1, 2))  # another request cached the first two blocks meanwhile
    free_before = cache.free_tokens
    ins = cache.insert(a.node, keys, toks(1, 2, 3))
    assert (ins.cached_blocks, ins.new_blocks) == (2, 1)
    assert cache.free_tokens == free_before + 2 * BS  # our copy of the two is freed
    assert ins.node.keys == keys[2:]
    check(cache)
    cache.unlock(a.node)
    check(cache)


def test_eviction_takes_only_the_shortfall_from_unlocked_lru_leaves() -> None:
    cache, rec = make(10)
    put(cache, toks(1, 2, 3))
    put(cache, toks(4, 5, 6))
    put(cache, toks(7, 8))
    cache.match(block_keys(toks(1, 2, 3), BS))  # used again: 4,5,6 is now the oldest
    assert cache.free_tokens == 2 * BS
    assert cache.allocate(3 * BS + 1)  # 2 blocks short (1 token over a block)
    check(cache)
    assert rec.removed == [("", block_keys(toks(4, 5, 6), BS)[1:][::-1])]  # the oldest's tail
    assert cache.free_tokens == BS - 1  # 2 blocks freed, 3 blocks + 1 token taken


def test_locked_paths_survive_and_allocation_fails_without_evicting() -> None:
    cache, rec = make(6)
    put(cache, toks(1, 2, 3))
    leaf = put(cache, toks(4, 5, 6))
    cache.lock(leaf)  # a running request holds 4,5,6 and, through it, nothing else
    check(cache)
    assert cache.protected_tokens == 3 * BS and cache.evictable_tokens == 3 * BS
    assert not cache.allocate(4 * BS)  # would need a locked block
    assert rec.removed == [] and len(cache) == 6
    assert cache.allocate(3 * BS)  # all of 1,2,3 goes, deepest first
    assert rec.removed == [("", block_keys(toks(1, 2, 3), BS)[::-1])]
    cached = cache.keys()  # a set of every cached key
    assert block_keys(toks(4, 5, 6), BS)[-1] in cached
    check(cache)
    cache.unlock(leaf)
    cache.free(3 * BS)
    check(cache)
    assert cache.evictable_tokens == 3 * BS and cache.free_tokens == 3 * BS


def test_a_parent_becomes_evictable_once_its_children_are_gone() -> None:
    cache, rec = make(4)
    put(cache, toks(1, 2))
    put(cache, toks(1, 2, 3))  # a child run under 1,2
    put(cache, toks(9, 9))
    cache.match(block_keys(toks(9, 9), BS))
    assert cache.allocate(4 * BS)  # everything, LRU: 3, then 2 and 1, then 9,9
    assert rec.removed[0] == ("", block_keys(toks(1, 2, 3), BS)[-1:])
    assert len(cache) == 0
    check(cache)


def test_salts_and_kv_groups_isolate() -> None:
    cache, rec = make(32)
    put(cache, toks(1, 2, 3), salt="tenant-a")
    assert cache.match(block_keys(toks(1, 2, 3), BS)).blocks == 0
    assert cache.match(block_keys(toks(1, 2, 3), BS, "tenant-b")).blocks == 0
    assert cache.match(block_keys(toks(1, 2, 3), BS, "tenant-a")).blocks == 3
    put(cache, toks(1, 2, 3))
    assert len(cache) == 6 and rec.keys[""] == cache.keys()
    put(cache, toks(1, 2, 3), group="b")  # the same keys, another group's tree
    assert cache.keys("b") == set(block_keys(toks(1, 2, 3), BS)) and len(cache) == 9
    assert cache.match(block_keys(toks(1, 2, 3), BS), None, "c").blocks == 0
    check(cache)


def test_repeated_touches_keep_one_lru_entry_per_leaf() -> None:
    cache, _ = make(16)
    put(cache, toks(1, 2))
    keys = block_keys(toks(1, 2), BS)
    for _ in range(5000):
        cache.match(keys)
    check(cache)  # the list holds exactly the unlocked leaves, in stamp order
    assert cache._lru.next is cache._lru.prev is not cache._lru


def test_pages_the_tree_had_win_and_eviction_crosses_groups() -> None:
    cache, rec = make(8, paged=True)
    tokens = toks(1, 2, 3)
    keys = block_keys(tokens, BS)
    first = put(cache, tokens, group="a")
    a_pages = cache.path_pages(first)
    mine = cache.allocate_pages(3)  # a second request computed the same blocks meanwhile
    assert mine is not None
    ins = cache.insert(cache.root("a"), keys, tokens, None, None, mine)
    assert ins.pages == a_pages and ins.node is first and ins.cached_blocks == 3
    assert len(cache.page_ids or []) == 5  # our copies went back
    longer = tokens + toks(7, 7)
    assert cache.match(block_keys(longer, BS), 5, "a", longer).blocks == 3
    put(cache, toks(5, 6), group="b")  # newer than "a"'s blocks
    assert cache.allocate_pages(4) is not None  # 3 free: 1 short, the tail of the oldest
    assert rec.removed == [("a", keys[-1:])]
    assert cache.allocate_pages(5) is None  # more than free + evictable: nothing evicted
    assert cache.allocate_pages(4) is not None
    assert rec.removed[1:] == [("a", keys[:2][::-1]), ("b", block_keys(toks(5, 6), BS)[::-1])]
    check(cache)


def test_a_hash_collision_is_never_shared() -> None:
    cache, _ = make(8, paged=True)
    put(cache, toks(1))
    key = block_keys(toks(1), BS)[0]
    assert cache.match([key], 1, "", toks(5)).blocks == 0  # same key, other tokens
    pages = cache.allocate_pages(1)
    assert pages is not None
    result = cache.insert(cache.root(), [key], toks(5), None, None, pages)
    assert result.inserted == 0 and cache.allocated_tokens == BS  # still the caller's
    cache.free_pages(pages)
    check(cache)


PUBLIC = list(range(100, 112))  # 3 blocks


def test_public_prefix_is_shared_and_events_rebuild_the_tree() -> None:
    cache, rec = make(40, paged=True)
    a = PUBLIC + [1] * 8
    put(cache, a, "ta", public=3)
    assert cache.match(block_keys(a, BS, "tb", 3), None, "", a).blocks == 3  # public only
    put(cache, a, "tb", public=3)
    put(cache, a, "tc")  # tenant level: a root in its own namespace
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "", block_size=BS)
    mirror.apply(0, EventBatch(0.0, list(rec.events)), 0.0)
    assert index.residency("w", "") == cache.keys()
    assert mirror.stats().skipped_orphans == 0
    for salt, public in (("ta", 3), ("tb", 3), ("tc", 0)):
        assert index.match(block_keys(a, BS, salt, public), "") == {"w": 5}


def test_invalidating_a_tenant_frees_now_or_once_released() -> None:
    cache, rec = make(40, paged=True)
    a = PUBLIC + [1] * 8
    keys_a = block_keys(a, BS, "ta", 3)
    held = put(cache, a, "ta", public=3)
    cache.lock(held)  # running
    put(cache, PUBLIC + [2] * 8, user_salt("ta", "u"), public=3)
    put(cache, a, "tb", public=3)
    rec.removed.clear()
    gone = invalidate(cache, salt_scope(salt_prefix="ta"))
    check(cache)
    assert gone.freed_blocks == 2 and gone.locked_blocks == 2  # ta.u.* freed, ta locked
    removed = {k for _, keys in rec.removed for k in keys}
    user = block_keys(PUBLIC + [2] * 8, BS, user_salt("ta", "u"), 3)
    assert removed == set(keys_a[3:]) | set(user[3:])
    assert cache.match(keys_a, 5, "", a).blocks == 3  # the public part only
    assert cache.match(block_keys(a, BS, "tb", 3), 5, "", a).blocks == 5
    # nothing is cached under the invalidated path; released, its pages come back
    pages = cache.allocate_pages(1)
    assert pages is not None
    assert cache.insert(held, [keys_a[-1] + 1], [7] * BS, "ta", None, pages).inserted == 0
    cache.free_pages(pages)
    cache.unlock(held)
    check(cache)
    assert cache.allocate_pages((cache.free_tokens + cache.evictable_tokens) // BS) is not None
    check(cache)
    assert all(k >= 0 for _, keys in rec.removed for k in keys)
    assert invalidate(cache, None) == (0, 0) and len(cache) == 0


# -- a brute-force model of the same cache ----------------------------------------------------


@dataclass(slots=True)
class Block:
    group: str
    key: int
    parent: int | None  # the model id of the parent block
    ns: str | None  # the salt whose namespace holds it
    lock: int = 0
    stamp: int = 0
    dead: bool = False  # invalidated while locked: unmatchable, evicted once unlocked


class Model:
    """One dict entry per block; eviction scans for the least recently used unlocked leaf."""

    def __init__(self, capacity: int) -> None:
        self.blocks: dict[int, Block] = {}
        self.live: dict[tuple[str, int], int] = {}  # (group, key) -> id of a live block
        self.free = capacity
        self.allocated = 0
        self.tick = 0
        self.ids = 0

    def keys(self, group: str) -> set[int]:
        return {k for g, k in self.live if g == group}

    def match(self, group: str, keys: list[int], limit: int) -> list[int]:
        path = []
        for key in keys[:limit]:
            if (group, key) not in self.live:
                break
            path.append(self.live[group, key])
        self.tick += 1
        for i in path:
            self.blocks[i].stamp = self.tick
        return path

    def lock(self, path: list[int]) -> None:
        for i in path:
            self.blocks[i].lock += 1

    def unlock(self, path: list[int]) -> None:
        self.tick += 1
        for i in path:
            self.blocks[i].lock -= 1
            self.blocks[i].stamp = self.tick

    def evictable(self) -> int:
        return sum(BS for b in self.blocks.values() if b.lock == 0)

    def _drop(self, i: int) -> None:
        b = self.blocks.pop(i)
        self.free += BS
        if not b.dead:
            del self.live[b.group, b.key]

    def allocate(self, tokens: int) -> bool:
        if tokens > self.free + self.evictable():
            return False
        for _ in range(max(0, -(-(tokens - self.free) // BS))):
            parents = {b.parent for b in self.blocks.values()}
            leaves = [i for i, b in self.blocks.items() if b.lock == 0 and i not in parents]
            self._drop(min(leaves, key=lambda i: self.blocks[i].stamp))
        self.free -= tokens
        self.allocated += tokens
        return True

    def insert(
        self, group: str, path: list[int], keys: list[int], ns: list[str | None]
    ) -> list[int]:
        """The ids of the blocks now in the tree for `keys` (none under a dead parent)."""
        self.tick += 1
        self.allocated -= len(keys) * BS
        if path and self.blocks[path[-1]].dead:
            self.allocated += len(keys) * BS  # still the caller's
            return []
        parent = path[-1] if path else None
        out = []
        for key, salt in zip(keys, ns, strict=True):
            i = self.live.get((group, key))
            if i is None:
                i = self.ids = self.ids + 1
                self.blocks[i] = Block(group, key, parent, salt)
                self.live[group, key] = i
            else:
                self.free += BS
            self.blocks[i].stamp = self.tick
            out.append(i)
            parent = i
        return out

    def invalidate(self, scope: Callable[[str], bool] | None, group: str | None) -> None:
        for i, b in list(self.blocks.items()):
            if (group is not None and b.group != group) or b.dead:
                continue
            if scope is not None and (b.ns is None or not scope(b.ns)):
                continue
            if b.lock:
                b.dead = True
                del self.live[b.group, b.key]
            else:
                self._drop(i)


@dataclass(slots=True)
class Holder:
    group: str
    tokens: list[int]
    salt: str | None
    public: int
    keys: list[int]
    node: Run
    path: list[int]  # model ids of its locked blocks
    pages: list[int]  # its page table: the locked path's, then its private pages


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6 * BS), min_size=1, max_size=4)
ops = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "insert", "release", "touch", "invalidate"]),
        st.integers(0, 23),
    ),
    min_size=1,
    max_size=50,
)
SALTS = [None, "s1", user_salt("s1", "u"), "s2"]
GROUPS = ["a", "b"]


def _acquire(cache: RadixCache, model: Model, tokens: list[int], arg: int) -> Holder | None:
    group, salt = GROUPS[arg % 2], SALTS[arg % 4]
    public = arg % 3 if salt else 0
    keys = block_keys(tokens, BS, salt, public)
    cap = (len(tokens) - 1) // BS
    match = cache.match(keys, cap, group, tokens)
    path = model.match(group, keys, cap)
    assert match.blocks == len(path)
    cache.lock(match.node)
    model.lock(path)
    n = len(keys) - match.blocks + arg % 2
    pages = cache.allocate_pages(n)
    assert (pages is not None) == model.allocate(n * BS)
    if pages is None:
        cache.unlock(match.node)
        model.unlock(path)
        return None
    table = cache.path_pages(match.node) + pages
    return Holder(group, tokens, salt, public, keys, match.node, path, table)


def _insert(cache: RadixCache, model: Model, h: Holder, arg: int) -> None:
    b = len(h.path)
    end = min(len(h.keys), b + 1 + arg % 3)
    if end <= b:
        return
    new = h.keys[b:end]
    ns = [h.salt if j >= h.public else None for j in range(b, end)]
    ins = cache.insert(
        h.node, new, h.tokens[b * BS : end * BS], h.salt, h.public - b, h.pages[b:end]
    )
    ids = model.insert(h.group, h.path, new, ns)
    assert ins.inserted == len(ids) and ins.cached_blocks == len(ids) - ins.new_blocks
    if ins.inserted:
        assert ins.pages is not None
        h.pages[b:end] = ins.pages
        cache.move_lock(h.node, ins.node)
        model.lock(h.path + ids)  # the new node's whole path, as the cache's lock walks
        model.unlock(h.path)
        h.node, h.path = ins.node, h.path + ids


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=prompts, ops=ops, blocks=st.integers(2, 12))
def test_matches_a_brute_force_model(
    prompts: list[list[int]], ops: list[tuple[str, int]], blocks: int
) -> None:
    cache, rec = make(blocks, paged=True)
    model = Model(blocks * BS)
    holders: list[Holder] = []
    for op, arg in ops:
        tokens = prompts[arg % len(prompts)]
        if op == "acquire":
            h = _acquire(cache, model, tokens, arg)
            if h is not None:
                holders.append(h)
        elif op == "touch":  # a lookup that locks nothing
            group, salt = GROUPS[arg % 2], SALTS[arg % 4]
            keys = block_keys(tokens, BS, salt)
            assert cache.match(keys, None, group, tokens).blocks == len(
                model.match(group, keys, len(keys))
            )
        elif op == "invalidate":
            scope, group = [None, "s1", "s2"][arg % 3], [None, "a"][arg % 2]
            test = None if scope is None else salt_scope(salt_prefix=scope)
            invalidate(cache, test, group)
            model.invalidate(test, group)
        elif holders:
            h = holders[arg % len(holders)]
            if op == "insert":
                _insert(cache, model, h, arg)
            else:
                holders.remove(h)
                cache.free_pages(h.pages[len(h.path) :])
                cache.unlock(h.node)
                model.allocated -= (len(h.pages) - len(h.path)) * BS
                model.free += (len(h.pages) - len(h.path)) * BS
                model.unlock(h.path)
        in_tree = check(cache)
        private = [p for h in holders for p in h.pages[len(h.path) :]]
        assert len(set(private)) == len(private) and not set(private) & in_tree
        for group in GROUPS:
            assert cache.keys(group) == model.keys(group) == rec.keys.get(group, set())
        assert cache.free_tokens == model.free
        assert cache.allocated_tokens == model.allocated
        assert cache.evictable_tokens == model.evictable()
