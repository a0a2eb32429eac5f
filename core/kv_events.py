"""The KV-event codec: vLLM's batches in both msgpack encodings, positional and map, and our
`BlockStored.cache_salt` (maps only). The wire format and what is tolerated: docs/kv-events.md."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

BlockHash = int | bytes
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # a host-memory tier (vLLM's offloading connector, our workers' host tier)


class KVEventDecodeError(ValueError):
    """A payload that is not an event batch (the batch is unusable as a whole)."""


# -- the records (map encoding: what vLLM sends today) -----------------------------------------


class BlockStored(msgspec.Struct, tag=True, gc=False):
    """Full blocks now cached; block_hashes[i] covers token_ids[i*block_size:(i+1)*block_size]
    and block 0 continues `parent_block_hash` (None: a root)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # per block: what else the engine hashed (mm, salt)
    group_idx: int | None = None  # the engine's KV cache group (hybrid models)
    cache_salt: str | None = None  # our extension: the salt of a namespace-starting block


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None
    unknown_events: int = field(default=0, compare=False)  # skipped on decode, never encoded


# -- positional twins (array_like: older vLLM, and our compact encoding) -----------------------
# msgspec cannot mix array_like and map Structs in one union, hence twins and a first-byte peek.


def _twin(cls: type[msgspec.Struct]) -> Any:
    """`cls` as positions: its fields in order, all but our `cache_salt` (maps only)."""
    fields = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(cls)
        if f.name != "cache_salt"
    ]
    return msgspec.defstruct(
        f"_{cls.__name__}Pos", fields, tag=cls.__name__, array_like=True, gc=False
    )


_TWINS: dict[type, Any] = {cls: _twin(cls) for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
_FROM_TWIN: dict[type, Any] = {twin: cls for cls, twin in _TWINS.items()}


class _PosBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Raw]  # decoded one at a time (encoding takes the records as they are)
    data_parallel_rank: int | None = None


class _VllmBatch(msgspec.Struct, array_like=True, gc=False):  # vLLM today, in one call
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_vllm_batch = msgspec.msgpack.Decoder(_VllmBatch)
_pos_batch = msgspec.msgpack.Decoder(_PosBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_pos_event = msgspec.msgpack.Decoder(Union[tuple(_TWINS.values())])  # noqa: UP007
_map_event = msgspec.msgpack.Decoder(KVEvent)
_any = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


_MAP_FIRST = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # msgpack's first bytes of a map
_ARRAY_FIRST = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])  # ... and of an array


def _from_pos(ev: Any) -> KVEvent:
    return _FROM_TWIN[type(ev)](*msgspec.structs.astuple(ev))


def _to_pos(ev: KVEvent) -> Any:
    twin = _TWINS[type(ev)]
    return twin(*msgspec.structs.astuple(ev)[: len(twin.__struct_fields__)])


def _decode_event(raw: msgspec.Raw) -> KVEvent | None:
    """One event; None when its type is unknown (skipped)."""
    first = memoryview(raw)[0] if len(raw) else -1
    try:
        if first in _MAP_FIRST:
            return _map_event.decode(raw)
        if first in _ARRAY_FIRST:
            return _from_pos(_pos_event.decode(raw))
    except msgspec.ValidationError:  # of an unknown type? (a DecodeError if it is not msgpack)
        value = _any.decode(raw)  # a map or an array, by its first byte
        tag = value.get("type") if isinstance(value, dict) else value[0] if value else None
        if isinstance(tag, str) and tag not in _KNOWN:
            return None
        raise
    raise KVEventDecodeError("an event is neither an array nor a map")


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """Decode one payload of either encoding. Raises KVEventDecodeError on anything else."""
    if not payload:
        raise KVEventDecodeError("empty payload")
    first = payload[0]
    try:
        if first in _ARRAY_FIRST:
            # positional or unknown events fail the fast path: the general one sorts them out
            with contextlib.suppress(msgspec.ValidationError):
                fast = _vllm_batch.decode(payload)
                return EventBatch(fast.ts, fast.events, fast.data_parallel_rank)
            wire: _PosBatch | _MapBatch = _pos_batch.decode(payload)
        elif first in _MAP_FIRST:
            wire = _map_batch.decode(payload)
        else:
            raise KVEventDecodeError("the payload is neither an array nor a map")
        decoded = [_decode_event(raw) for raw in wire.events]
    except msgspec.DecodeError as exc:  # ValidationError included
        raise KVEventDecodeError(str(exc)) from exc
    events = [ev for ev in decoded if ev is not None]
    return EventBatch(wire.ts, events, wire.data_parallel_rank, len(decoded) - len(events))


def encode_batch(batch: EventBatch, *, array_like: bool = True) -> bytes:
    """Encode a batch as `[ts, [events...], dp_rank]`: events positional (array_like, older
    vLLM) or as tagged maps (vLLM today; the only encoding that carries `cache_salt`)."""
    events: Sequence[Any] = [_to_pos(ev) for ev in batch.events] if array_like else batch.events
    return _encoder.encode(_PosBatch(batch.ts, list(events), batch.dp_rank))  # type: ignore[arg-type]
