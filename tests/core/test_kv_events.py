"""The KV events codec against vLLM's wire shapes, garbage, and a round-trip property."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
)

TOKENS = list(range(1000, 1016))

# What vLLM publishes today: a positional batch of tagged-map events (omit_defaults drops
# the optional tail; hybrid models add group and cache-spec fields).
VLLM_STORED = {
    "type": "BlockStored",
    "block_hashes": [343429812149760049],
    "parent_block_hash": 17181225506417498511,
    "token_ids": TOKENS,
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
VLLM_STORED_HYBRID = {
    **VLLM_STORED,
    "parent_block_hash": None,
    "extra_keys": [None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 4096,
}
VLLM_REMOVED = {"type": "BlockRemoved", "block_hashes": [343429812149760049], "medium": "GPU"}
VLLM_CLEARED = {"type": "AllBlocksCleared"}

# Older vLLM: everything positional, events tagged by their first element.
VLLM_STORED_POS = [
    "BlockStored",
    [343429812149760049],
    17181225506417498511,
    TOKENS,
    16,
    None,
    "GPU",
]
VLLM_REMOVED_POS = ["BlockRemoved", [343429812149760049], "GPU"]


def pack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_decodes_vllm_map_events_in_positional_batch() -> None:
    payload = pack([1718000000.25, [VLLM_STORED, VLLM_REMOVED, VLLM_CLEARED], 0])
    batch = decode_batch(payload)
    assert batch.ts == 1718000000.25 and batch.dp_rank == 0 and batch.unknown_events == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        [343429812149760049], 17181225506417498511, TOKENS, 16, None, "GPU", None
    )
    assert removed == BlockRemoved([343429812149760049], "GPU")
    assert cleared == AllBlocksCleared()


def test_decodes_hybrid_fields_and_ignores_unknown_ones() -> None:
    (stored,) = decode_batch(pack([1.0, [VLLM_STORED_HYBRID]])).events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None and stored.group_idx == 1
    assert stored.extra_keys == [None] and stored.cache_salt is None


def test_decodes_positional_events_with_trailing_fields() -> None:
    extra = [*VLLM_STORED_POS, "lora-x", [None], 0, "full_attention", None, "future"]
    batch = decode_batch(
        pack([2.0, [VLLM_STORED_POS, extra, VLLM_REMOVED_POS, ["AllBlocksCleared"]]])
    )
    assert batch.dp_rank is None
    plain, longer, removed, cleared = batch.events
    assert isinstance(plain, BlockStored) and plain.medium == "GPU" and plain.lora_name is None
    assert isinstance(longer, BlockStored) and longer.lora_name == "lora-x"
    assert longer.group_idx == 0 and longer.token_ids == TOKENS
    assert removed == BlockRemoved([343429812149760049], "GPU")
    assert cleared == AllBlocksCleared()


def test_decodes_map_batch() -> None:
    salted = {**VLLM_STORED, "parent_block_hash": None, "cache_salt": "tenant-a"}
    batch = decode_batch(pack({"ts": 3, "events": [salted], "data_parallel_rank": 2, "x": 1}))
    assert batch.ts == 3.0 and batch.dp_rank == 2
    assert batch.events[0].cache_salt == "tenant-a"  # type: ignore[union-attr]
    assert decode_batch(pack({"ts": 3.5, "events": []})).dp_rank is None


def test_bytes_hashes_are_kept_as_given() -> None:
    digest = bytes(range(32))
    ev = {**VLLM_STORED, "block_hashes": [digest], "parent_block_hash": b"\x01" * 32}
    (stored,) = decode_batch(pack([1.0, [ev]])).events
    assert stored.block_hashes == [digest]  # type: ignore[union-attr]
    assert stored.parent_block_hash == b"\x01" * 32  # type: ignore[union-attr]
    assert hash(stored.block_hashes[0]) == hash(digest)  # type: ignore[union-attr]


def test_unknown_event_types_are_skipped_and_counted() -> None:
    events = [{"type": "BlockPinned", "block_hashes": [1]}, VLLM_REMOVED, ["Future", 1, 2]]
    batch = decode_batch(pack([1.0, events]))
    assert batch.events == [BlockRemoved([343429812149760049], "GPU")]
    assert batch.unknown_events == 2


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack opcode
        b"\x07",
        pack("a string"),
        pack([]),
        pack(["ts", []]),
        pack([1.0, "not a list"]),
        pack([1.0, [1]]),  # an event that is neither array nor map
        pack([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # fields missing
        pack([1.0, [{"type": "BlockRemoved", "block_hashes": ["str"]}]]),  # bad hash type
        pack([1.0, [["BlockStored", [1], None, "tokens", 16]]]),
        pack([1.0, [{"no": "type"}]]),
        pack({"events": []}),
        pack([1.0, []]) + b"trailing",
    ],
)
def test_garbage_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_cache_salt_travels_only_in_map_encoding() -> None:
    ev = BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", cache_salt="s")
    batch = EventBatch(1.0, [ev], 0)
    assert decode_batch(encode_batch(batch, array_like=False)) == batch
    (positional,) = decode_batch(encode_batch(batch, array_like=True)).events
    assert positional.cache_salt is None  # type: ignore[union-attr]
    assert msgspec.msgpack.decode(encode_batch(batch, array_like=True))[1][0][:7] == [
        "BlockStored",
        [1, 2],
        None,
        list(range(8)),
        4,
        None,
        "GPU",
    ]


hash_st = st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**63), -1), st.binary(max_size=32))
medium_st = st.sampled_from([None, "GPU", "CPU"])
stored_st = st.builds(
    BlockStored,
    block_hashes=st.lists(hash_st, max_size=4),
    parent_block_hash=st.none() | hash_st,
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=64),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 1000),
    medium=medium_st,
    lora_name=st.none() | st.text(max_size=8),
    extra_keys=st.none() | st.lists(st.none() | st.lists(st.text(max_size=4), max_size=2)),
    group_idx=st.none() | st.integers(0, 3),
)
event_st = st.one_of(
    stored_st,
    st.builds(BlockRemoved, block_hashes=st.lists(hash_st, max_size=4), medium=medium_st),
    st.just(AllBlocksCleared()),
)
batch_st = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(event_st, max_size=6),
    dp_rank=st.none() | st.integers(0, 7),
)


@settings(max_examples=300, deadline=None)
@given(batch=batch_st, array_like=st.booleans(), salt=st.none() | st.text(max_size=8))
def test_round_trip(batch: EventBatch, array_like: bool, salt: str | None) -> None:
    if not array_like:  # the salt rides only in the map encoding
        batch.events = [
            msgspec.structs.replace(ev, cache_salt=salt) if isinstance(ev, BlockStored) else ev
            for ev in batch.events
        ]
    assert decode_batch(encode_batch(batch, array_like=array_like)) == batch
