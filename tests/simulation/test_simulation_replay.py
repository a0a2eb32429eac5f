"""The replay loop: the index it feeds equals every worker's own cache, the load the policies
see moves exactly as the gateway's proxy moves it, the engines are driven as if alone, the
client sends as `urc bench` does (closed loop, open loop, sessions), and the bound holds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields

import pytest

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request, tail_keys
from core.blocks import block_keys
from router.index import host_group
from router.policies import Candidate, Decision, RouteRequest, make_policy
from simulation.compare import compare, infinite_cache_hit_rate
from simulation.replay import FleetConfig, Replay
from simulation.requests import SimRequest
from simulation.summary import summarize
from simulation.workloads import workload_requests

ENGINE_SETTINGS = {f.name for f in fields(EngineConfig)}


class Recorder:
    """A policy that records what it was shown and delegates to another."""

    def __init__(self, inner: str = "round_robin") -> None:
        self.inner = make_policy(inner)
        self.name = self.inner.name
        self.seen: list[tuple[RouteRequest, list[Candidate]]] = []

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        self.seen.append((request, list(candidates)))
        return self.inner.choose(request, candidates)


def small_fleet(**kw: object) -> FleetConfig:
    """Three workers of 12k tokens, 6 in flight; `kw`: settings of the fleet or of its engine."""
    engine: dict[str, object] = {"capacity_tokens": 12_000}
    fleet: dict[str, object] = {"workers": 3, "concurrency": 6}
    for key, value in kw.items():
        (engine if key in ENGINE_SETTINGS else fleet)[key] = value
    return FleetConfig(engine=EngineConfig(**engine), **fleet)  # type: ignore[arg-type]


def mixed(n: int = 240) -> list[SimRequest]:
    return workload_requests("mixed", n, seed=3)


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_the_index_ends_equal_to_every_workers_cache(delay_s: float) -> None:
    replay = Replay(mixed(), make_policy("cache_aware"), small_fleet(event_delay_s=delay_s))
    result = replay.run()
    assert all(result.ok) and result.events_applied > 0
    for w in replay.workers:
        assert w.engine.cache.stats().evicted_blocks > 0  # small caches: eviction happened
        assert replay.index.residency(w.name, w.kv_group) == w.engine.cache.keys()
        load = w.load
        assert (load.in_flight, load.queued_prefill_tokens, load.running_decode) == (0, 0, 0)
        w.engine.check()


def test_candidates_carry_the_index_and_the_gateways_load_view() -> None:
    policy = Recorder("cache_aware")
    replay = Replay(mixed(160), policy, small_fleet())
    result = replay.run()
    assert len(policy.seen) == 160
    for request, candidates in policy.seen:
        assert [c.worker for c in candidates] == ["w0", "w1", "w2"]
        for c in candidates:
            assert 0 <= c.matched_blocks <= len(request.block_keys)
            assert c.running_decode <= c.in_flight and c.queued_prefill_tokens >= 0
        assert sum(c.in_flight for c in candidates) <= 6 - 1  # closed loop: the others
    # predictions come from the index: mostly what the workers then reused
    predicted = sum(result.predicted_tokens)
    assert predicted == pytest.approx(sum(result.cached_tokens), rel=0.1)


def keyed(i: int, t: float, tokens: int, chat: bool) -> SimRequest:
    prompt = [(i * 7 + j) % 251 for j in range(tokens)]
    keys = block_keys(prompt, 16)
    tail = tail_keys(prompt, keys, 4, 16, None)
    route = RouteRequest(keys, tokens, 16, "g", "g")
    return SimRequest(i, t, prompt, 4, keys, tail, route, None, chat=chat)


@pytest.mark.parametrize("chat", [False, True])
def test_the_first_byte_is_the_first_token_for_chats_and_completions(chat: bool) -> None:
    """As the live proxy sees it: a prefill in progress is still queued work (a chat's role
    chunk rides on its first token)."""
    policy = Recorder()
    fleet = FleetConfig(
        workers=1, engine=EngineConfig(prefill_tokens_per_s=1000.0, decode_base_s=0.01)
    )
    reqs = [keyed(0, 0.0, 500, chat), keyed(1, 0.1, 40, chat)]
    Replay(reqs, policy, fleet).run()
    (only,) = policy.seen[1][1]  # what the second request saw: the first mid-prefill
    assert only.in_flight == 1
    assert (only.queued_prefill_tokens, only.running_decode) == (500, 0)


def test_the_hop_adds_to_what_the_client_sees_not_to_the_engines() -> None:
    reqs = [keyed(i, i * 0.03, 200 + 37 * (i % 5), chat=False) for i in range(20)]
    bare = Replay(reqs, make_policy("round_robin"), FleetConfig(workers=2)).run()
    hop = Replay(reqs, make_policy("round_robin"), FleetConfig(workers=2, hop_s=0.005)).run()
    assert hop.ttft_s == pytest.approx([t + 0.005 for t in bare.ttft_s], abs=1e-12)
    assert hop.latency_s == pytest.approx([t + 0.005 for t in bare.latency_s], abs=1e-12)
    assert hop.engine_steps == bare.engine_steps


def test_one_worker_is_driven_exactly_as_the_engine_alone() -> None:
    reqs = [keyed(i, i * 0.03, 200 + 37 * (i % 5), chat=False) for i in range(40)]
    fleet = FleetConfig(workers=1, engine=EngineConfig(capacity_tokens=3000), event_delay_s=0.0)
    result = Replay(reqs, make_policy("round_robin"), fleet).run()
    engine = EmulatedEngine(fleet.engine_config())
    alone = [Request(r.index, r.prompt, r.max_tokens, None, r.arrival_s, r.keys) for r in reqs]
    i = 0
    while True:
        t = engine.next_time()
        if i < len(alone) and (t is None or alone[i].arrival <= t):
            engine.submit(alone[i])
            i += 1
        elif t is None:
            break
        else:
            engine.step(t)
    for r, a in zip(reqs, alone, strict=True):
        assert result.cached_tokens[r.index] == a.cached_tokens
        assert result.ttft_s[r.index] == pytest.approx(a.first_token_time - a.arrival, abs=1e-12)
        assert result.latency_s[r.index] == pytest.approx(a.finish_time - a.arrival, abs=1e-12)


@pytest.mark.parametrize("concurrency", [6, None])
def test_one_event_per_forward_pass_gives_the_same_outcome(concurrency: int | None) -> None:
    reqs = workload_requests("mixed", 160, seed=5, rate=None if concurrency else 30.0)
    fleet = small_fleet(concurrency=concurrency)
    runs = [
        Replay(reqs, make_policy("cache_aware"), fleet, per_step=per_step).run()
        for per_step in (False, True)
    ]
    assert runs[0].engine_steps * 3 < runs[1].engine_steps  # decode stretches were skipped
    for name in ("worker", "cached_tokens", "predicted_tokens", "ttft_s", "latency_s", "ok"):
        assert getattr(runs[0], name) == getattr(runs[1], name), name


def test_closed_loop_keeps_concurrency_and_sessions_keep_their_order() -> None:
    reqs = workload_requests("multi-turn", 60, params={"sessions": 5, "turns": 4})
    result = Replay(reqs, make_policy("cache_aware"), small_fleet(concurrency=4)).run()
    spans = [(result.sent_s[i], result.sent_s[i] + result.latency_s[i]) for i in range(60)]
    for t, _ in spans:  # at each send, at most 4 in flight (itself included)
        assert sum(1 for s, e in spans if s <= t < e) <= 4
    last_end: dict[int, float] = {}
    for r in reqs:
        start, end = spans[r.index]
        assert start >= last_end.get(r.session, 0.0) - 1e-12
        last_end[r.session] = end
    assert summarize(result, reqs)["hit_rate"] > 0.5  # turns reuse the conversation so far


def test_open_loop_sends_at_arrival_times() -> None:
    reqs = workload_requests("system-prompts", 50, rate=20.0, params={"groups": 4})
    result = Replay(reqs, make_policy("least_load"), small_fleet(concurrency=None)).run()
    assert result.sent_s == [r.arrival_s for r in reqs]


def test_too_long_requests_are_rejected_and_end_their_session() -> None:
    reqs = workload_requests("multi-turn", 8, params={"sessions": 2, "turns": 4})
    fleet = small_fleet(concurrency=2, max_model_len=len(reqs[0].prompt) + 40)
    result = Replay(reqs, make_policy("round_robin"), fleet).run()
    summary = summarize(result, reqs)
    assert summary["rejected"] >= 2 and summary["dropped"] >= 2
    assert summary["completed"] + summary["rejected"] + summary["dropped"] == 8
    assert all(not math.isnan(result.ttft_s[i]) for i, ok in enumerate(result.ok) if ok)


def test_without_kv_events_the_gateways_routing_history_stands_in() -> None:
    reqs = mixed(160)
    replay = Replay(reqs, make_policy("cache_aware"), small_fleet(kv_events=False))
    result = replay.run()
    assert result.events_applied == 0 and sum(result.predicted_tokens) > 0
    assert replay.index.stats().approximate > 0
    assert summarize(result, reqs)["hit_rate"] > 0.2


def test_the_bound_caps_every_policy_and_cache_beats_blind_routing() -> None:
    reqs = workload_requests("system-prompts", 300, params={"groups": 12})
    fleet = small_fleet(workers=4, capacity_tokens=10_000, concurrency=8)
    comparison = compare(reqs, ["cache_aware", "sglang", "round_robin"], fleet)
    hit = {name: run.summary["hit_rate"] for name, run in comparison.runs.items()}
    assert comparison.bound == pytest.approx(infinite_cache_hit_rate(reqs))
    assert all(h <= comparison.bound + 1e-9 for h in hit.values())  # type: ignore[operator]
    assert hit["cache_aware"] > hit["round_robin"] + 0.2
    assert hit["sglang"] > hit["round_robin"] + 0.2


def test_with_a_host_tier_the_index_ends_equal_to_both_tiers_of_every_worker() -> None:
    fleet = small_fleet(capacity_tokens=6_000, host_capacity_tokens=24_000)
    replay = Replay(mixed(), make_policy("cache_aware"), fleet)
    result = replay.run()
    assert all(result.ok)
    for w in replay.workers:
        host = w.engine.host
        assert host is not None and host.stats().demoted_blocks > 0
        assert replay.index.residency(w.name, w.kv_group) == w.engine.cache.keys()
        assert replay.index.residency(w.name, host_group(w.kv_group)) == host.keys()
        w.engine.check()
    summary = summarize(result, replay.requests)
    assert summary["host_cached_tokens"] == sum(result.host_tokens) > 0
    assert summary["hit_rate"] == pytest.approx(summary["gpu_hit_rate"] + summary["host_hit_rate"])
    again = Replay(mixed(), make_policy("cache_aware"), fleet).run()
    assert again.cached_tokens == result.cached_tokens and again.ttft_s == result.ttft_s
    assert again.host_tokens == result.host_tokens
    without = Replay(mixed(), make_policy("cache_aware"), small_fleet(capacity_tokens=6_000))
    assert sum(without.run().cached_tokens) < sum(result.cached_tokens)
