"""The unified index against a brute-force model, plus LRU, TTL, pending residency and tenant
isolation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.blocks import block_keys
from router.index import UnifiedIndex
from router.index_scopes import invalidate

BS = 4
WORKERS = ["w0", "w1", "w2"]
GROUPS = ["llama", "qwen"]
TENANTS = [None, "tenant-a", "tenant-b"]
TTL = 10.0
PENDING_TTL = 3.0
MODES = ["exact", "approximate", "pending"]

# Prompts drawn from a tiny alphabet share long prefixes, as real traffic does.
prompt_st = st.lists(st.sampled_from([1, 2]), min_size=BS, max_size=6 * BS)


class Model:
    """Brute force: per resident, key -> (expiry, pending) (None: exact), and blocks stored."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], dict[int, tuple[float, bool] | None]] = {}
        self.stored: dict[tuple[str, str], int] = {}

    def insert(self, keys, worker, group, now, mode):
        held = self.held.setdefault((worker, group), {})
        stored = 0
        for key in keys:
            old = held.get(key, "absent")
            if mode == "exact":
                # new, or a pending block confirmed: stored now (approximate ones were already)
                stored += old == "absent" or (old is not None and old[1])
                held[key] = None
            elif old == "absent":
                held[key] = (now + (PENDING_TTL if mode == "pending" else TTL), mode == "pending")
                stored += mode == "approximate"
            elif old is not None:  # refreshed to the later expiry; exact is never demoted
                ttl = PENDING_TTL if mode == "pending" else TTL
                held[key] = (max(old[0], now + ttl), old[1])
        self.stored[(worker, group)] = self.stored.get((worker, group), 0) + stored

    def remove(self, keys, worker, group):
        held = self.held.get((worker, group), {})
        for key in keys:
            held.pop(key, None)

    def clear(self, worker, group):
        for w, g in list(self.held):
            if w == worker and group in (None, g):
                del self.held[(w, g)]

    def expire(self, now):
        for held in self.held.values():
            for key in [k for k, t in held.items() if t is not None and t[0] <= now]:
                del held[key]

    def forget_empty(self):
        """The index forgets a resident that holds nothing: its stored count starts over."""
        for resident in [r for r, held in self.held.items() if not held]:
            del self.held[resident]
        for resident in [r for r in self.stored if r not in self.held]:
            del self.stored[resident]

    def match(self, keys, group):
        out = {}
        for (w, g), held in self.held.items():
            if g != group:
                continue
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            if n:
                out[w] = n
        return out


op_st = st.one_of(
    st.tuples(
        st.just("insert"),
        prompt_st,
        st.sampled_from(WORKERS),
        st.sampled_from(GROUPS),
        st.sampled_from(TENANTS),
        st.sampled_from(MODES),
        st.integers(0, 5),
    ),
    st.tuples(
        st.just("remove"),
        prompt_st,
        st.sampled_from(WORKERS),
        st.sampled_from(GROUPS),
        st.sampled_from(TENANTS),
        st.integers(0, 5),
        st.booleans(),  # deepest key first, as an LRU cache evicts (the index's fast path)
    ),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.sampled_from([None, *GROUPS])),
    st.tuples(st.just("tick"), st.floats(0.5, 8.0)),
    st.tuples(st.just("match"), prompt_st, st.sampled_from(GROUPS), st.sampled_from(TENANTS)),
)


def _approximate(index: UnifiedIndex, key: int, worker: str, group: str) -> bool:
    bit = index._find(worker, group)
    return bit is not None and bit in index._approx.get(key, {})


def _pending(index: UnifiedIndex, key: int, worker: str, group: str) -> bool:
    bit = index._find(worker, group)
    return bit is not None and bool(index._pending.get(key, 0) >> bit & 1)


