"""The KV events codec against vLLM's wire shapes, garbage, and a round-trip property. (That
vLLM's own classes decode what we send: tests/backends/test_vllm_wire.py.)"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockStoredPacked,
    BlockStoredRaw,
    EventBatch,
    KVEventDecodeError,
    block_stored,
    decode_batch,
    decode_for_ingest,
    encode_batch,
    first_block_salt,
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
    assert stored.extra_keys == [None] and first_block_salt(stored) is None


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
    salted = {**VLLM_STORED, "parent_block_hash": None, "extra_keys": [["tenant-a"]], "x": 1}
    batch = decode_batch(pack({"ts": 3, "events": [salted], "data_parallel_rank": 2, "x": 1}))
    assert batch.ts == 3.0 and batch.dp_rank == 2
    assert first_block_salt(batch.events[0]) == "tenant-a"  # type: ignore[arg-type]
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
    with pytest.raises(KVEventDecodeError):
        decode_for_ingest(payload)


def test_our_events_are_vllms_maps_with_the_salt_in_extra_keys() -> None:
    """vLLM's field order, its required fields always, the rest only when set; the salt is the
    first block's extra key, where vLLM puts a cache_salt; in both encodings."""
    ev = block_stored([1, 2], None, list(range(8)), 4, salt="s")
    batch = EventBatch(1.0, [ev, BlockRemoved([1], "GPU"), AllBlocksCleared()], 0)
    wire = msgspec.msgpack.decode(encode_batch(batch, array_like=False))
    assert wire == [1.0, [VLLM_SALTED_WIRE, VLLM_REMOVED_WIRE, VLLM_CLEARED], 0]
    assert [list(e) for e in wire[1]] == [list(VLLM_SALTED_WIRE), list(VLLM_REMOVED_WIRE), ["type"]]
    for array_like in (False, True):
        (decoded, _, _) = decode_batch(encode_batch(batch, array_like=array_like)).events
        assert decoded == ev and first_block_salt(decoded) == "s"  # type: ignore[arg-type]
    assert block_stored([3], 1, list(range(4)), 4).extra_keys is None


VLLM_SALTED_WIRE = {
    "type": "BlockStored",
    "block_hashes": [1, 2],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [["s"], None],
}
VLLM_REMOVED_WIRE = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}


@pytest.mark.parametrize(
    ("lora_name", "keys", "salt"),
    [
        (None, ["t"], "t"),
        ("ad", ["ad", "t"], "t"),  # vLLM: the LoRA name first, then the salt
        ("ad", ["ad"], None),
        (None, [["mm-hash", 0], "t", b"embeds"], "t"),  # multimodal pairs, embedding bytes
        (None, [["mm-hash", 0]], None),
        (None, ["a", "b"], None),  # two bare strings: not a salt we can tell
        (None, None, None),
    ],
)
def test_first_block_salt_as_vllm_orders_extra_keys(
    lora_name: str | None, keys: list[object] | None, salt: str | None
) -> None:
    ev = BlockStored([1], None, [0] * 4, 4, None, "GPU", lora_name, [keys])
    assert first_block_salt(ev) == salt


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
@given(batch=batch_st, array_like=st.booleans())
def test_round_trip(batch: EventBatch, array_like: bool) -> None:
    assert decode_batch(encode_batch(batch, array_like=array_like)) == batch


@settings(max_examples=300, deadline=None)
@given(batch=batch_st, array_like=st.booleans())
def test_ingest_decoding_keeps_token_ids_raw_and_keys_them_alike(
    batch: EventBatch, array_like: bool
) -> None:
    """decode_for_ingest: vLLM's shape (map events) with each BlockStored's token ids left as
    msgpack, the rest as decode_batch has it; either kind of record gives the same keys."""
    payload = encode_batch(batch, array_like=array_like)
    plain, raw = decode_batch(payload), decode_for_ingest(payload)
    assert (raw.ts, raw.dp_rank, len(raw.events)) == (plain.ts, plain.dp_rank, len(plain.events))
    for ev, got in zip(plain.events, raw.events, strict=True):
        if not isinstance(ev, BlockStored) or array_like:
            assert got == ev
            continue
        assert isinstance(got, BlockStoredRaw | BlockStoredPacked)  # Packed: core/_kv_decode.c
        assert msgspec.structs.astuple(got)[3:] == msgspec.structs.astuple(ev)[3:]
        assert (got.block_hashes, got.parent_block_hash) == (ev.block_hashes, ev.parent_block_hash)
        assert got.token_count() == ev.token_count() == len(ev.token_ids)
        blocks = len(ev.token_ids) // ev.block_size
        for n in {0, blocks // 2, blocks}:
            assert got.chain_keys(n, b"\0\0\0\0") == ev.chain_keys(n, b"\0\0\0\0")


def test_raw_token_ids_that_are_not_int32s_fail_when_keyed() -> None:
    for tokens in ([2**31] * 16, ["a"] * 16, [1.5] * 16):
        (stored,) = decode_for_ingest(pack([1.0, [{**VLLM_STORED, "token_ids": tokens}]])).events
        with pytest.raises(ValueError):
            stored.chain_keys(1, b"\0\0\0\0")  # type: ignore[union-attr]
    (stored,) = decode_for_ingest(pack([1.0, [{**VLLM_STORED, "token_ids": None}]])).events
    assert stored.token_count() == -1  # type: ignore[union-attr]
