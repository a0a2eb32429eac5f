"""What the simulator replays: published Mooncake traces and gateway recordings read into
requests (keys per hash id, full blocks only, output blocks linked to the next turn), built-in
workloads tokenized exactly as the live gateway tokenizes them, and such requests through the
emulated engine without a single token id (keys and tail keys given, events without tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request, output_tokens, tail_keys
from core.blocks import block_keys
from core.kv_events import BlockStored
from core.tokenizer import ByteTokenizer
from loadgen.mooncake import TraceFormatError
from loadgen.workloads import iter_requests
from simulation.compare import infinite_cache_hit_rate
from simulation.requests import KeyedPrompt
from simulation.traces import parse_trace, trace_requests
from simulation.workloads import workload_requests

TRACE = Path(__file__).resolve().parents[2] / "traces/mooncake_synthetic_trace.jsonl"


def line(ts: float, n: int, out: int, ids: list[int], **extra: object) -> str:
    row = {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids, **extra}
    return json.dumps(row)


def test_equal_hash_id_prefixes_are_equal_key_prefixes_and_only_full_blocks_count() -> None:
    trace = parse_trace(
        [
            line(0, 3 * 512 + 100, 5, [1, 2, 3, 4]),  # the 4th id is a partial block
            line(10, 2 * 512, 5, [1, 2]),
            line(20, 3 * 512, 5, [1, 9, 10]),
            line(30, 3 * 512, 5, [1, 2, 3], tenant="t"),
        ]
    )
    assert trace.block_size == 512 and not trace.recorded
    a, b, c, d = trace_requests(trace)
    assert len(a.keys) == 3 and len(a.prompt) == 3 * 512 + 100
    assert b.keys == a.keys[:2]
    assert c.keys[0] == a.keys[0] and c.keys[1] != a.keys[1]
    assert not set(d.keys) & set(a.keys)  # another tenant: another namespace
    assert [r.arrival_s for r in (a, b, c, d)] == [0.0, 0.01, 0.02, 0.03]
    assert a.route.block_keys is a.keys and a.route.prompt_tokens == 3 * 512 + 100
    assert a.route.block_size == 512


def test_output_blocks_are_keyed_as_the_next_turn_that_extends_the_prompt() -> None:
    trace = parse_trace(
        [
            line(0, 2 * 512 + 400, 300, [1, 2, 3]),  # prompt + output: 4 full blocks, 2 keyed
            line(5, 2 * 512 + 10, 600, [7, 8, 9]),  # nothing extends it
            line(10, 5 * 512, 8, [1, 2, 30, 31, 32]),  # the next turn of the first
        ]
    )
    first, lone, turn = trace_requests(trace)
    assert len(first.tail_keys) == 1 and first.tail_keys == turn.keys[2:3]
    assert len(lone.tail_keys) == 1 and lone.tail_keys[0] not in turn.keys
    assert infinite_cache_hit_rate([first, lone, turn]) == pytest.approx(
        3 * 512 / (2 * 512 + 400 + 2 * 512 + 10 + 5 * 512)
    )


def test_a_recording_uses_its_hash_ids_as_the_gateway_keys() -> None:
    keys = block_keys(list(range(64)), 16)
    lines = [
        json.dumps({"urc_record": 1, "block_size": 16}),
        line(
            0,
            70,
            4,
            keys,
            model="m",
            tenant="acme",
            worker="w1",
            cached_tokens=32,
            predicted_tokens=32,
            policy="cache_aware",
        ),
        line(3, 40, 4, keys[:2], model="m", cached_tokens=16),
    ]
    trace = parse_trace(lines)
    assert trace.recorded and trace.block_size == 16 and trace.policy == "cache_aware"
    assert trace.recorded_hit_rate() == pytest.approx(48 / 110)
    first, second = trace_requests(trace)
    assert first.keys == keys and second.keys == keys[:2] and first.kv_group == "m"
    per_line = parse_trace([line(0, 70, 4, keys, block_size=16)])
    assert per_line.recorded and per_line.block_size == 16
    with pytest.raises(TraceFormatError):
        parse_trace([line(0, 70, 4, keys, block_size=16), line(1, 70, 4, keys, block_size=32)])


def test_hash_ids_beyond_int32_are_renamed_not_lost() -> None:
    big = 2**40
    trace = parse_trace([line(0, 1024, 1, [big, big + 1]), line(1, 1024, 1, [big, big + 2])])
    a, b = trace_requests(trace)
    assert a.keys[0] == b.keys[0] and a.keys[1] != b.keys[1]


def test_bad_lines_are_reported_or_skipped() -> None:
    lines = [line(0, 10, 1, [1]), "{not json", json.dumps({"timestamp": 1})]
    with pytest.raises(TraceFormatError) as err:
        parse_trace(lines)
    assert [n for n, _ in err.value.errors] == [2, 3]
    assert len(parse_trace(lines, skip_bad=True).records) == 1


def test_workload_prompts_are_the_live_gateways_tokens() -> None:
    tok = ByteTokenizer()
    reqs = workload_requests("multi-turn", 12, params={"sessions": 3, "turns": 4})
    specs = list(iter_requests("multi-turn", 0, ["emulated"], 12, sessions=3, turns=4))
    first = reqs[0]
    assert first.chat and first.prompt == tok.encode_chat(specs[0].messages)
    assert first.keys == block_keys(first.prompt, 16)
    later = [r for r in reqs if r.session == first.session][1]
    reply = bytes(output_tokens(first.max_tokens)).decode()
    assert later.prompt[: len(first.prompt)] == first.prompt  # the next turn extends it
    assert reply.encode() in bytes(t for t in later.prompt if t < 256)
    # the output blocks the engine caches on finish are the next turn's blocks
    assert later.keys[len(first.keys) : len(first.keys) + len(first.tail_keys)] == first.tail_keys


def test_keyed_requests_run_through_the_engine_without_token_ids() -> None:
    """A trace request (KeyedPrompt) and the same prompt as real tokens fill the cache alike."""
    bs = 16
    tokens = [i % 251 for i in range(100)]
    keys = block_keys(tokens, bs)
    tail = tail_keys(tokens, keys, 40, bs, None)
    assert len(tail) == (100 + 40 - 1) // bs - len(keys) == 2
    runs = []
    for keyed in (False, True):
        cfg = EngineConfig(block_size=bs, capacity_tokens=4096, event_tokens=not keyed)
        engine = EmulatedEngine(cfg)
        prompt = KeyedPrompt(100) if keyed else tokens
        req = Request("a", prompt, 40, keys=keys, tail_keys=tail if keyed else None)
        engine.submit(req)
        events = []
        while (t := engine.next_time()) is not None:
            events += engine.step(t).events
            engine.check()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert all((e.token_ids == []) == keyed for e in stored)
        runs.append((engine.cache.keys(), req.first_token_time, req.finish_time))
    assert runs[0] == runs[1]


def test_the_shared_trace_reads_into_512_token_blocks() -> None:
    from simulation.traces import read_trace

    trace = read_trace(TRACE)
    reqs = trace_requests(trace)
    assert trace.block_size == 512 and len(reqs) == len(trace.records)
    assert sum(len(r.keys) for r in reqs) / len(reqs) < 40  # tens of blocks, not ~900
    assert 0.6 < infinite_cache_hit_rate(reqs) < 0.7  # type: ignore[operator]
