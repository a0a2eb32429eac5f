"""Routing policies (docs/policies.md): each one's defining behaviour, the explanation contract."""

from __future__ import annotations

import copy
import math
import random
from bisect import bisect_right
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policies import (
    POLICY_NAMES,
    CacheAwarePolicy,
    Candidate,
    ConsistentHashPolicy,
    Decision,
    LeastLoadPolicy,
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    RouteRequest,
    SGLangCacheAwarePolicy,
    make_policy,
    policy_params,
)
from router.policies.cache_aware import RoutingHistory

BS = 16


def request(n_blocks: int, seed: int = 0, extra_tokens: int = 5) -> RouteRequest:
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(n_blocks)]
    return RouteRequest(keys, n_blocks * BS + extra_tokens, BS, "llama-8b")


def idle(*names: str) -> list[Candidate]:
    return [Candidate(name, 0) for name in names]


def assert_explains(decision: Decision, req: RouteRequest, candidates: list[Candidate]) -> None:
    assert decision.worker in {c.worker for c in candidates}
    assert [s.worker for s in decision.scores] == [c.worker for c in candidates]
    for s, c in zip(decision.scores, candidates, strict=True):
        usable = max(req.prompt_tokens - 1, 0) // req.block_size  # the last token is computed
        assert s.matched_tokens == min(c.matched_blocks, usable) * req.block_size
        assert s.load == c.in_flight
        assert isinstance(s.cost, float) and math.isfinite(s.cost)
    assert decision.ranked()[0] == decision.worker
    assert decision.reason


# --- cache_aware -------------------------------------------------------------------------------


def test_cache_aware_prefers_the_longest_prefix_when_loads_are_equal() -> None:
    req = request(32)
    cands = [Candidate("a", 4), Candidate("b", 20), Candidate("c", 0), Candidate("d", 19)]
    decision = CacheAwarePolicy().choose(req, cands)
    assert decision.worker == "b"
    assert decision.reason == "cache_hit"
    assert decision.matched_tokens == 20 * BS
    assert_explains(decision, req, cands)


def test_cache_aware_cost_is_the_documented_model() -> None:
    policy = CacheAwarePolicy(prefill_tokens_per_s=10_000.0, decode_token_s=1e-3, chunk_tokens=100)
    req = request(10, extra_tokens=0)  # 160 tokens
    cands = [
        Candidate("a", 4, in_flight=7, queued_prefill_tokens=140, running_decode=5),
        Candidate("b", 0, in_flight=1),
    ]
    # a: work = 140 + 160 - 64 = 236 tokens in 3 steps of 100, with 5 decodes riding along
    assert policy.ttft(req, cands[0]) == pytest.approx(236 / 10_000 + 3 * 5 * 1e-3)
    assert policy.ttft(req, cands[1]) == pytest.approx(160 / 10_000)
    # no history yet: every queue, and every worker's requests in flight, count in full;
    # nothing is known to be reused
    history = policy.history("llama-8b")
    assert (history.bound_share(BS), history.reuse(BS)) == (1.0, 0.0)
    decision = policy.choose(req, cands)
    for score, cand in zip(decision.scores, cands, strict=True):
        uncached = 160 - score.matched_tokens
        waiting = cand.in_flight  # the requests its uncached tokens delay
        assert score.cost == pytest.approx(policy.ttft(req, cand) + waiting * uncached / 10_000)


