"""The emulated worker's radix KV cache: match, insert, locks, LRU eviction of unlocked leaves for
the shortfall only, salt namespaces, and the integrity check after every operation, plus a
property test against a brute-force model of the same cache."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.emulated.radix_cache import RadixCache, Run
from core.blocks import block_keys

BS = 4


def toks(*blocks: int) -> list[int]:
    """One block of BS equal tokens per argument."""
    return [t for b in blocks for t in [b] * BS]


class Recorder:
    """What the callbacks say the cache holds (a KV event stream in miniature)."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.removed: list[int] = []

    def stored(
        self, parent: int | None, keys: list[int], tokens: list[int] | None, salt: str | None
    ) -> None:
        assert parent is None or parent in self.keys, "a store under an unknown parent"
        assert tokens is not None and len(tokens) == len(keys) * BS
        first = block_keys(tokens, BS, salt)[0] if parent is None else None
        assert first is None or first == keys[0], "a root block keyed outside its salt"
        assert self.keys.isdisjoint(keys)
        self.keys.update(keys)

    def gone(self, keys: list[int]) -> None:
        assert set(keys) <= self.keys
        self.keys.difference_update(keys)
        self.removed.extend(keys)


def make(capacity: int) -> tuple[RadixCache, Recorder]:
    rec = Recorder()
    return RadixCache(capacity, BS, on_stored=rec.stored, on_removed=rec.gone), rec


def put(cache: RadixCache, tokens: list[int], salt: str | None = None) -> Run:
    """Allocate, insert and unlock a whole prompt (as a finished request leaves it)."""
    keys = block_keys(tokens, BS, salt)
    match = cache.match(keys)
    cache.lock(match.node)
    assert cache.allocate((len(keys) - match.blocks) * BS)
    ins = cache.insert(match.node, keys[match.blocks :], tokens[match.blocks * BS :], salt)
    cache.unlock(match.node)
    cache.check()
    return ins.node


def test_match_insert_and_split() -> None:
    cache, rec = make(64)
    put(cache, toks(1, 2, 3))
    assert len(cache) == 3 and rec.keys == cache.keys()
    keys = block_keys(toks(1, 2, 9), BS)
    match = cache.match(keys)
    assert match.blocks == 2 and match.node.keys == keys[:2]  # the run was split
    cache.check()
    assert cache.match(block_keys(toks(1, 2, 3, 4), BS), max_blocks=2).blocks == 2
    assert cache.match(block_keys(toks(7), BS)).blocks == 0
    cache.check()


def test_insert_returns_what_was_cached_meanwhile() -> None:
    cache, _ = make(64)
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
    cache.check()
    cache.unlock(a.node)
    cache.check()


def test_eviction_takes_only_the_shortfall_from_unlocked_lru_leaves() -> None:
    cache, rec = make(10 * BS)
    put(cache, toks(1, 2, 3))
    put(cache, toks(4, 5, 6))
    put(cache, toks(7, 8))
    cache.match(block_keys(toks(1, 2, 3), BS))  # used again: 4,5,6 is now the oldest
    assert cache.free_tokens == 2 * BS
    assert cache.allocate(3 * BS + 1)  # 2 blocks short (1 token over a block)
    cache.check()
    gone = set(rec.removed)
    assert gone == set(block_keys(toks(4, 5, 6), BS)[1:])  # the tail of the oldest leaf only
    assert cache.free_tokens == BS - 1  # 2 blocks freed, 3 blocks + 1 token taken


def test_locked_paths_survive_and_allocation_fails_without_evicting() -> None:
    cache, rec = make(6 * BS)
    put(cache, toks(1, 2, 3))
    leaf = put(cache, toks(4, 5, 6))
    cache.lock(leaf)  # a running request holds 4,5,6 and, through it, nothing else
    cache.check()
    assert cache.protected_tokens == 3 * BS and cache.evictable_tokens == 3 * BS
    assert not cache.allocate(4 * BS)  # would need a locked block
    assert rec.removed == [] and len(cache) == 6
    assert cache.allocate(3 * BS)  # all of 1,2,3 goes, deepest first
    assert rec.removed == block_keys(toks(1, 2, 3), BS)[::-1]
    cached = cache.keys()  # a set of every cached key
    assert block_keys(toks(4, 5, 6), BS)[-1] in cached
    cache.check()
    cache.unlock(leaf)
    cache.free(3 * BS)
    cache.check()
    assert cache.evictable_tokens == 3 * BS and cache.free_tokens == 3 * BS


def test_a_parent_becomes_evictable_once_its_children_are_gone() -> None:
    cache, rec = make(4 * BS)
    put(cache, toks(1, 2))
    put(cache, toks(1, 2, 3))  # a child run under 1,2
    put(cache, toks(9, 9))
    cache.match(block_keys(toks(9, 9), BS))
    assert cache.allocate(4 * BS)  # everything, LRU: 3, then 2 and 1, then 9,9
    assert rec.removed[0] == block_keys(toks(1, 2, 3), BS)[-1]
    assert len(cache) == 0
    cache.check()


def test_salts_isolate() -> None:
    cache, rec = make(64)
    put(cache, toks(1, 2, 3), salt="tenant-a")
    assert cache.match(block_keys(toks(1, 2, 3), BS)).blocks == 0
    assert cache.match(block_keys(toks(1, 2, 3), BS, "tenant-b")).blocks == 0
    assert cache.match(block_keys(toks(1, 2, 3), BS, "tenant-a")).blocks == 3
    put(cache, toks(1, 2, 3))
    assert len(cache) == 6 and rec.keys == cache.keys()
    cache.check()


