"""The radix cache (backends/cache/) against a brute-force model: random sequences of match,
insert, lock, unlock, allocation with eviction and scoped invalidation over two kv_groups,
salts and public prefixes, on a paged cache, with `check` and the model compared after every
step."""

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
from router.gateway.isolation import user_salt
from tests.backends.test_radix_cache import BS, make

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