def test_cache_aware_cost_pools_backlogs_and_prices_evictions() -> None:
    policy = CacheAwarePolicy(prefill_tokens_per_s=10_000.0, decode_token_s=0.0, chunk_tokens=100)
    history = policy.history("llama-8b")
    history.record(hit=600, miss=400, free=True, cache_tokens=10**12)  # no decay to speak of
    history.record(hit=0, miss=400, free=False, cache_tokens=10**12)
    req = request(10, extra_tokens=0)  # 160 tokens
    full = Candidate(
        "full", 4, in_flight=3, queued_prefill_tokens=1000, stored_blocks=9, cached_blocks=5
    )
    room = Candidate(
        "room", 0, in_flight=1, queued_prefill_tokens=200, stored_blocks=3, cached_blocks=3
    )
    share = 1 - 400 / (800 + BS)  # half the recent uncached work was free to go anywhere
    reuse = 600 / (800 + BS)  # hit tokens per miss token
    assert (history.bound_share(BS), history.reuse(BS)) == pytest.approx((share, reuse))
    decision = policy.choose(req, [full, room])
    costs = {s.worker: s.cost for s in decision.scores}
    # full: backlog 600 + share * 400; 96 uncached tokens delay 2 + share * 1 requests each
    # (in flight, pooled as the backlog) and evict blocks that `reuse` says get used again;
    # room stores 160 tokens without evicting and delays 2 - share * 1 requests
    full_cost = (600 + share * 400) + 96 + 96 * (2 + share + reuse)
    assert costs["full"] == pytest.approx(full_cost / 10_000)
    assert costs["room"] == pytest.approx(((600 - share * 400) + 160 + 160 * (2 - share)) / 10_000)


def test_a_busy_fleet_keeps_the_prefix_where_it_is() -> None:
    req = request(64)  # 1029 tokens; the holder lacks 69 of them
    holder = Candidate("holder", 60, in_flight=1, queued_prefill_tokens=3000)
    other = Candidate("other", 0, in_flight=0, queued_prefill_tokens=1000)
    # own TTFT: holder 0.205 s, other 0.135 s; recomputing 960 tokens costs each waiting
    # request 64 ms, so it pays while the fleet is quiet and not once requests queue up
    assert CacheAwarePolicy().choose(req, [holder, other]).worker == "other"
    busy = [replace(holder, in_flight=4), replace(other, in_flight=4)]
    decision = CacheAwarePolicy().choose(req, busy)
    assert (decision.worker, decision.reason) == ("holder", "cache_hit")
    assert CacheAwarePolicy(externality=0).choose(req, busy).worker == "other"  # selfish


def test_cache_aware_sends_to_an_idle_worker_when_the_holders_queue_is_slower() -> None:
    policy = CacheAwarePolicy()
    req = request(64)  # 1029 tokens, nearly all held by "holder"
    busy = Candidate("holder", 64, in_flight=12, queued_prefill_tokens=60_000, running_decode=8)
    decision = policy.choose(req, [busy, Candidate("idle", 0)])
    assert decision.worker == "idle"
    assert decision.reason == "load"
    # the same holder with a short queue keeps the request: recomputing is slower
    short = replace(busy, queued_prefill_tokens=500)
    decision = policy.choose(req, [short, Candidate("idle", 0)])
    assert decision.worker == "holder"
    assert decision.reason == "cache_hit"


def test_requests_in_flight_on_the_holder_do_not_price_its_idle_peers() -> None:
    req = request(64)  # 1029 tokens; the holder of a shared prefix lacks 69 of them
    holder = Candidate("holder", 60, in_flight=40, queued_prefill_tokens=2000, running_decode=10)
    idle = [Candidate(f"idle{i}", 0) for i in range(3)]
    policy = CacheAwarePolicy()  # no history: every request so far was bound to a cache
    decision = policy.choose(req, [holder, *idle])
    # 40 requests wait behind the holder and none behind an idle worker: recomputing there
    # delays nobody else (a pooled count of requests in flight would have herded them)
    assert (decision.worker.startswith("idle"), decision.reason) == (True, "load")
    costs = {s.worker: s.cost for s in decision.scores}
    assert costs["idle0"] == pytest.approx(policy.ttft(req, idle[0]))


@given(
    queued=st.integers(0, 200_000),
    decode=st.integers(0, 256),
    matched=st.integers(0, 64),
    other_queued=st.integers(0, 200_000),
)
def test_cache_aware_picks_the_lowest_estimate_when_matches_differ(
    queued: int, decode: int, matched: int, other_queued: int
) -> None:
    policy = CacheAwarePolicy()
    req = request(64)
    cands = [
        Candidate("holder", matched, 3, queued, decode),
        Candidate("other", 0, 1, other_queued, 0),
    ]
    decision = policy.choose(req, cands)
    costs = {s.worker: s.cost for s in decision.scores}
    if matched > 0:
        assert costs[decision.worker] == min(costs.values())
    else:  # a cold miss may take any worker within the bound on the fastest wait
        waits = {c.worker: policy.ttft(req, c) for c in cands}
        best = min(waits.values())
        bound = best + max(policy.rendezvous_slack_s, policy.rendezvous_factor * best)
        assert waits[decision.worker] <= bound