def test_repeated_touches_keep_one_lru_entry_per_leaf() -> None:
    cache, _ = make(64)
    put(cache, toks(1, 2))
    keys = block_keys(toks(1, 2), BS)
    for _ in range(5000):
        cache.match(keys)
    cache.check()  # the list holds exactly the unlocked leaves, in stamp order
    assert cache._lru.next is cache._lru.prev is not cache._lru


# -- a brute-force model of the same cache ----------------------------------------------------


@dataclass(slots=True)
class Block:
    parent: int | None
    lock: int = 0
    stamp: int = 0


class Model:
    """One dict entry per block; eviction scans for the least recently used unlocked leaf."""

    def __init__(self, capacity: int) -> None:
        self.blocks: dict[int, Block] = {}
        self.free = capacity
        self.allocated = 0
        self.tick = 0

    def _stamp(self, keys: list[int]) -> None:
        for key in keys:
            self.blocks[key].stamp = self.tick

    def match(self, keys: list[int], limit: int) -> int:
        m = 0
        while m < min(limit, len(keys)) and keys[m] in self.blocks:
            m += 1
        self.tick += 1
        self._stamp(keys[:m])
        return m

    def lock(self, path: list[int]) -> None:
        for key in path:
            self.blocks[key].lock += 1

    def unlock(self, path: list[int]) -> None:
        self.tick += 1
        for key in path:
            self.blocks[key].lock -= 1
        self._stamp(path)

    def evictable(self) -> int:
        return sum(BS for b in self.blocks.values() if b.lock == 0)

    def allocate(self, tokens: int) -> bool:
        if tokens > self.free + self.evictable():
            return False
        need = max(0, -(-(tokens - self.free) // BS))
        for _ in range(need):
            parents = {b.parent for b in self.blocks.values()}
            leaves = [k for k, b in self.blocks.items() if b.lock == 0 and k not in parents]
            victim = min(leaves, key=lambda k: self.blocks[k].stamp)
            del self.blocks[victim]
            self.free += BS
        self.free -= tokens
        self.allocated += tokens
        return True

    def insert(self, parent: int | None, keys: list[int]) -> int:
        self.tick += 1
        cached = 0
        for key in keys:
            if key in self.blocks:
                cached += 1
            else:
                self.blocks[key] = Block(parent)
            self.blocks[key].stamp = self.tick
            parent = key
        self.allocated -= len(keys) * BS
        self.free += cached * BS
        return cached


@dataclass(slots=True)
class Holder:
    tokens: list[int]
    salt: str | None
    keys: list[int]
    node: Run
    blocks: int  # of keys, locked in the tree
    reserved: int


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7 * BS), min_size=1, max_size=5)
ops = st.lists(
    st.tuples(st.sampled_from(["acquire", "insert", "release", "touch"]), st.integers(0, 20)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=prompts,
    salts=st.lists(st.sampled_from([None, "s"]), min_size=5, max_size=5),
    ops=ops,
    blocks=st.integers(2, 12),
)
def test_matches_a_brute_force_model(
    prompts: list[list[int]], salts: list[str | None], ops: list[tuple[str, int]], blocks: int
) -> None:
    cache, rec = make(blocks * BS)
    model = Model(blocks * BS)
    holders: list[Holder] = []
    for op, arg in ops:
        if op == "acquire":
            tokens, salt = prompts[arg % len(prompts)], salts[arg % len(salts)]
            keys = block_keys(tokens, BS, salt)
            cap = (len(tokens) - 1) // BS
            match = cache.match(keys, cap)
            assert match.blocks == model.match(keys, cap)
            need = len(tokens) - match.blocks * BS + arg % 3
            cache.lock(match.node)
            model.lock(keys[: match.blocks])
            ok = cache.allocate(need)
            assert ok == model.allocate(need)
            if ok:
                holders.append(Holder(tokens, salt, keys, match.node, match.blocks, need))
            else:
                cache.unlock(match.node)
                model.unlock(keys[: match.blocks])
        elif op == "touch":  # a lookup that locks nothing
            tokens, salt = prompts[arg % len(prompts)], salts[arg % len(salts)]
            keys = block_keys(tokens, BS, salt)
            assert cache.match(keys).blocks == model.match(keys, len(keys))
        elif holders:
            h = holders[arg % len(holders)]
            if op == "insert" and h.blocks < len(h.keys):
                end = min(len(h.keys), h.blocks + 1 + arg % 3)
                new = h.keys[h.blocks : end]
                parent = h.keys[h.blocks - 1] if h.blocks else None
                ins = cache.insert(h.node, new, h.tokens[h.blocks * BS : end * BS], h.salt)
                assert ins.cached_blocks == model.insert(parent, new)
                cache.lock(ins.node)
                cache.unlock(h.node)
                model.lock(h.keys[:end])
                model.unlock(h.keys[: h.blocks])
                h.node, h.reserved = ins.node, h.reserved - len(new) * BS
                h.blocks = end
            elif op == "release":
                holders.remove(h)
                cache.free(h.reserved)
                cache.unlock(h.node)
                model.allocated -= h.reserved
                model.free += h.reserved
                model.unlock(h.keys[: h.blocks])
        cache.check()
        assert cache.keys() == set(model.blocks) == rec.keys
        assert cache.free_tokens == model.free
        assert cache.allocated_tokens == model.allocated
        assert cache.evictable_tokens == model.evictable()