def _check_agree(index: UnifiedIndex, model: Model) -> None:
    index.check()
    for (w, g), held in model.held.items():
        assert index.residency(w, g) == set(held), (w, g)
        assert index.blocks_held(w, g) == len(held)
        assert index.sizes(w, g)[1] == model.stored[(w, g)], (w, g)
        for key, state in held.items():
            assert _approximate(index, key, w, g) == (state is not None)
            assert _pending(index, key, w, g) == (state is not None and state[1])


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=60))
def test_index_agrees_with_brute_force(ops):
    index = UnifiedIndex(approx_ttl_s=TTL, pending_ttl_s=PENDING_TTL)
    model, now = Model(), 0.0
    for op in ops:
        if op[0] == "insert":
            _, tokens, w, g, tenant, mode, skip = op
            keys = block_keys(tokens, BS, tenant)
            skip = min(skip, len(keys) - 1)
            # a chain may continue from a parent the caller already knows (as KV events do)
            parent = keys[skip - 1] if skip else None
            approximate, pending = mode == "approximate", mode == "pending"
            index.insert(
                keys[skip:], w, g, now, parent=parent, approximate=approximate, pending=pending
            )
            model.insert(keys[skip:], w, g, now, mode)
        elif op[0] == "remove":
            _, tokens, w, g, tenant, start, deepest_first = op
            keys = block_keys(tokens, BS, tenant)[start:]
            if deepest_first:
                keys.reverse()
            index.remove(keys, w, g)
            model.remove(keys, w, g)
        elif op[0] == "clear":
            index.clear(op[1], op[2])
            model.clear(op[1], op[2])
        elif op[0] == "tick":
            now += op[1]
            index.expire(now)
            model.expire(now)
        else:
            _, tokens, g, tenant = op
            keys = block_keys(tokens, BS, tenant)
            assert index.match(keys, g, now) == model.match(keys, g)
        model.forget_empty()
        _check_agree(index, model)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(prompt_st, st.sampled_from(WORKERS)), max_size=40), st.integers(1, 12))
def test_budget_evicts_whole_blocks_and_keeps_the_rest_exact(inserts, budget):
    index, model = UnifiedIndex(max_blocks=budget), Model()
    for t, (tokens, w) in enumerate(inserts):
        keys = block_keys(tokens, BS)
        index.insert(keys, w, "g", float(t))
        model.insert(keys, w, "g", float(t), "exact")
        index.check()
        assert len(index) <= budget
        for (worker, group), held in model.held.items():
            # eviction forgets a block for everyone; whatever is left is exactly what was held
            for key in [k for k in held if k not in index]:
                del held[key]
            assert index.residency(worker, group) == set(held)


def test_lru_evicts_least_recently_used_leaf_first():
    index = UnifiedIndex(max_blocks=6)
    a, b, c = (block_keys([i] * 8, BS) for i in (1, 2, 3))  # three 2-block chains
    index.insert(a, "w", "g", 1.0)
    index.insert(b, "w", "g", 2.0)
    index.insert(c, "w", "g", 3.0)
    assert index.match(a, "g", now=4.0) == {"w": 2}  # a is used again: b is now the oldest
    d = block_keys([4] * 4, BS)
    index.insert(d, "w", "g", 5.0)
    assert b[1] not in index and b[0] in index  # leaves go first
    assert all(k in index for k in a + c + d)
    index.insert(block_keys([5] * 4, BS), "w", "g", 6.0)
    assert b[0] not in index  # its parent became a leaf and went next
    index.check()


def test_tenants_never_share_keys():
    tokens = list(range(64))
    ka, kb, shared = (block_keys(tokens, 16, s) for s in ("tenant-a", "tenant-b", None))
    assert not set(ka) & set(kb) and not set(ka) & set(shared)
    index = UnifiedIndex()
    index.insert(ka, "w0", "g", 0.0)
    assert index.match(kb, "g") == {} and index.match(shared, "g") == {}
    assert index.match(ka, "g") == {"w0": 4}


def test_match_reports_each_worker_prefix_and_group():
    keys = block_keys(list(range(80)), 16)
    index = UnifiedIndex()
    index.insert(keys[:5], "w0", "g", 0.0)
    index.insert(keys[:2], "w1", "g", 0.0)
    index.insert(keys[:5], "w2", "other", 0.0)
    index.insert(keys[3:5], "w1", "g", 0.0, parent=keys[2])  # w1 holds blocks 0,1,3,4: prefix 2
    assert index.match(keys, "g") == {"w0": 5, "w1": 2}
    assert index.match(keys, "other") == {"w2": 5}
    assert index.match(keys, "missing") == {}