def test_free_traffic_levels_the_queues_so_a_prefix_stays_home() -> None:
    req = request(64)  # 1029 tokens, 960 of them held by "holder"
    holder = Candidate("holder", 60, in_flight=2, queued_prefill_tokens=6000)
    other = Candidate("other", 0, in_flight=2)
    # every request so far had a home: queues are what they are, and recomputing is faster
    bound = CacheAwarePolicy()
    bound.history("llama-8b").record(hit=0, miss=50_000, free=False, cache_tokens=10**6)
    assert bound.choose(req, [holder, other]).worker == "other"
    # most recent work was free to go anywhere: it levels the queues, the prefix stays home
    free = CacheAwarePolicy()
    free.history("llama-8b").record(hit=0, miss=50_000, free=True, cache_tokens=10**6)
    decision = free.choose(req, [holder, other])
    assert (decision.worker, decision.reason) == ("holder", "cache_hit")


def test_storing_on_a_full_cache_costs_what_the_fleet_reuses() -> None:
    req = request(64)  # 1029 tokens
    holder = Candidate("holder", 8, stored_blocks=900, cached_blocks=800)  # full: it evicted
    roomy = Candidate("roomy", 0, stored_blocks=300, cached_blocks=300)
    assert CacheAwarePolicy().choose(req, [holder, roomy]).worker == "holder"  # nothing reused
    policy = CacheAwarePolicy()
    policy.history("llama-8b").record(hit=30_000, miss=10_000, free=False, cache_tokens=10**6)
    decision = policy.choose(req, [holder, roomy])
    assert (decision.worker, decision.reason) == ("roomy", "load")
    assert CacheAwarePolicy(cache_value=0).choose(req, [holder, roomy]).worker == "holder"


def test_routing_history_forgets_over_a_turnover_of_the_caches() -> None:
    history = RoutingHistory()
    history.record(hit=1000, miss=1000, free=True, cache_tokens=100_000)
    for _ in range(200):  # 100k more prompt tokens, all new and bound: one cache's worth
        history.record(hit=0, miss=500, free=False, cache_tokens=100_000)
    assert history.hit_tokens == pytest.approx(1000 / math.e, rel=0.02)
    assert history.free_tokens == pytest.approx(1000 / math.e, rel=0.02)
    assert 0.99 < history.bound_share(BS) < 1.0
    assert history.reuse(BS) == pytest.approx(history.hit_tokens / (history.miss_tokens + BS))


def test_cold_misses_agree_across_instances_and_spread_over_workers() -> None:
    names = [f"worker-{i}" for i in range(8)]
    cands = idle(*names)
    a, b = CacheAwarePolicy(), CacheAwarePolicy()
    homes = Counter()
    for seed in range(4000):
        req = request(3, seed=seed)
        choice = a.choose(req, cands)
        assert choice.reason == "cold_miss"
        assert b.choose(req, list(reversed(cands))).worker == choice.worker
        homes[choice.worker] += 1
    # 500 expected each; the binomial's sd is ~21, so this fails only on a broken hash
    assert set(homes) == set(names)
    assert all(400 < n < 600 for n in homes.values()), homes


def test_cold_miss_home_depends_on_the_first_block_only() -> None:
    policy = CacheAwarePolicy()
    cands = idle("a", "b", "c", "d", "e")
    base = request(4, seed=7)
    home = policy.choose(base, cands).worker
    for tail in range(20):
        keys = [base.block_keys[0], *request(3, seed=100 + tail).block_keys]
        assert policy.choose(replace(base, block_keys=keys), cands).worker == home


