"""Routing over two KV tiers (docs/tiers.md): the index's host-tier run after each worker's GPU
match against a brute-force model, the candidates and the load they add, and cache_aware's
price of a host hit (a copy against the prefill and the queue it saves)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.blocks import block_keys
from router.index import UnifiedIndex, host_group
from router.policies import Candidate, RouteRequest, WorkerLoad, make_policy
from router.route import Routing, candidates

BS = 4
G = "llama"
H = host_group(G)
WORKERS = ["w0", "w1"]

prompt_st = st.lists(st.sampled_from([1, 2]), min_size=BS, max_size=6 * BS)
op_st = st.tuples(
    st.sampled_from(["insert", "remove"]),
    prompt_st,
    st.sampled_from(WORKERS),
    st.sampled_from([G, H]),
    st.integers(0, 5),  # the first block of the chain's tail it acts on
)


def _keys(prompt: list[int]) -> list[int]:
    return block_keys(prompt, BS)


def _brute(held: dict[tuple[str, str], set[int]], keys: list[int]) -> dict[str, tuple[int, int]]:
    """worker -> (leading keys in its GPU tier, keys after those in its host tier, in a row)."""
    out: dict[str, tuple[int, int]] = {}
    for w in WORKERS:
        gpu, host = held.get((w, G), set()), held.get((w, H), set())
        g = 0
        while g < len(keys) and keys[g] in gpu:
            g += 1
        h = g
        while h < len(keys) and keys[h] in host:
            h += 1
        out[w] = (g, h - g)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=40), st.lists(prompt_st, min_size=1, max_size=4))
def test_host_run_after_the_gpu_match_agrees_with_brute_force(ops, queries) -> None:
    index = UnifiedIndex()
    held: dict[tuple[str, str], set[int]] = {}
    for op, prompt, worker, group, start in ops:
        keys = _keys(prompt)
        start = min(start, len(keys) - 1)
        tail = keys[start:]
        if op == "insert":
            parent = keys[start - 1] if start else None
            index.insert(tail, worker, group, 0.0, parent=parent)
            held.setdefault((worker, group), set()).update(tail)
        else:
            index.remove(tail[::-1], worker, group)
            held.get((worker, group), set()).difference_update(tail)
        index.check()
    for prompt in queries:
        keys = _keys(prompt)
        matched = index.match(keys, G)
        host = index.host_match(keys, G, matched) or {}
        got = {w: (matched.get(w, 0), host.get(w, 0)) for w in WORKERS}
        assert got == _brute(held, keys)


def test_host_only_prefix_partial_runs_gpu_then_host_and_removal() -> None:
    keys = _keys(list(range(10 * BS)))
    index = UnifiedIndex()
    assert index.host_match(keys, G, {}) is None  # no host tier anywhere: nothing read
    index.insert(keys[:6], "w0", H, 0.0)  # host only, from the root
    assert index.match(keys, G) == {}
    assert index.host_match(keys, G, {}) == {"w0": 6}
    index.insert(keys[:3], "w0", G, 0.0)  # GPU then host (inclusive: both hold 0-2)
    matched = index.match(keys, G)
    assert matched == {"w0": 3}
    assert index.host_match(keys, G, matched) == {"w0": 3}
    index.insert(keys[6:8], "w1", H, 0.0, parent=keys[5])  # another worker: a partial run
    assert index.host_match(keys, G, matched) == {"w0": 3}  # w1 lacks 0-5 in both tiers
    assert index.host_match(keys, G, {"w0": 3, "w1": 6}) == {"w0": 3, "w1": 2}  # from a depth
    index.remove([keys[4]], "w0", H)  # a hole in w0's host run
    assert index.host_match(keys, G, matched) == {"w0": 1}
    assert index.host_match(keys[:0], G, matched) == {}
    index.remove(keys[:6], "w0", H)
    assert index.host_match(keys, G, matched) == {}  # w1's host tier is still there
    index.check()


def test_candidates_carry_host_blocks_and_dispatch_queues_only_what_is_computed() -> None:
    keys = _keys(list(range(10 * BS)))
    index = UnifiedIndex(pending_ttl_s=5.0)
    index.insert(keys[:2], "w0", G, 0.0)
    index.insert(keys[2:7], "w0", H, 0.0, parent=keys[1])
    index.insert(keys[:4], "w1", G, 0.0)
    request = RouteRequest(keys, 10 * BS + 1, BS, G)
    loads = [WorkerLoad("w0"), WorkerLoad("w1")]
    w0, w1 = candidates(index, request, loads, 1.0)
    assert (w0.matched_blocks, w0.host_blocks, w1.matched_blocks, w1.host_blocks) == (2, 5, 4, 0)
    route = Routing(index).route(request, loads, make_policy("least_load"), 1.0)
    share = route.attempt("w0", G, False, loads[0], 1.0)
    assert share.uncached == request.prompt_tokens - 7 * BS  # the host's blocks are copied
    share.finish()
    # a GPU match still pending (not confirmed by events) does not reach the host run after it
    index.insert(keys[:2], "w2", G, 1.0, pending=True)
    index.insert(keys[2:5], "w2", H, 1.0, parent=keys[1])
    w2_load = WorkerLoad("w2")
    w2 = candidates(index, request, [w2_load], 1.0)[0]
    assert (w2.matched_blocks, w2.host_blocks) == (2, 3)
    route = Routing(index).route(request, [w2_load], make_policy("least_load"), 1.0)
    assert route.attempt("w2", G, False, w2_load, 1.0).uncached == request.prompt_tokens


def _explained(policy_name: str, prompt: int, cands: list[Candidate], **params: object):
    request = RouteRequest(list(range(1, prompt // 16 + 1)), prompt, 16, G)
    return make_policy(policy_name, **params).choose(request, cands)


def test_cache_aware_takes_a_host_hit_when_the_copy_beats_the_queue_it_avoids() -> None:
    # w0 holds an 8k-token prefix in its host tier behind a short queue; w1 is idle and cold
    cands = [Candidate("w0", 0, 1, 2000, 0, 0, 0, 512), Candidate("w1", 0, 0, 0, 0, 0, 0)]
    decision = _explained("cache_aware", 8200, cands)
    assert (decision.worker, decision.reason) == ("w0", "host_hit")
    scores = {s.worker: s for s in decision.scores}
    assert (scores["w0"].matched_tokens, scores["w0"].host_tokens) == (8192, 8192)
    assert decision.matched_tokens == 8192  # the prediction counts both tiers
    # w0's GPU holds half, its host tier the rest: still a host-tier win
    cands = [Candidate("w0", 256, 1, 2000, 0, 0, 0, 256), Candidate("w1", 0, 0, 0, 0, 0, 0)]
    decision = _explained("cache_aware", 8200, cands)
    assert decision.reason == "host_hit"
    assert (decision.scores[0].matched_tokens, decision.scores[0].host_tokens) == (8192, 4096)


def test_cache_aware_prefills_elsewhere_when_copying_a_huge_prefix_is_slower() -> None:
    # a 100k-token prefix on w0's host tier; copies at 10k tokens/s, prefill at 15k: w1 is faster
    cands = [Candidate("w0", 0, 0, 0, 0, 0, 0, 6250), Candidate("w1", 0, 0, 0, 0, 0, 0)]
    slow = _explained("cache_aware", 100_016, cands, host_copy_tokens_per_s=10_000.0)
    assert slow.worker == "w1"
    costs = {s.worker: s.cost for s in slow.scores}
    assert costs["w0"] > costs["w1"]
    fast = _explained("cache_aware", 100_016, cands)  # the default copy rate: 400k tokens/s
    assert (fast.worker, fast.reason) == ("w0", "host_hit")


def test_other_policies_read_gpu_matches_only() -> None:
    # sglang sees no match anywhere (host blocks are not read) and takes the smallest tree
    cands = [Candidate("w0", 0, 0, 0, 0, 9, 9, 512), Candidate("w1", 0, 0, 0, 0, 1, 1)]
    decision = _explained("sglang", 8200, cands, tree_size="index")
    assert (decision.worker, decision.reason) == ("w1", "smallest_tree")
