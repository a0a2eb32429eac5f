"""The C decoder of vLLM's batches (core/_kv_decode.c) gives the events msgspec gives, or
leaves the payload to msgspec (None); never another answer."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import kv_events
from core.kv_events import (
    BlockStored,
    BlockStoredPacked,
    BlockStoredRaw,
    EventBatch,
    decode_for_ingest,
    encode_batch,
)
from tests.core.test_kv_events import VLLM_STORED, batch_st, hash_st, medium_st

native = kv_events._native_decode
pytestmark = pytest.mark.skipif(native is None, reason="the C decoder is not built")

# vLLM's shape, tokens of every int encoding (negative, past int32: msgspec's path)
plain_stored_st = st.builds(
    BlockStored,
    block_hashes=st.lists(hash_st, max_size=4),
    parent_block_hash=st.none() | hash_st,
    token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=48)
    | st.lists(st.integers(-(2**40), 2**40), max_size=8),
    block_size=st.integers(1, 16),
    lora_id=st.none() | st.integers(0, 1000),
    medium=medium_st,
    lora_name=st.none() | st.text(max_size=8),
)
plain_batch_st = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(plain_stored_st, max_size=4),
    dp_rank=st.none() | st.integers(0, 7),
)


def _same(payload: bytes) -> object:
    """The C decoder's answer, checked against msgspec's ingest decode of the same payload."""
    got = native(payload)
    if got is None:
        return None
    assert isinstance(got, EventBatch) and got.unknown_events == 0
    ts, events, rank = got.ts, got.events, got.dp_rank
    want = kv_events._ingest_batch.decode(payload)  # the C decoder accepts only what this does
    assert (ts, rank, len(events)) == (want.ts, want.data_parallel_rank, len(want.events))
    for ev, raw in zip(events, want.events, strict=True):
        if not isinstance(raw, BlockStoredRaw):
            assert ev == raw
            continue
        assert isinstance(ev, BlockStoredPacked)
        fields, raw_fields = msgspec.structs.astuple(ev), msgspec.structs.astuple(raw)
        assert fields[:2] == raw_fields[:2] and fields[3:] == raw_fields[3:]
        assert ev.token_count() == raw.token_count()
        for n in (0, 1, raw.token_count() // ev.block_size):
            assert ev.chain_keys(n, b"\0\0\0\0") == raw.chain_keys(n, b"\0\0\0\0")
    return got


@settings(max_examples=400, deadline=None)
@given(batch=batch_st | plain_batch_st)
def test_the_c_decoder_gives_msgspecs_events(batch: EventBatch) -> None:
    payload = encode_batch(batch, array_like=False)
    got = _same(payload)
    int32 = all(
        not isinstance(ev, BlockStored) or all(-(2**31) <= t < 2**31 for t in ev.token_ids)
        for ev in batch.events
    )
    plain = all(not isinstance(ev, BlockStored) or ev.extra_keys is None for ev in batch.events)
    assert (got is not None) == (int32 and plain)  # vLLM's shape is its own
    assert (decode_for_ingest(payload) == got) if got else True


@settings(max_examples=400, deadline=None)
@given(
    batch=plain_batch_st, cut=st.integers(0, 400), flip=st.integers(0, 400), bit=st.integers(0, 7)
)
def test_a_broken_payload_is_msgspecs_to_judge(
    batch: EventBatch, cut: int, flip: int, bit: int
) -> None:
    payload = bytearray(encode_batch(batch, array_like=False))
    if flip < len(payload):
        payload[flip] ^= 1 << bit
    for data in (bytes(payload), bytes(payload[:cut])):
        try:
            _same(data)
        except msgspec.DecodeError:  # msgspec refused what the C decoder took
            pytest.fail(f"the C decoder took a payload msgspec refuses: {data!r}")


def test_vllm_events_decode_in_c() -> None:
    payload = msgspec.msgpack.encode([1.5, [VLLM_STORED, {"type": "AllBlocksCleared"}]])
    batch = decode_for_ingest(payload)
    assert isinstance(batch.events[0], BlockStoredPacked) and batch.ts == 1.5
    other = {**VLLM_STORED, "kv_cache_spec_kind": "full"}  # a field it lacks: msgspec's
    assert native(msgspec.msgpack.encode([1.5, [other]])) is None