def test_cold_miss_fills_the_cache_that_took_least_lately_among_the_fast_enough() -> None:
    policy = CacheAwarePolicy()
    req = request(64)  # 1029 tokens: ~69 ms of prefill on an idle worker
    start = [Candidate(n, 0, stored_blocks=1000, cached_blocks=800) for n in "abcd"]
    policy.choose(req, start)  # first sight: nothing stored lately, the rendezvous decides
    cands = [replace(c, stored_blocks=1100) for c in start]
    cands[2] = replace(cands[2], stored_blocks=1020)  # c took 20 blocks since, the rest 100
    decision = policy.choose(req, cands)
    assert (decision.worker, decision.reason) == ("c", "cold_miss")
    # blocks routed and not yet prefilled count as taken: 200 queued blocks outweigh 80 stored
    queued = [replace(c, queued_prefill_tokens=200 * BS) if c.worker == "c" else c for c in cands]
    assert policy.choose(req, queued).worker != "c"
    # the emptiest cache loses once its queue puts it past the bound on the fastest wait
    best = policy.ttft(req, cands[0])
    bound = best + max(policy.rendezvous_slack_s, policy.rendezvous_factor * best)
    inside = int((bound - best) * policy.prefill_tokens_per_s) - 1
    cands[2] = replace(cands[2], queued_prefill_tokens=inside)
    assert policy.choose(req, cands).worker == "c"
    cands[2] = replace(cands[2], queued_prefill_tokens=inside + 50)
    decision = policy.choose(req, cands)
    assert decision.worker != "c" and decision.reason == "cold_miss"


def test_a_worker_that_joins_late_fills_up_then_takes_its_share() -> None:
    policy = CacheAwarePolicy()
    req = request(8)
    old = [Candidate(n, 0, stored_blocks=10**6, cached_blocks=800) for n in "ab"]
    policy.choose(req, old)
    fleet = [replace(c, stored_blocks=10**6 + 100) for c in old] + [Candidate("new", 0)]
    assert policy.choose(req, fleet).worker == "new"  # an empty cache: storing evicts nothing
    # it stored a cache's worth while the others took 100 blocks each: its turn is over,
    # though its count is a thousandth of theirs
    fleet = [replace(c, stored_blocks=10**6 + 200) for c in old]
    fleet.append(Candidate("new", 0, stored_blocks=800, cached_blocks=800))
    assert policy.choose(req, fleet).worker != "new"


def test_a_shared_prefix_held_everywhere_rendezvouses_on_the_first_new_block() -> None:
    policy = CacheAwarePolicy()
    req = request(5)
    cands = [Candidate(n, 2) for n in "abcdef"]  # everyone holds the system prompt
    decision = policy.choose(req, cands)
    assert decision.reason == "cache_hit"
    # another conversation after the same two blocks lands by its own third block
    homes = {
        policy.choose(replace(req, block_keys=[*req.block_keys[:2], k, 1, 2]), cands).worker
        for k in range(200)
    }
    assert len(homes) == len(cands)


def test_warm_ties_break_by_rendezvous_whatever_the_candidate_order() -> None:
    req = request(16)
    cands = [Candidate("x", 10), Candidate("y", 10), Candidate("z", 3, queued_prefill_tokens=7)]
    first = CacheAwarePolicy().choose(req, cands).worker
    assert first in {"x", "y"}
    assert CacheAwarePolicy().choose(req, cands[::-1]).worker == first


def test_a_prompt_without_a_full_block_takes_the_lowest_estimate() -> None:
    req = RouteRequest([], 9, BS, "g")
    cands = [Candidate("c", 0, 2), Candidate("b", 0, 1), Candidate("a", 0, 1)]
    assert CacheAwarePolicy().choose(req, cands).worker == "a"  # equal estimates: fewer, name
    cands.append(Candidate("d", 0, 9, running_decode=0, queued_prefill_tokens=0))
    cands[2] = replace(cands[2], queued_prefill_tokens=1)
    assert CacheAwarePolicy().choose(req, cands).worker == "b"


# --- baselines ---------------------------------------------------------------------------------