def test_approximate_entries_expire_unless_confirmed_or_exact():
    keys = block_keys(list(range(48)), 16)
    index = UnifiedIndex(approx_ttl_s=10.0)
    index.insert(keys, "w0", "g", 0.0, approximate=True)
    index.insert(keys[:1], "w1", "g", 0.0, approximate=True)
    index.insert(keys[:1], "w1", "g", 0.0)  # an event confirms it: exact from now on
    index.insert(keys[:2], "w0", "g", 8.0, approximate=True)  # routed again: TTL refreshed
    assert index.expire(10.0) == 1  # only keys[2] of w0 was not refreshed
    assert index.match(keys, "g") == {"w0": 2, "w1": 1}
    index.expire(18.0)
    assert index.match(keys, "g") == {"w1": 1}
    index.check()


def test_rejects_bad_configuration():
    with pytest.raises(ValueError):
        UnifiedIndex(max_blocks=-1)


def test_pending_blocks_match_at_once_and_events_confirm_them():
    keys = block_keys(list(range(64)), 16)
    index = UnifiedIndex(pending_ttl_s=5.0)
    assert index.insert(keys, "w0", "g", 0.0, pending=True) == 4
    assert index.match(keys, "g") == {"w0": 4}  # a follower sees the prefix before any event
    assert index.blocks_held("w0", "g") == 4 and index.sizes("w0", "g")[1] == 0
    # the worker's events confirm it in two chunks: exact, and stored once
    assert index.insert(keys[:2], "w0", "g", 1.0) == 2
    assert index.insert(keys[2:3], "w0", "g", 1.0, parent=keys[1]) == 1
    assert index.sizes("w0", "g")[1] == 3 and index.blocks_held("w0", "g") == 4
    assert not _approximate(index, keys[0], "w0", "g") and _pending(index, keys[3], "w0", "g")
    assert index.stats().pending == 1
    assert index.insert(keys[:3], "w0", "g", 1.5) == 0  # stored again: nothing new
    index.insert(keys, "w0", "g", 2.0, pending=True)  # another request: never demotes exact
    assert not _approximate(index, keys[0], "w0", "g")
    assert index.expire(6.9) == 0  # keys[3] was refreshed at 2.0
    assert index.expire(7.0) == 1  # never confirmed: gone
    assert index.match(keys, "g") == {"w0": 3}
    assert index.sizes("w0", "g")[1] == 3
    index.check()


def test_pending_blocks_go_with_clear_remove_and_scoped_invalidation():
    keys = block_keys(list(range(64)), 16, "tenant-a")
    index = UnifiedIndex()
    index.tag_namespace(keys[0], "tenant-a")
    index.insert(keys[:2], "w0", "g", 0.0)
    index.insert(keys, "w0", "g", 0.0, pending=True)
    index.insert(keys, "w1", "g", 0.0, pending=True)
    index.clear("w0", "g")  # a resync of w0: its pending entries go too
    assert index.match(keys, "g") == {"w1": 4} and index.stats().pending == 4
    assert index.remove(keys[2:], "w1", "g") == 2
    assert index.match(keys, "g") == {"w1": 2}
    assert invalidate(index, lambda salt: salt == "tenant-a") == 2
    assert index.match(keys, "g") == {} and index.stats().pending == 0
    index.check()
    # an exact confirmation after expiry counts once: the expired pending block never did
    index.insert(keys, "w2", "g", 0.0, pending=True)
    index.expire(100.0)
    assert index.insert(keys, "w2", "g", 101.0) == 4 and index.sizes("w2", "g")[1] == 4
    index.check()


def test_a_chain_repeating_a_key_leaves_the_tree_whole() -> None:
    """A malformed BlockStored that names a block twice, or names one it already holds further
    on, must not map a key twice."""
    index = UnifiedIndex()
    index.insert([1, 2, 2, 3], "w", "g", 0.0)
    index.check()
    assert index.residency("w", "g") == {1, 2, 3}
    index.insert([4, 5, 1, 6], "w", "g", 0.0, parent=3)
    index.check()
    assert index.residency("w", "g") == {1, 2, 3, 4, 5, 6}
    assert index.remove([6, 5, 4, 3, 2, 1], "w", "g") == 6
    index.check()
    assert len(index) == 0
