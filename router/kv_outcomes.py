"""What applying a KV event batch to a mirror gives (router/kv_mirror.py): the outcome its seq
decides (docs/kv-events.md, "The mirror: sequencing"), the mirror's counts, and a batch's
fingerprint, by which a replayed copy is told from a new incarnation's batch."""

from __future__ import annotations

import enum
from typing import Final, NamedTuple

from core.kv_events import AllBlocksCleared, EventBatch


class Outcome(enum.Enum):
    OK = "ok"
    GAP = "gap"
    RESTART = "restart"
    DUPLICATE = "duplicate"


class Apply(NamedTuple):
    outcome: Outcome
    resume_from: int | None = None  # GAP/RESTART: the first seq to replay; None: nothing missing


class MirrorStats(NamedTuple):
    applied_batches: int
    blocks_stored: int  # newly resident blocks
    blocks_removed: int
    gaps: int
    restarts: int
    duplicates: int
    resets: int
    skipped_orphans: int  # stores whose parent we never saw: they cannot be keyed
    skipped_unkeyable: int  # blocks hashed with more than tokens (mm, salt), or a bad shape
    unknown_events: int
    decode_errors: int
    last_seq: int | None
    last_event_ts: float | None  # the engine's clock: lag = now - last_event_ts


UNDECODABLE: Final = -1  # the fingerprint of a batch that did not decode (hash() never returns -1)
APPLIED = Apply(Outcome.OK)  # made once: a NamedTuple costs a Python call per batch


def fingerprint(batch: EventBatch) -> int:
    """Cheap identity of a batch: a replayed copy of a batch has it, a new incarnation's not."""
    first: object = None
    if events := batch.events:
        ev = events[0]
        first = tuple(ev.block_hashes[:1]) if not isinstance(ev, AllBlocksCleared) else "clear"
    return hash((batch.ts, len(events), first))