def test_round_robin_cycles_by_name_and_survives_set_changes() -> None:
    policy, req = RoundRobinPolicy(), request(2)
    picks = [policy.choose(req, idle("c", "a", "b")).worker for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    policy.choose(req, idle("c", "a", "b"))  # a
    assert policy.choose(req, idle("a", "c")).worker == "c"  # b left: no skip, no repeat
    assert policy.choose(req, idle("a", "c", "d")).worker == "d"  # d joined after c
    decision = policy.choose(req, idle("d", "a", "c"))
    assert decision.worker == "a"
    assert decision.ranked() == ["a", "c", "d"]


def test_least_load_breaks_ties_by_queue_then_name() -> None:
    req, policy = request(2), LeastLoadPolicy()
    cands = [Candidate("b", 5, 3), Candidate("a", 0, 4), Candidate("c", 0, 3)]
    assert policy.choose(req, cands).worker == "b"
    cands = [Candidate("b", 0, 3, 100), Candidate("a", 0, 3, 100), Candidate("c", 0, 3, 10)]
    assert policy.choose(req, cands).worker == "c"
    cands[2] = replace(cands[2], queued_prefill_tokens=100)
    assert policy.choose(req, cands).worker == "a"


def test_power_of_two_is_deterministic_per_seed() -> None:
    req = request(2)
    cands = [Candidate(f"w{i}", 0, i % 3) for i in range(6)]
    runs = [[PowerOfTwoPolicy(seed=s).choose(req, cands).worker for _ in range(50)] for s in (7, 7)]
    assert runs[0] == runs[1]
    other = PowerOfTwoPolicy(seed=8)
    assert [other.choose(req, cands).worker for _ in range(50)] != runs[0]


def test_power_of_two_never_keeps_the_worse_sample() -> None:
    req = request(2)
    cands = [Candidate("low", 0, 0), Candidate("mid", 0, 5), Candidate("high", 0, 10)]
    policy = PowerOfTwoPolicy(seed=3)
    picks = Counter(policy.choose(req, cands).worker for _ in range(6000))
    # pairs are uniform over {low,mid}, {low,high}, {mid,high}: low wins 2/3, mid 1/3
    assert picks["high"] == 0
    assert 3700 < picks["low"] < 4300 and 1700 < picks["mid"] < 2300
    # two distinct samples: with two workers the lower load always wins
    two = [Candidate("a", 0, 4), Candidate("b", 0, 1)]
    assert {policy.choose(req, two).worker for _ in range(200)} == {"b"}


def test_consistent_hash_moves_only_the_keys_of_a_removed_worker() -> None:
    policy = ConsistentHashPolicy()
    names = ["a", "b", "c", "d", "e"]
    reqs = [request(6, seed=s) for s in range(2000)]
    before = [policy.choose(r, idle(*names)).worker for r in reqs]
    assert set(Counter(before)) == set(names)
    after = [policy.choose(r, idle("a", "b", "d", "e")).worker for r in reqs]
    for old, new in zip(before, after, strict=True):
        assert new == old if old != "c" else new != "c"
    assert [policy.choose(r, idle(*names)).worker for r in reqs] == before
    assert [ConsistentHashPolicy().choose(r, idle(*reversed(names))).worker for r in reqs] == before
    # against the textbook ring: sorted virtual nodes, first one clockwise of the request
    ring = sorted((p, w) for w in names for p in policy.worker_points(w))
    for r, owner in zip(reqs, before, strict=True):
        at = bisect_right(ring, (policy.request_point(r), chr(0x10FFFF)))
        assert ring[at % len(ring)][1] == owner


def test_consistent_hash_keys_on_the_first_prefix_blocks() -> None:
    policy, cands = ConsistentHashPolicy(prefix_blocks=2), idle("a", "b", "c", "d")
    base = request(5, seed=1)
    home = policy.choose(base, cands).worker
    for s in range(30):  # same first two blocks, different rest
        keys = [*base.block_keys[:2], *request(3, seed=50 + s).block_keys]
        assert policy.choose(replace(base, block_keys=keys), cands).worker == home
    second = {
        policy.choose(replace(base, block_keys=[base.block_keys[0], k]), cands).worker
        for k in request(100, seed=9).block_keys
    }
    assert second == {"a", "b", "c", "d"}  # the second block is part of the key
    homes = {policy.choose(request(1, seed=s), cands).worker for s in range(100)}
    assert homes == {"a", "b", "c", "d"}  # shorter prompts use the blocks they have
    empty = RouteRequest([], 3, BS, "g")
    assert len({policy.choose(empty, cands).worker for _ in range(5)}) == 1
    points = policy.worker_points("a")
    policy.choose(base, idle("b", "a"))
    assert policy.worker_points("a") is points  # hashed once per worker, not per request


# --- sglang -----------------------------------------------------------------------------------


def sg(**params: Any) -> SGLangCacheAwarePolicy:
    return SGLangCacheAwarePolicy(**params)


def test_sglang_imbalanced_load_goes_to_the_least_loaded() -> None:
    req = request(10)
    cands = [
        Candidate("hot", 10, in_flight=100, cached_blocks=5),
        Candidate("cool", 0, in_flight=10, cached_blocks=900),
        Candidate("cool2", 0, in_flight=10),
    ]
    decision = sg().choose(req, cands)
    assert (decision.worker, decision.reason) == ("cool", "imbalanced")  # first minimum
    assert_explains(decision, req, cands)


def test_sglang_balanced_high_match_goes_to_the_best_matcher() -> None:
    req = request(10, extra_tokens=0)  # 160 tokens
    cands = [
        Candidate("small", 1, cached_blocks=1),
        Candidate("match", 4, in_flight=50, cached_blocks=10_000),  # 64/160 = 0.4 > 0.3
        Candidate("match2", 4, cached_blocks=10),
    ]
    decision = sg().choose(req, cands)
    assert (decision.worker, decision.reason) == ("match", "cache_hit")


def test_sglang_balanced_low_match_goes_to_the_smallest_tree() -> None:
    req = request(10, extra_tokens=0)
    cands = [
        Candidate("match", 2, cached_blocks=50),  # 32/160 = 0.2
        Candidate("small", 0, cached_blocks=7),
        Candidate("small2", 0, cached_blocks=7),
    ]
    decision = sg(tree_size="index").choose(req, cands)
    assert (decision.worker, decision.reason) == ("small", "smallest_tree")
    assert [s.cost for s in decision.scores] == [50.0, 7.0, 7.0]


def test_sglang_routed_trees_grow_with_what_was_sent() -> None:
    policy, cold = sg(), request(10, extra_tokens=0)
    cands = idle("a", "b", "c")
    # every tree starts empty: the first minimum, then whoever was sent the least new text
    assert [policy.choose(cold, cands).worker for _ in range(3)] == ["a", "b", "c"]
    warm = [Candidate("a", 10), Candidate("b", 0), Candidate("c", 0)]
    assert policy.choose(cold, warm).reason == "cache_hit"  # a held it all: its tree is unchanged
    busy = [Candidate("a", 0, 200), Candidate("b", 0, 0), Candidate("c", 0, 100)]
    assert policy.choose(cold, busy).reason == "imbalanced"  # inserted into b's tree all the same
    decision = policy.choose(cold, cands)
    assert (decision.worker, decision.reason) == ("a", "smallest_tree")
    assert [s.cost for s in decision.scores] == [160.0, 320.0, 160.0]
    other_group = replace(cold, kv_group="qwen")
    assert policy.choose(other_group, cands[::-1]).worker == "c"  # one tree per kv_group


def test_sglang_thresholds_are_strict() -> None:
    req = request(10, extra_tokens=0)
    tree = [Candidate("match", 3, cached_blocks=100), Candidate("small", 0, cached_blocks=1)]
    assert sg().choose(req, tree).reason == "smallest_tree"  # 48/160 == 0.3, not > 0.3
    assert sg(cache_threshold=0.29).choose(req, tree).worker == "match"

    def loads(high: int, low: int) -> list[Candidate]:
        return [Candidate("high", 10, high), Candidate("low", 0, low, cached_blocks=9)]

    assert sg().choose(req, loads(128, 64)).reason != "imbalanced"  # diff == 64
    assert sg().choose(req, loads(130, 65)).reason == "imbalanced"  # 65 > 64, 130 > 97.5
    assert sg().choose(req, loads(300, 200)).reason != "imbalanced"  # 300 == 200 * 1.5
    assert sg().choose(req, loads(301, 200)).worker == "low"
    assert sg().choose(RouteRequest([], 0, BS, "g"), tree).reason == "smallest_tree"


# --- registry and the contract for all ---------------------------------------------------------


def test_make_policy_builds_every_name_and_converts_strings() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    policy = make_policy("sglang", cache_threshold="0.5", balance_abs_threshold="32")
    assert policy.cache_threshold == 0.5 and policy.balance_abs_threshold == 32
    assert make_policy("consistent_hash", prefix_blocks="2.0").prefix_blocks == 2
    assert make_policy("power_of_two", seed="18446744073709551615").seed == 2**64 - 1
    assert policy_params("cache_aware")["chunk_tokens"] == 8192


def test_prefill_speed_is_the_fleets_one_setting() -> None:
    """A policy is told the fleet's prefill speed; given as its parameter, it is refused."""
    assert "prefill_tokens_per_s" not in policy_params("cache_aware")
    told = {"prefill_tokens_per_s": 2_000.0, "seed": 3}
    policy = make_policy("cache_aware", told, externality="0.5")
    assert isinstance(policy, CacheAwarePolicy)
    assert policy.prefill_tokens_per_s == 2_000.0 and policy.externality == 0.5
    assert make_policy("round_robin", told).name == "round_robin"  # takes neither
    with pytest.raises(ValueError, match="setting of the fleet"):
        make_policy("cache_aware", prefill_tokens_per_s=2_000.0)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("random", {}, "unknown policy 'random'"),
        ("sglang", {"threshold": 1}, "no parameter threshold"),
        ("least_load", {"seed": 1}, "no parameter seed"),
        ("sglang", {"balance_abs_threshold": "3.5"}, "not a valid int"),
        ("cache_aware", {"decode_token_s": "fast"}, "not a valid float"),
        ("cache_aware", {"decode_token_s": "nan"}, "not a valid float"),
        ("cache_aware", {"chunk_tokens": 0}, "must be positive"),
        ("consistent_hash", {"virtual_nodes": "0"}, "at least 1"),
        ("sglang", {"cache_threshold": 2}, "within"),
        ("sglang", {"tree_size": "chars"}, "routed"),
    ],
)
def test_make_policy_rejects_bad_names_and_params(name: str, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(name, **params)


@st.composite
def routing_cases(draw: st.DrawFn) -> tuple[RouteRequest, list[Candidate]]:
    block_size = draw(st.sampled_from([1, 4, 16]))
    keys = draw(st.lists(st.integers(0, 2**64 - 1), max_size=8))
    prompt = len(keys) * block_size + draw(st.integers(0, block_size - 1))
    names = draw(
        st.lists(
            st.text("abcdefgh-0123", min_size=1, max_size=6), min_size=1, max_size=6, unique=True
        )
    )
    cands = [
        Candidate(
            name,
            draw(st.integers(0, len(keys))),
            draw(st.integers(0, 300)),
            draw(st.integers(0, 100_000)),
            draw(st.integers(0, 200)),
            draw(st.integers(0, 10_000)),
        )
        for name in names
    ]
    return RouteRequest(keys, prompt, block_size, "g"), cands


VARIANTS = [(name, {}) for name in POLICY_NAMES] + [
    ("cache_aware", {"externality": "0"}),
    ("sglang", {"tree_size": "index"}),
    ("consistent_hash", {"prefix_blocks": "1", "virtual_nodes": "3"}),
]


@settings(max_examples=300, deadline=None)
@given(case=routing_cases(), variant=st.sampled_from(VARIANTS))
def test_every_policy_returns_a_candidate_and_explains_all(
    case: tuple[RouteRequest, list[Candidate]], variant: tuple[str, dict[str, str]]
) -> None:
    req, cands = case
    policy = make_policy(variant[0], **variant[1])
    for _ in range(3):  # stateful policies too
        assert_explains(policy.choose(req, cands), req, cands)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_used_policy_deep_copies_into_an_equal_twin(name: str) -> None:
    """The admin dry run routes with a deep copy; compiled policy state must copy too."""
    policy = make_policy(name)
    fleet = [Candidate(f"w{i}", i % 2, in_flight=i, stored_blocks=10 * i) for i in range(4)]
    for seed in range(5):
        policy.choose(request(8, seed), fleet)
    twin = copy.deepcopy(policy)
    for seed in range(5, 10):
        assert twin.choose(request(8, seed), fleet) == policy.choose(request(8, seed), fleet)
