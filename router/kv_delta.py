"""The index writes of KV-event ingest as a keyed delta (docs/scale-out.md, "One ingest per
host"): the process that follows the workers journals what its mirrors wrote to its index,
its block keys packed (array('Q') bytes, no Python object per block); the other processes of
the host apply the same writes to theirs with no decoding and no hashing. Pure: no I/O."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from router.index import UnifiedIndex

STORED, REMOVED, CLEARED, TAGGED, GONE, COUNTED = range(6)
_U64 = 1 << 64


class Op(msgspec.Struct, array_like=True, gc=False):
    """One index write of the stream `(worker, stream)` (the kv_group it follows) to the
    resident `group` (its base, an adapter's, a host tier's): STORED `keys` under `parent`
    (the first starting namespace `salt`, when set), REMOVED `keys`, CLEARED the group, TAGGED
    `parent` as the start of namespace `salt`, GONE (the stream stopped: all it fed), COUNTED
    (the group's inflow, `parent` blocks stored so far: a snapshot's, as policies read it)."""

    kind: int
    worker: str
    stream: str
    group: str = ""
    keys: bytes = b""  # array('Q'), this host's byte order
    parent: int | None = None
    salt: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[Op]).decode


def encode_ops(ops: list[Op]) -> bytes:
    return _encode(ops)


def decode_ops(payload: bytes) -> list[Op]:
    """Raises msgspec.DecodeError on anything else."""
    return _decode(payload)


def pack(keys: Iterable[int]) -> bytes:
    try:
        return array("Q", keys).tobytes()
    except (OverflowError, TypeError):  # an engine hash never keyed by us: held nowhere
        return array("Q", [k for k in keys if type(k) is int and 0 <= k < _U64]).tobytes()


def unpack(packed: bytes) -> list[int]:
    keys = array("Q")
    keys.frombytes(packed)
    return keys.tolist()


class StreamJournal:
    """What one mirror writes to its index, as ops appended to `ops`; `wrote` is called when
    `ops` gets its first op (the shell sends them soon after)."""

    def __init__(self, worker: str, stream: str, ops: list[Op], wrote: Callable[[], None]):
        self.worker = worker
        self.stream = stream
        self.ops = ops
        self.wrote = wrote

    def _add(self, op: Op) -> None:
        if not self.ops:
            self.wrote()
        self.ops.append(op)

    def stored(self, group: str, keys: list[int], parent: int | None, salt: str | None) -> None:
        self._add(Op(STORED, self.worker, self.stream, group, pack(keys), parent, salt or ""))

    def removed(self, group: str, keys: Iterable[int]) -> None:
        self._add(Op(REMOVED, self.worker, self.stream, group, pack(keys)))

    def cleared(self, group: str) -> None:
        self._add(Op(CLEARED, self.worker, self.stream, group))

    def gone(self) -> None:
        self._add(Op(GONE, self.worker, self.stream))


class FollowedStats(NamedTuple):
    applied_ops: int
    blocks_stored: int  # newly resident blocks (as the leader's mirror counts them)
    blocks_removed: int
    syncs: int  # snapshots taken from the leader (start, a lost delta, a new leader)


@dataclass(slots=True)
class FollowedStream:
    """A stream this process applies the leader's ops of: the groups they fed (cleared on a
    snapshot or GONE) and counts. `synced_at`: the seq of the deltas its last snapshot covers
    (None: none yet); the ops of deltas up to it are in the snapshot."""

    worker: str
    stream: str
    synced_at: int | None = None
    groups: set[str] = field(default_factory=set)
    applied_ops: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    syncs: int = 0

    def forget(self, index: UnifiedIndex) -> None:
        for group in self.groups:
            index.clear(self.worker, group)
        self.groups.clear()

    def stats(self) -> FollowedStats:
        return FollowedStats(self.applied_ops, self.blocks_stored, self.blocks_removed, self.syncs)


def apply_ops(
    index: UnifiedIndex,
    ops: list[Op],
    streams: dict[tuple[str, str], FollowedStream],
    now: float,
    seq: int,
) -> None:
    """Apply the ops of delta `seq` of the streams followed that their snapshot does not cover;
    the others' are dropped."""
    for op in ops:
        stream = streams.get((op.worker, op.stream))
        if stream is None or stream.synced_at is None or seq <= stream.synced_at:
            continue
        stream.applied_ops += 1
        kind = op.kind
        if kind == STORED:
            stream.groups.add(op.group)
            keys = unpack(op.keys)
            if op.salt and keys:
                index.tag_namespace(keys[0], op.salt)
            stream.blocks_stored += index.insert(keys, op.worker, op.group, now, parent=op.parent)
        elif kind == REMOVED:
            stream.blocks_removed += index.remove(unpack(op.keys), op.worker, op.group)
        elif kind == CLEARED:
            index.clear(op.worker, op.group)
        elif kind == TAGGED and op.parent is not None:
            index.tag_namespace(op.parent, op.salt)
        elif kind == GONE:
            stream.forget(index)
        elif kind == COUNTED and op.parent is not None:
            index.set_inflow(op.worker, op.group, op.parent)


def snapshot(index: UnifiedIndex, worker: str, stream: str, groups: Iterable[str]) -> list[Op]:
    """Ops that give another index what `index` holds exactly for the stream's `groups`
    (approximate marks left out), parents before children, with their namespace tags and the
    groups' inflow."""
    ops: list[Op] = []
    namespaces = index.namespaces
    for group in groups:
        for parent, keys in index.exported(worker, group):
            ops.append(Op(STORED, worker, stream, group, pack(keys), parent))
            for key in keys:
                salt = namespaces.get(key)
                if salt is not None:
                    ops.append(Op(TAGGED, worker, stream, parent=key, salt=salt))
        ops.append(Op(COUNTED, worker, stream, group, parent=index.sizes(worker, group)[1]))
    return ops
