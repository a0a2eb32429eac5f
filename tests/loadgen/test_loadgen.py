"""urc bench, the pure parts: seeded workloads, multi-turn chaining, Mooncake conversion, route
headers and report math. Whole runs over HTTP are in test_loadgen_e2e.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.text import filler
from core.tokenizer import ByteTokenizer
from loadgen.client import RequestResult, Route, parse_route
from loadgen.mooncake import (
    TraceFormatError,
    block_text,
    parse_trace,
    record_prompt,
    trace_requests,
)
from loadgen.report import percentile, summarize
from loadgen.runner import KeyRing
from loadgen.sessions import SessionQueue
from loadgen.workloads import WORKLOADS, iter_requests, with_poisson_arrivals

TRACE = Path(__file__).resolve().parents[2] / "traces/mooncake_synthetic_trace.jsonl"
TOK = ByteTokenizer()


def common_prefix(a: Sequence, b: Sequence) -> int:
    lo, hi = 0, min(len(a), len(b))  # binary search on slice equality: C speed on long prompts
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- workloads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_same_seed_same_specs_and_another_seed_differs(name):
    models = ("m1", "m2")
    first = list(iter_requests(name, seed=7, models=models, n=40))
    assert first == list(iter_requests(name, seed=7, models=models, n=40))
    assert first != list(iter_requests(name, seed=8, models=models, n=40))
    assert [s.index for s in first] == list(range(40))


def test_filler_is_exact_byte_tokens_and_keyed():
    for n in (0, 1, 5, 16, 511, 512, 2000):
        text = filler(n, f"k{n}")
        assert len(TOK.encode(text)) == n and text.isascii() and "<|" not in text
    assert filler(64, "a") == filler(64, "a") != filler(64, "b")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_system_prompt_groups_share_exactly_the_prefix(kind):
    specs = list(iter_requests("system-prompts", n=120, groups=5, prefix_tokens=300, kind=kind))
    by_group: dict[str, list[str]] = {}
    for s in specs:
        if kind == "chat":
            system, user = s.messages
            assert system["role"] == "system" and len(user["content"]) == 48
            by_group.setdefault(s.group_id, []).append(system["content"] + user["content"])
        else:
            assert len(s.prompt) == 300 + 48
            by_group.setdefault(s.group_id, []).append(s.prompt)
    assert len(by_group) == 5
    prefixes = [texts[0][:300] for texts in by_group.values()]
    for texts in by_group.values():
        assert len({t[:300] for t in texts}) == 1  # one shared prefix of exactly 300 tokens
        assert len({t[300:] for t in texts}) == len(texts)  # distinct questions
    for i, a in enumerate(prefixes):  # groups diverge within the first 16-token block
        assert all(common_prefix(a, b) < 16 for b in prefixes[i + 1 :])


def test_multi_model_spreads_each_group_and_two_tenants_overlap():
    specs = list(iter_requests("multi-model", models=("a", "b"), n=200, groups=4))
    for g in {s.group_id for s in specs}:
        assert {s.model for s in specs if s.group_id == g} == {"a", "b"}
    specs = list(iter_requests("two-tenants", n=200, groups=4))
    for g in {s.group_id for s in specs}:
        same = [s for s in specs if s.group_id == g]
        assert {s.tenant for s in same} == {"tenant-a", "tenant-b"}
        assert len({s.messages[0]["content"] for s in same}) == 1


def test_multi_turn_next_request_extends_the_previous_one():
    specs = iter_requests("multi-turn", n=24, sessions=3, turns=4, system_tokens=40, user_tokens=20)
    queue = SessionQueue()
    for spec in specs:
        queue.add(spec)
    sent: dict[str, list[list[int]]] = {}
    rounds = 0
    while queue.ready:
        batch = []
        while (spec := queue.take()) is not None:
            batch.append(spec)
        assert len({s.session_id for s in batch}) == len(batch)  # one turn per session at a time
        for spec in batch:
            ids = TOK.encode_chat(spec.messages)
            history = sent.setdefault(spec.session_id, [])
            assert len(history) == spec.turn
            if history:  # the previous prompt, the reply, then the new user turn
                assert ids[: len(history[-1])] == history[-1]
                assert spec.messages[-2] == {"role": "assistant", "content": f"re {spec.turn - 1}"}
            history.append(ids)
            queue.complete(spec, f"re {spec.turn}")
        rounds += 1
    assert rounds == 4 and len(sent) == 6 and queue.dropped == 0
    assert all(len(h) == 4 for h in sent.values())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_session_queue_against_a_model_of_conversations(data):
    sessions, turns = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    chats = iter_requests("multi-turn", n=2 * sessions * turns, sessions=sessions, turns=turns)
    singles = iter_requests("system-prompts", n=4, prefix_tokens=8)
    specs = [dataclasses.replace(x, index=i) for i, x in enumerate([*chats, *singles])]
    new_messages = {x.index: x.messages for x in specs}
    # any interleaving of the sessions (and singles) that keeps each session's turns in order
    turns_of = {x.session_id: [y for y in specs if y.session_id == x.session_id] for x in specs}
    specs = [
        x if x.session_id is None else turns_of[x.session_id].pop(0)
        for x in data.draw(st.permutations(specs))
    ]
    queue, pending, in_flight = SessionQueue(), list(specs), []
    sent: dict[str, list[list[dict]]] = {}  # session -> the messages of each turn sent
    done = 0
    while True:
        actions = [
            a for a, ok in (("add", pending), ("take", queue.ready), ("done", in_flight)) if ok
        ]
        if not actions:
            break
        action = data.draw(st.sampled_from(actions))
        if action == "add":
            queue.add(pending.pop(0))
        elif action == "take":
            x = queue.take()
            assert x.session_id is None or x.session_id not in {y.session_id for y in in_flight}
            in_flight.append(x)
        else:
            x = in_flight.pop(data.draw(st.integers(0, len(in_flight) - 1)))
            if x.session_id is not None:
                history = sent.setdefault(x.session_id, [])
                assert x.turn == len(history)  # turns go out in order, each after the last
                prior = [*history[-1], {"role": "assistant", "content": "r"}] if history else []
                assert x.messages == prior + new_messages[x.index]
                history.append(x.messages)
            queue.complete(x, "r")
            done += 1
    assert done == len(specs) and queue.dropped == 0 and queue.waiting == 0


def test_a_failed_turn_ends_its_session():
    queue = SessionQueue()
    for spec in iter_requests("multi-turn", n=6, sessions=2, turns=3):
        queue.add(spec)
    first, second = queue.take(), queue.take()
    assert queue.take() is None  # their next turns wait
    queue.complete(first, None)
    queue.complete(second, "fine")
    nxt = queue.take()
    assert nxt.session_id == second.session_id and nxt.turn == 1
    assert queue.take() is None and queue.dropped == 2


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    specs = list(iter_requests("system-prompts", n=3000, prefix_tokens=8))
    times = [s.arrival_s for s in with_poisson_arrivals(specs, rate=50.0, seed=3)]
    assert times == [s.arrival_s for s in with_poisson_arrivals(specs, rate=50.0, seed=3)]
    assert times[0] == 0.0 and times == sorted(times)
    assert abs(times[-1] / (len(times) - 1) - 1 / 50.0) < 0.1 / 50.0


# --- Mooncake traces ------------------------------------------------------------------------------


def test_mooncake_shared_hash_ids_give_shared_text_of_exact_length():
    with TRACE.open() as f:
        records, bad = parse_trace(islice(f, 150), str(TRACE))
    assert not bad and len(records) == 150
    prompts = [record_prompt(r) for r in records]
    assert all(len(p) == r.input_length for p, r in zip(prompts, records, strict=True))
    shared_pairs = 0
    for i, a in enumerate(records):
        for j in range(i + 1, len(records)):
            b = records[j]
            k = common_prefix_len(a.hash_ids, b.hash_ids)
            if k == 0:
                assert common_prefix(prompts[i], prompts[j]) < 512
                continue
            shared_pairs += 1
            limit = min(k * 512, a.input_length, b.input_length)
            assert prompts[i][:limit] == prompts[j][:limit]
            if k < min(len(a.hash_ids), len(b.hash_ids)) and limit == k * 512:
                assert prompts[i][limit : limit + 512] != prompts[j][limit : limit + 512]
    assert shared_pairs >= 5  # the first lines of the real trace do reuse prefixes


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_mooncake_arrivals_caps_and_recorded_fields():
    lines = [
        '{"timestamp": 2000, "input_length": 600, "output_length": 900, "hash_ids": [1, 2]}',
        "",
        '{"timestamp": 1000, "input_length": 100, "output_length": 0, "hash_ids": [1],'
        ' "model": "other", "tenant": "t1", "worker": "w3", "cached_tokens": 64, "extra": 1}',
        '{"timestamp": 3000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2]}',
    ]
    records, _ = parse_trace(lines)
    specs = list(trace_requests(records, "m", time_scale=0.5, max_output_tokens=100))
    assert [s.arrival_s for s in specs] == [0.0, 0.5, 1.0]
    assert [s.max_tokens for s in specs] == [1, 100, 5]
    assert (specs[0].model, specs[0].tenant, specs[1].model) == ("other", "t1", "m")
    assert [len(s.prompt) for s in specs] == [100, 600, 1100]  # the last one has a unique tail
    two_blocks = block_text(1) + block_text(2)
    assert specs[0].prompt == two_blocks[:100] and specs[1].prompt == two_blocks[:600]
    assert specs[2].prompt[:1024] == two_blocks
    chat = next(trace_requests(records, "m", kind="chat"))
    assert chat.messages == [{"role": "user", "content": specs[0].prompt}]


def test_mooncake_bad_lines_are_reported_by_number():
    lines = [
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}',
        "{not json",
        '{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}',
        '{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}',
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["x"]}',
        "[1, 2]",
    ]
    with pytest.raises(TraceFormatError) as err:
        parse_trace(lines, "t.jsonl")
    assert [n for n, _ in err.value.errors] == [2, 3, 4, 5, 6]
    assert "line 4: 'input_length' must be an integer" in str(err.value)
    records, bad = parse_trace(lines, skip_bad=True)
    assert len(records) == 1 and len(bad) == 5


# --- results and report ---------------------------------------------------------------------------


def test_route_header_is_parsed_leniently():
    r = parse_route("worker=w1; matched_tokens=2048; prompt_tokens=4000; reason=cache_hit")
    assert (r.worker, r.matched_tokens, r.reason, r.prompt_tokens) == (
        "w1",
        2048,
        "cache_hit",
        4000,
    )
    r = parse_route('Worker: w2, Matched-Tokens: 16, load=3, reason="cold"')
    assert (r.worker, r.matched_tokens, r.reason, r.fields) == ("w2", 16, "cold", {"load": "3"})
    assert parse_route('{"worker": "w3", "matched_tokens": 32}').matched_tokens == 32
    assert parse_route("garbage").worker is None and parse_route(None) is None


def _result(i, *, error=None, ttft=None, lat=None, prompt=None, cached=None, pred=None, w=None):
    r = RequestResult(i, "m", None, None, None, 0.0, error=error, ttft_s=ttft, latency_s=lat)
    r.prompt_tokens, r.cached_tokens, r.output_tokens = prompt, cached, 10 if error is None else 0
    r.route = Route(worker=w, matched_tokens=pred) if w or pred is not None else None
    return r


def test_report_math():
    results = [
        _result(0, ttft=0.1, lat=1.0, prompt=1000, cached=500, pred=600, w="w1"),
        _result(1, ttft=0.2, lat=2.0, prompt=1000, cached=1000, pred=900, w="w1"),
        _result(2, ttft=0.3, lat=3.0, prompt=2000, cached=0, pred=0, w="w2"),
        _result(3, ttft=0.4, lat=4.0, prompt=500, cached=None, w="w2"),  # no cached report
        _result(8, ttft=0.4, lat=4.0, prompt=500, cached=None),  # the worker's header instead
        _result(4, error="http_503", w="w2"),
        _result(5, error="http_503"),
        _result(6, error="timeout"),
        _result(7, error="cancelled"),
    ]
    results[4].header_cached_tokens = 250
    s = summarize(results, duration_s=2.0, dropped=3, config={"target": "x"})
    assert s["counts"] == {"sent": 9, "ok": 5, "failed": 3, "cancelled": 1, "dropped": 3}
    assert s["errors"] == {"http_503": 2, "timeout": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.3) and s["ttft_s"]["mean"] == pytest.approx(0.28)
    assert s["ttft_s"]["p90"] == pytest.approx(0.4) and s["ttft_s"]["p99"] == pytest.approx(0.4)
    assert s["latency_s"]["p50"] == pytest.approx(3.0) and s["latency_s"]["max"] == 4.0
    assert s["throughput"] == {"requests_per_s": 2.5, "output_tokens_per_s": 25.0}
    assert s["hit_rate"] == pytest.approx(1750 / 4500)
    assert s["tokens"] == {"prompt": 5000, "cached": 1750, "output": 50}
    assert s["prediction"]["compared"] == 3
    assert s["prediction"]["mae_pct"] == pytest.approx((10 + 10 + 0) / 3)
    assert s["prediction"]["bias_pct"] == pytest.approx(0.0)
    assert s["workers"]["w1"] == {
        "requests": 2,
        "ok": 2,
        "prompt_tokens": 2000,
        "cached_tokens": 1500,
        "hit_rate": 0.75,
        "prediction_mae_pct": pytest.approx(10.0),
    }
    assert s["workers"]["w2"]["requests"] == 3 and s["workers"]["w2"]["ok"] == 2
    assert percentile([], 50) is None and percentile([5.0], 99) == 5.0
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([0, 10], 99) == pytest.approx(9.9)
    empty = summarize([], 0.0)
    assert empty["ttft_s"]["p50"] is None and empty["hit_rate"] is None


def test_key_ring_maps_tenants_to_keys():
    ring = KeyRing(["k0", "k1", "t9=special"])
    assert ring.key_for(None) == "k0" and ring.key_for("t9") == "special"
    assert [ring.key_for(t) for t in ("b", "a", "b", "c")] == ["k0", "k1", "k0", "k0"]
    assert KeyRing().key_for("x") is None
