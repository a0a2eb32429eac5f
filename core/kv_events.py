"""The KV-event codec: vLLM's batches in both msgpack encodings, positional and map; a salt rides
where vLLM puts a cache_salt, in `extra_keys`. The wire format and what is tolerated:
docs/kv-events.md."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Final, Union

import msgspec

from core.blocks import chain_keys, chain_keys_msgpack, chain_keys_packed, msgpack_len
from core.key_table import KeyTable, has_native

try:  # the C twin of decode_for_ingest's fast path (core/_kv_decode.c)
    from core._kv_decode import decode_batch as _native_decode
    from core._kv_decode import set_types as _native_types
except ImportError:  # pragma: no cover - only without a compiler
    _native_decode = _native_types = None
try:  # the KV mirror's common case, a batch's events in one call (core/_kv_ingest.c)
    from core._kv_ingest import keyed as _native_keyed
    from core._kv_ingest import set_types as _keyed_types
except ImportError:  # pragma: no cover - only without a compiler
    _native_keyed = _keyed_types = None

BlockHash = int | bytes
MEDIUM_GPU: Final = "GPU"  # Final: compiled modules inline it
MEDIUM_CPU: Final = "CPU"  # a host-memory tier (vLLM's offloading connector, our host tier)


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

    def token_count(self) -> int:
        return len(self.token_ids)

    def chain_keys(self, blocks: int, first: bytes) -> list[int]:
        """Our keys of the first `blocks` blocks, chained after `first` (core/blocks.py)."""
        return chain_keys(self.token_ids[: blocks * self.block_size], self.block_size, first)


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


class BlockStoredRaw(msgspec.Struct, tag="BlockStored", gc=False):
    """A BlockStored as the gateway ingests it (`decode_for_ingest`): its token ids left as the
    msgpack array they came as, keyed where they lie (core/blocks.py `chain_keys_msgpack`), so
    that decoding makes no int object per token. Never encoded."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None

    def token_count(self) -> int:
        return msgpack_len(self.token_ids)  # -1: not an array (never a whole block's count)

    def chain_keys(self, blocks: int, first: bytes) -> list[int]:
        """BlockStored.chain_keys; ValueError where a token id is not an int32."""
        return chain_keys_msgpack(self.token_ids, self.block_size, first, blocks)


class BlockStoredPacked(msgspec.Struct, gc=False):
    """A BlockStored as core/_kv_decode.c decodes it for ingest: its token ids read once, into
    little-endian int32s (4 bytes each), which keying only hashes. Never encoded."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: bytes
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None

    def token_count(self) -> int:
        return len(self.token_ids) // 4

    def chain_keys(self, blocks: int, first: bytes) -> list[int]:
        return chain_keys_packed(self.token_ids, self.block_size, first, blocks)


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
IngestEvent = BlockStoredRaw | BlockStoredPacked | BlockRemoved | AllBlocksCleared


def block_stored(
    block_hashes: list[BlockHash],
    parent_block_hash: BlockHash | None,
    token_ids: list[int],
    block_size: int,
    *,
    medium: str | None = MEDIUM_GPU,
    salt: str | None = None,
    lora_name: str | None = None,
    lora_id: int | None = None,
) -> BlockStored:
    """Our workers' BlockStored: `salt`, the namespace the first block starts, is that block's
    extra key, as vLLM publishes a cache_salt; a LoRA adapter's blocks carry its name and id,
    and its name first among every block's extra keys, as vLLM's (docs/kv-events.md)."""
    extra: list[Any] | None = None
    if lora_name is not None and block_hashes:
        extra = [[lora_name] for _ in block_hashes]
        if salt:
            extra[0] = [lora_name, salt]
    elif salt and block_hashes:
        extra = [[salt], *[None] * (len(block_hashes) - 1)]
    return BlockStored(
        block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra
    )


def first_block_salt(ev: BlockStored | BlockStoredRaw | BlockStoredPacked) -> str | None:
    """The salt the event's first block was hashed with: the one bare string among its extra
    keys that is not the LoRA name (vLLM's multimodal keys are pairs, its embedding keys
    bytes); None without one."""
    if not ev.extra_keys:
        return None
    keys = ev.extra_keys[0]
    if not isinstance(keys, list | tuple):
        return None
    strings = [k for k in keys if isinstance(k, str) and k != ev.lora_name]
    return strings[0] if len(strings) == 1 else None


def plain_prefix(ev: BlockStored | BlockStoredRaw | BlockStoredPacked, salt: str | None) -> int:
    """How many leading blocks were hashed from their tokens alone (plus the LoRA name and
    `salt`, which we key by kv_group and namespace): the rest carry multimodal or other keys."""
    extra = ev.extra_keys
    if not extra:
        return len(ev.block_hashes)
    ours: set[Hashable] = {h for h in (ev.lora_name, salt) if h is not None}
    for i, keys in enumerate(extra[: len(ev.block_hashes)]):
        if not keys:
            continue
        if not isinstance(keys, list | tuple) or any(
            not isinstance(k, Hashable) or k not in ours for k in keys
        ):
            return i
    return len(ev.block_hashes)


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent] | list[IngestEvent]  # the latter from decode_for_ingest
    dp_rank: int | None = None
    unknown_events: int = field(default=0, compare=False)  # skipped on decode, never encoded


# -- twins: positional (older vLLM, our compact encoding) and vLLM's maps -----------------------
# msgspec cannot mix array_like and map Structs in one union, hence twins and a first-byte peek.
# The records decode leniently (older vLLM lacks fields); what we send is exactly what vLLM's
# classes send: the fields vLLM requires always, the rest only when set (omit_defaults).

_VLLM_REQUIRED = frozenset({"lora_id", "medium", "lora_name"})  # besides the leading ones
_RECORDS = (BlockStored, BlockRemoved, AllBlocksCleared)


def _twin(cls: type[msgspec.Struct], *, array_like: bool) -> Any:
    """`cls` with its fields in order: as positions, or as vLLM's tagged map."""
    fields = [
        (f.name, f.type)
        if f.required or not array_like and f.name in _VLLM_REQUIRED
        else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(cls)
    ]
    suffix = "Pos" if array_like else "Vllm"
    return msgspec.defstruct(
        f"_{cls.__name__}{suffix}",
        fields,
        tag=cls.__name__,
        array_like=array_like,
        omit_defaults=not array_like,
        gc=False,
    )


