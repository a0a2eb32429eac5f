"""One worker's KV event stream mirrored into the unified index, each block re-keyed from its
token ids, each batch placed by its seq (docs/kv-events.md, "The mirror"). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, cast

from core.blocks import chain_keys_packed, namespace, parent_prefix, salted_after
from core.key_table import KeyMap, KeyTable
from core.kv_events import (
    KEYED_REMOVED,
    KEYED_STORED,
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    BlockStoredPacked,
    BlockStoredRaw,
    EventBatch,
    first_block_salt,
    keyed_ops,
    plain_prefix,
)
from router.index import UnifiedIndex, host_group
from router.kv_delta import StreamJournal
from router.kv_outcomes import APPLIED, UNDECODABLE, Apply, MirrorStats, Outcome, fingerprint

LoraId = int | str | None


class WorkerMirror:
    """Applies one worker's event batches to `index` under `worker`. `kv_group` names the group
    of its base model, or maps an event's LoRA (lora_name, else lora_id, else None) to one.
    `block_size` (None: trust the event's) must be the one the gateway keys prompts with.
    Blocks of `medium` "CPU" (a host tier) are resident under `host_group(kv_group)`.
    `own_keys`: the engine hashes blocks as we key them (our engines, in-process: the replay),
    so its events need no token ids and its hashes are our keys. `keyed`: the common case
    (a chain of the base group on the GPU, its parent known, or a removal) in C where built
    (core/_kv_ingest.c); False: all in Python (tests compare the two)."""

    def __init__(
        self,
        index: UnifiedIndex,
        worker: str,
        kv_group: str | Callable[[LoraId], str],
        block_size: int | None = None,
        *,
        media: Collection[str | None] = frozenset({"GPU", MEDIUM_CPU, None}),
        cache_groups: Collection[int | None] = frozenset({None, 0}),
        dedup_window: int = 2048,
        own_keys: bool = False,
        keyed: bool = True,
    ) -> None:
        self.index = index
        self.own_keys = own_keys
        self.worker = worker
        if isinstance(kv_group, str):
            base = kv_group
            self._group_of: Callable[[LoraId], str] = lambda lora: (
                base if lora is None else f"{base}+lora:{lora}"
            )
        else:
            self._group_of = kv_group
        self.base_group = self._group_of(None)
        self._base_host = host_group(self.base_group)
        self.block_size = block_size
        self.media = frozenset(media)
        self.cache_groups = frozenset(cache_groups)
        self.dedup_window = dedup_window
        # engine hash -> our key, for base-group blocks whose engine hash is not our key (a C
        # table, core/key_table.py: a chain's new hashes go in in one call)
        self._keys: KeyMap = KeyTable()
        # engine hash -> (our key, kv_group), for blocks of any other group (LoRA adapters)
        self._other: dict[BlockHash, tuple[int, str]] = {}
        # engine hash -> (our key, kv_group) of host-tier blocks not keyed as ours (all groups)
        self._host: dict[BlockHash, tuple[int, str]] = {}
        # engine hash -> host-tier announcements beyond the first: vLLM's self-describing
        # offload events repeat a hash once per chunk that holds it, and remove it as often
        self._host_repeats: dict[BlockHash, int] = {}
        self._recent: dict[int, int] = {}  # seq -> fingerprint of the applied batch
        self.groups: set[str] = {self.base_group}  # every kv_group this stream has fed
        self.last_seq: int | None = None
        self.last_event_ts: float | None = None
        self.applied_batches = self.blocks_stored = self.blocks_removed = 0
        self.gaps = self.restarts = self.duplicates = self.resets = 0
        self.skipped_orphans = self.skipped_unkeyable = 0
        self.unknown_events = self.decode_errors = 0
        # --processes N: this process's index writes, for the others (router/kv_delta.py)
        self.journal: StreamJournal | None = None
        # what core/_kv_ingest.c takes for granted besides what it checks per batch
        self._keyed = (
            keyed
            and keyed_ops is not None
            and not own_keys
            and {"GPU", None} <= self.media
            and {None, 0} <= self.cache_groups
        )
        self._ops: list[Any] = []  # [KEYED_*, keys, parent] * n, refilled by each call

    def apply(self, seq: int, batch: EventBatch, now: float) -> Apply:
        """Apply batch `seq` if it is the next one; otherwise say what the caller must do."""
        last = self.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == fingerprint(batch):
                self.duplicates += 1
                return Apply(Outcome.DUPLICATE)
            self.new_incarnation()
            if seq != 0:
                return Apply(Outcome.RESTART, 0)  # the new stream's start was missed: replay
            self._apply(seq, batch, now)
            return Apply(Outcome.RESTART)
        if last is not None and seq > last + 1:
            self.gaps += 1
            return Apply(Outcome.GAP, last + 1)
        self._apply(seq, batch, now)
        return APPLIED

    def undecodable(self, seq: int) -> None:
        """Batch `seq` could not be decoded: its effect is unknown, so start over after it."""
        self.decode_errors += 1
        last = self.last_seq
        if last is not None and seq <= last and self._recent.get(seq) == UNDECODABLE:
            return  # a replayed copy of the one we already gave up on
        self.reset()
        self.last_seq = seq
        self._record(seq, UNDECODABLE)

    def new_incarnation(self) -> None:
        """The worker restarted (its stream lacks our last seq): clear it, expect seq 0 next."""
        self.restarts += 1
        self._forget_all()
        self._recent.clear()
        self.last_seq = -1

    def reset(self) -> None:
        """Forget the worker (resync): its residency, the hash map, the seq; not `_recent`, so
        that replayed copies of batches applied before stay duplicates."""
        self.resets += 1
        self._forget_all()
        self.last_seq = None

    def _forget_all(self) -> None:
        """Drop the residency of the kv_groups this stream fed, not the worker's other streams'."""
        for group in self.groups:
            self.index.clear(self.worker, group)
            if self.journal is not None:
                self.journal.cleared(group)
        self.groups = {self.base_group}
        for table in (self._keys, self._other, self._host, self._host_repeats):
            table.clear()

    def _record(self, seq: int, fingerprint: int) -> None:
        recent = self._recent
        recent[seq] = fingerprint
        # seqs only grow between clears; popping the oldest by iterating would walk the
        # deleted slots at the dict's front (quadratic), so drop the one a window back
        recent.pop(seq - self.dedup_window, None)

    def _apply(self, seq: int, batch: EventBatch, now: float) -> None:
        events = batch.events
        i, n = 0, len(events)
        while i < n:
            if self._keyed and not self._other and not self._host:  # all in the C table
                i = self._apply_keyed(events, i, now)
                if i == n:
                    break
            ev = events[i]
            i += 1
            kind = type(ev)  # token ids packed (core/_kv_decode.c), raw, or a list
            if kind is BlockStoredPacked or kind is BlockStoredRaw or kind is BlockStored:
                self._stored(ev, now)  # type: ignore[arg-type]
            elif type(ev) is BlockRemoved:
                self._removed(ev)
            elif type(ev) is AllBlocksCleared:
                self._forget_all()
        self.unknown_events += batch.unknown_events
        self.applied_batches += 1
        self.last_seq = seq
        self.last_event_ts = batch.ts
        self._record(seq, fingerprint(batch))

    def _apply_keyed(self, events: list[Any], start: int, now: float) -> int:
        """Apply events[start:] up to the first that is not the common case, keyed and mapped
        in C (core/_kv_ingest.c); returns where it stopped. What `_stored` and `removed` do
        for them, in the same order."""
        assert keyed_ops is not None
        ops = self._ops
        stop = keyed_ops(
            events, start, self._keys, -1 if self.block_size is None else self.block_size, ops
        )
        base, index, worker = self.base_group, self.index, self.worker
        for j in range(0, len(ops), 3):
            kind, keys, parent = ops[j], ops[j + 1], ops[j + 2]
            if kind == KEYED_REMOVED:
                self.blocks_removed += self._remove(keys, base)
            elif (
                kind == KEYED_STORED
                # KEYED_LOOKUP: the parent was in no table then (C saw to it; a later event
                # may have mapped it since): `_lookup`'s rest, ours in either tier?
                or index.holds(parent, worker, base)
                or index.holds(parent, worker, self._base_host)
            ):
                self._insert(keys, base, now, parent, None)
            else:
                self.skipped_orphans += len(keys)
        return stop

    def _lookup(self, engine_hash: BlockHash) -> tuple[int, str] | None:
        """Our key and kv_group of a block this worker holds in either tier (None: unknown)."""
        if (other := self._other.get(engine_hash)) is not None:
            return other
        key = self._keys.get(engine_hash)
        if key is not None:
            return cast(int, key), self.base_group
        if type(engine_hash) is int and self.index.holds(engine_hash, self.worker, self.base_group):
            return engine_hash, self.base_group  # our own hashing: the engine hash is our key
        if (hosted := self._host.get(engine_hash)) is not None:
            return hosted
        if type(engine_hash) is int and self.index.holds(engine_hash, self.worker, self._base_host):
            return engine_hash, self.base_group  # ours, in the host tier
        return None

    def _stored(self, ev: BlockStored | BlockStoredRaw | BlockStoredPacked, now: float) -> None:
        medium = ev.medium  # each field read once: a generic attribute lookup each
        if medium not in self.media or ev.group_idx not in self.cache_groups:
            return
        if self.own_keys:
            keys, parent = cast(list[int], ev.block_hashes), cast(int | None, ev.parent_block_hash)
            lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
            self.stored(keys, parent, medium, first_block_salt(ev), now, lora)
            return
        bs = ev.block_size
        hashes = ev.block_hashes
        expected = bs if self.block_size is None else self.block_size  # None: trust the event
        packed = type(ev) is BlockStoredPacked  # keyed here: its methods are Python calls
        tokens = len(ev.token_ids) >> 2 if packed else ev.token_count()
        if bs <= 0 or bs != expected or tokens != len(hashes) * bs:
            self.skipped_unkeyable += len(hashes)
            return
        lora = ev.lora_name if ev.lora_name is not None else ev.lora_id
        group = self.base_group if lora is None else self._group_of(lora)
        extra = ev.extra_keys
        salt = first_block_salt(ev) if extra else None
        parent_hash = ev.parent_block_hash
        if parent_hash is None:
            parent = None
            first = namespace(salt)
        else:
            known = self._lookup(parent_hash)
            if known is None or known[1] != group:
                self.skipped_orphans += len(hashes)
                return
            parent = known[0]
            # a salt on a child: the first private block after a public prefix (blocks.py)
            first = salted_after(parent, salt) if salt else parent_prefix(parent)
        n = plain_prefix(ev, salt) if extra else len(hashes)
        if n < len(hashes):
            self.skipped_unkeyable += len(hashes) - n
            if n == 0:
                return
            hashes = hashes[:n]
        if packed:
            keys = chain_keys_packed(cast(bytes, ev.token_ids), bs, first, n)
        else:
            keys = ev.chain_keys(n, first)
        resident = group
        if medium == MEDIUM_CPU:
            resident = host_group(group)
            self._count_repeats(hashes, keys, resident)
            self._remember_host(hashes, keys, group)
        else:
            self._remember(hashes, keys, group)
        self.groups.add(resident)
        self._insert(keys, resident, now, parent, salt)

    def stored(
        self,
        keys: list[int],
        parent: int | None,
        medium: str | None,
        salt: str | None,
        now: float,
        lora: LoraId = None,
    ) -> None:
        """Blocks keyed as ours (`own_keys`) stored in `medium` under our key `parent`: a
        BlockStored of our engines, or the replay's engines' changes in-process (no event)."""
        if not keys:
            return
        group = self.base_group if lora is None else self._group_of(lora)
        resident = group
        if medium == MEDIUM_CPU:
            resident = self._base_host if lora is None else host_group(group)
        if lora is not None:  # a removal names the hash alone: remember its group
            table = self._host if medium == MEDIUM_CPU else self._other
            for key in keys:
                table[key] = (key, group)
        if resident is not self.base_group:  # the base group is always among them
            self.groups.add(resident)
        self._insert(keys, resident, now, parent, salt)

    def _insert(
        self, keys: list[int], group: str, now: float, parent: int | None, salt: str | None
    ) -> None:
        """Index a stored chain; `salt`: the namespace its first block starts (a root, or the
        first private block after a public prefix)."""
        if salt:
            self.index.tag_namespace(keys[0], salt)
        self.blocks_stored += self.index.insert(keys, self.worker, group, now, parent=parent)
        if self.journal is not None:
            self.journal.stored(group, keys, parent, salt)

    def _remove(self, keys: list[int], group: str) -> int:
        if self.journal is not None:
            self.journal.removed(group, keys)
        return self.index.remove(keys, self.worker, group)

    def _remember(self, hashes: list[BlockHash], keys: list[int], group: str) -> None:
        if group != self.base_group:
            for h, key in zip(hashes, keys, strict=True):
                self._forget_other_key(h, key)
                self._other[h] = (key, group)
            return
        mapped = self._keys
        if not self._other:
            if not mapped and hashes == keys:
                return  # our own hashing: identity needs no entry
            if mapped.add_new(hashes, keys):  # new blocks (the common case): no conflicts
                return
        for h, key in zip(hashes, keys, strict=True):
            old = mapped.get(h)
            if (old is not None and old != key) or self._other:
                self._forget_other_key(h, key)
            if h == key:
                mapped.pop(h, None)  # identity: no entry
            else:
                mapped[h] = key

    def _remember_host(self, hashes: list[BlockHash], keys: list[int], group: str) -> None:
        host = self._host
        identity = group == self.base_group
        for h, key in zip(hashes, keys, strict=True):
            if identity and h == key:
                host.pop(h, None)  # our own hashing: identity needs no entry
            else:
                host[h] = (key, group)

    def _count_repeats(self, hashes: list[BlockHash], keys: list[int], resident: str) -> None:
        """Count the blocks announced to the host tier again while held there."""
        index, worker, repeats = self.index, self.worker, self._host_repeats
        for h, key in zip(hashes, keys, strict=True):
            if index.holds(key, worker, resident):
                repeats[h] = repeats.get(h, 0) + 1

    def _removed_host(self, hashes: list[BlockHash]) -> None:
        by_group: dict[str, list[int]] = {}
        base = self.base_group
        repeats = self._host_repeats
        for h in hashes:
            left = repeats.get(h)
            if left is not None:  # announced more often than removed so far: still held
                if left > 1:
                    repeats[h] = left - 1
                else:
                    del repeats[h]
                continue
            known = self._host.pop(h, None)
            if known is None:
                if type(h) is not int:
                    continue  # never seen: nothing to remove
                known = (h, base)
            by_group.setdefault(known[1], []).append(known[0])
        for group, keys in by_group.items():
            self.blocks_removed += self._remove(keys, host_group(group))

    def _forget_other_key(self, engine_hash: BlockHash, key: int) -> None:
        """An engine hash stored again under another key (should not happen): drop the old."""
        old = self._other.get(engine_hash)
        if old is None and (old_key := self._keys.get(engine_hash)) is not None:
            old = (cast(int, old_key), self.base_group)
        if old is not None and old[0] != key:
            self._remove([old[0]], old[1])
            self._other.pop(engine_hash, None)
            self._keys.pop(engine_hash, None)

    def _removed(self, ev: BlockRemoved) -> None:
        if ev.medium in self.media and ev.group_idx in self.cache_groups:
            self.removed(ev.block_hashes, ev.medium)

    def removed(self, hashes: list[BlockHash], medium: str | None) -> None:
        """Blocks gone from `medium`, by the engine's hashes: a BlockRemoved, or the replay's
        engines' changes in-process."""
        if self.own_keys and not self._other and not self._host:  # all keyed as ours, base group
            group = self._base_host if medium == MEDIUM_CPU else self.base_group
            self.blocks_removed += self._remove(cast(list[int], hashes), group)
            return
        if medium == MEDIUM_CPU:
            self._removed_host(hashes)
            return
        removed = 0
        base_keys: list[int] = []
        for h in hashes:
            other = self._other.pop(h, None)
            if other is not None:
                removed += self._remove([other[0]], other[1])
                continue
            key = cast(int | None, self._keys.pop(h, None))
            if key is None:
                if type(h) is not int:
                    continue  # never seen: nothing to remove
                key = h  # identity, or never seen (then the index holds nothing to remove)
            base_keys.append(key)
        if base_keys:
            removed += self._remove(base_keys, self.base_group)
        self.blocks_removed += removed

    def stats(self) -> MirrorStats:
        return MirrorStats(*[getattr(self, name) for name in MirrorStats._fields])