_TWINS: dict[type, Any] = {cls: _twin(cls, array_like=True) for cls in _RECORDS}
_FROM_TWIN: dict[type, Any] = {twin: cls for cls, twin in _TWINS.items()}
_VLLM_MAPS: dict[type, Any] = {cls: _twin(cls, array_like=False) for cls in _RECORDS}


class _PosBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Raw]  # decoded one at a time (encoding takes the records as they are)
    data_parallel_rank: int | None = None


class _VllmBatch(msgspec.Struct, array_like=True, gc=False):  # vLLM today, in one call
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _IngestBatch(msgspec.Struct, array_like=True, gc=False):  # _VllmBatch, tokens raw
    ts: float
    events: list[BlockStoredRaw | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
if _native_types is not None:
    _native_types(BlockStoredPacked, BlockRemoved, AllBlocksCleared, EventBatch)
if _keyed_types is not None and has_native():  # it writes the C table itself
    _keyed_types(BlockStoredPacked, BlockRemoved, KeyTable)

# (events, start, table, block_size, ops) -> where it stopped, ops [KEYED_*, keys, parent, ...]:
# router/kv_mirror.py's common case
keyed_ops: Callable[[list[Any], int, object, int, list[Any]], int] | None = (
    _native_keyed if _keyed_types is not None and has_native() else None
)
KEYED_STORED: Final = 0  # keys, parent key | None: index them
KEYED_LOOKUP: Final = 1  # keys, parent hash: index them if the parent (its own key) is held
KEYED_REMOVED: Final = 2  # keys, None: remove them
_vllm_batch = msgspec.msgpack.Decoder(_VllmBatch)
_pos_batch = msgspec.msgpack.Decoder(_PosBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_ingest_batch = msgspec.msgpack.Decoder(_IngestBatch)
_pos_event = msgspec.msgpack.Decoder(Union[tuple(_TWINS.values())])  # noqa: UP007
_map_event = msgspec.msgpack.Decoder(KVEvent)
_any = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


_MAP_FIRST = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # msgpack's first bytes of a map
_ARRAY_FIRST = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])  # ... and of an array


def _from_pos(ev: Any) -> KVEvent:
    return _FROM_TWIN[type(ev)](*msgspec.structs.astuple(ev))


def _to_twin(ev: KVEvent, twins: dict[type, Any]) -> Any:
    return twins[type(ev)](*msgspec.structs.astuple(ev))


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


def decode_for_ingest(payload: bytes | memoryview) -> EventBatch:
    """`decode_batch` for the mirror: a batch as vLLM sends it today (positional, its events
    tagged maps) decodes in one call, each BlockStored a BlockStoredPacked (core/_kv_decode.c;
    a BlockStoredRaw where its token ids are not all int32s, or without it); any other payload as
    `decode_batch` decodes it. Token ids that are not int32s surface when keyed, as they do
    from a BlockStored's list, not here."""
    if _native_decode is not None:  # None from it: not exactly vLLM's shape, msgspec's turn
        native: EventBatch | None = _native_decode(payload)
        if native is not None:
            return native
    if payload and payload[0] in _ARRAY_FIRST:
        try:  # not contextlib.suppress: a context manager costs about a decode of a block
            fast = _ingest_batch.decode(payload)
            return EventBatch(fast.ts, fast.events, fast.data_parallel_rank)
        except msgspec.DecodeError:
            pass  # decode_batch says what is wrong
    return decode_batch(payload)


def encode_batch(batch: EventBatch, *, array_like: bool = True) -> bytes:
    """Encode a batch as `[ts, [events...], dp_rank]` (dp_rank left out when None): events
    positional (array_like, older vLLM) or as tagged maps, byte for byte what vLLM's own
    classes encode (vLLM today)."""
    twins = _TWINS if array_like else _VLLM_MAPS
    events = [_to_twin(ev, twins) for ev in batch.events]
    return _encoder.encode(_PosBatch(batch.ts, events, batch.dp_rank))  # type: ignore[arg-type]
