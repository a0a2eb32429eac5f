"""The KV mirror's common case in C (core/_kv_ingest.c) builds the index, the hash maps and the
counts its Python path builds, on random vLLM-format batches that mix the common case with
everything it hands back: unknown parents, hashes stored twice, removals, AllBlocksCleared,
salted and LoRA blocks, the host tier, another block size, bytes hashes."""

from __future__ import annotations

import random

import pytest

from core.blocks import chain_keys, namespace, parent_prefix
from core.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    block_stored,
    decode_for_ingest,
    encode_batch,
    keyed_ops,
)
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror

BS = 4
W = "w0"


class Stream:
    """A random engine's events: chains that continue earlier ones (or not), removals, clears."""

    def __init__(self, seed: int, ours: bool) -> None:
        self.rng = random.Random(seed)
        self.ours = ours  # engine hashes are our keys (our workers) rather than random ints
        self.known: list[tuple[BlockHash, int]] = []  # (engine hash, our key) stored so far
        self.next_token = 0

    def _tokens(self, blocks: int) -> list[int]:
        self.next_token += blocks * BS
        return list(range(self.next_token - blocks * BS, self.next_token))

    def stored(self) -> KVEvent:
        rng = self.rng
        n = rng.choice([1, 2, 3, 8, 8, 8])
        tokens = self._tokens(n)
        pick = rng.random()
        parent: BlockHash | None = None
        parent_key: int | None = None
        if self.known and pick < 0.7:  # a chain that continues one (perhaps removed since)
            parent, parent_key = rng.choice(self.known[-40:])
        elif pick < 0.8:  # a parent never seen
            parent = parent_key = rng.getrandbits(64)
        first = namespace(None) if parent_key is None else parent_prefix(parent_key)
        keys = chain_keys(tokens, BS, first)
        hashes: list[BlockHash] = list(keys) if self.ours else [rng.getrandbits(64) for _ in keys]
        if self.known and rng.random() < 0.05:  # a hash stored again, under another key
            hashes[0] = rng.choice(self.known)[0]
        if rng.random() < 0.03:
            hashes[-1] = rng.randbytes(8)  # a bytes hash: the Python path's
        self.known.extend(zip(hashes, keys, strict=True))
        odd = rng.random()
        if odd < 0.05:
            return block_stored(hashes, parent, tokens, BS, salt="tenant-a")
        if odd < 0.10:
            return block_stored(hashes, parent, tokens, BS, lora_name="adapter", lora_id=1)
        if odd < 0.14:
            return block_stored(hashes, parent, tokens, BS, medium="CPU")
        if odd < 0.16:
            return BlockStored(hashes, parent, tokens, 2 * BS, None, "GPU")  # another size
        if odd < 0.18:
            return BlockStored(hashes, parent, tokens[:-1], BS, None, "GPU")  # a token short
        return BlockStored(hashes, parent, tokens, BS, None, rng.choice(["GPU", None]))

    def event(self) -> KVEvent:
        pick = self.rng.random()
        if pick < 0.2 and self.known:
            gone = self.rng.sample(self.known, min(len(self.known), self.rng.randint(1, 6)))
            hashes = [h for h, _ in gone] + ([self.rng.getrandbits(64)] if pick < 0.05 else [])
            return BlockRemoved(hashes, self.rng.choice(["GPU", None, "CPU"]))
        if pick < 0.22:
            return AllBlocksCleared()
        return self.stored()

    def payloads(self, batches: int) -> list[bytes]:
        out = []
        for seq in range(batches):
            events = [self.event() for _ in range(self.rng.choice([1, 1, 4, 8]))]
            out.append(encode_batch(EventBatch(float(seq), events), array_like=False))
        return out


def _state(mirror: WorkerMirror, hashes: list[BlockHash]) -> object:
    """Everything the mirror and its index hold, runs and LRU order included."""
    index = mirror.index
    index.check()
    runs = sorted(
        (
            tuple(run.keys),
            None if run.parent is None else run.parent.keys[-1],
            run.mask,
            run.children,
        )
        for run in index._runs.values()
    )
    lru, run = [], index._lru.next
    while run is not index._lru:
        assert run is not None
        lru.append(tuple(run.keys))
        run = run.next
    return (
        mirror.stats(),
        runs,
        lru,
        index.stats(),
        sorted(mirror.groups),
        [mirror._keys.get(h) for h in hashes],
        len(mirror._keys),
        mirror._other,
        mirror._host,
        mirror._host_repeats,
    )


@pytest.mark.skipif(keyed_ops is None, reason="core/_kv_ingest.c is not built")
@pytest.mark.parametrize("ours", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_keyed_path_builds_what_the_python_path_builds(seed: int, ours: bool) -> None:
    stream = Stream(seed, ours)
    payloads = stream.payloads(120)
    hashes = [h for h, _ in stream.known]
    mirrors = [
        WorkerMirror(UnifiedIndex(), W, "g", block_size=BS, keyed=keyed) for keyed in (True, False)
    ]
    assert mirrors[0]._keyed and not mirrors[1]._keyed
    for seq, payload in enumerate(payloads):
        for mirror in mirrors:
            mirror.apply(seq, decode_for_ingest(payload), float(seq))
        if seq % 30 == 29:
            assert _state(mirrors[0], hashes) == _state(mirrors[1], hashes)
    fast, slow = mirrors
    assert _state(fast, hashes) == _state(slow, hashes)
    assert fast.blocks_stored > 0 and fast.blocks_removed > 0 and fast.skipped_orphans > 0


@pytest.mark.skipif(keyed_ops is None, reason="core/_kv_ingest.c is not built")
def test_keyed_ops_stop_where_the_python_path_must_decide() -> None:
    """A removal and a known-parent chain are keyed; a chain whose hash is mapped already stops
    the walk, the table as it was."""
    mirror = WorkerMirror(UnifiedIndex(), W, "g", block_size=BS)
    tokens = list(range(2 * BS))
    keys = chain_keys(tokens, BS, namespace(None))
    root = BlockStored([11, 12], None, tokens, BS, None, "GPU")
    mirror.apply(0, decode_for_ingest(encode_batch(EventBatch(0.0, [root]), array_like=False)), 0)
    assert mirror._keys.get(12) == keys[1]
    child_tokens = list(range(100, 100 + BS))
    again = BlockStored([12], 12, child_tokens, BS, None, "GPU")  # 12 is mapped: a conflict
    child = BlockStored([13], 12, child_tokens, BS, None, "GPU")
    removal = BlockRemoved([13, 99], "GPU")
    batch = decode_for_ingest(
        encode_batch(EventBatch(1.0, [child, removal, again]), array_like=False)
    )
    assert keyed_ops is not None
    ops: list[object] = ["left from before"]
    stop = keyed_ops(batch.events, 0, mirror._keys, BS, ops)
    child_key = chain_keys(child_tokens, BS, parent_prefix(keys[1]))[0]
    assert stop == 2
    assert ops == [0, [child_key], keys[1], 2, [child_key, 99], None]
    assert mirror._keys.get(13) is None and mirror._keys.get(12) == keys[1]


@pytest.mark.skipif(keyed_ops is None, reason="core/_kv_ingest.c is not built")
def test_keyed_ops_leave_a_parent_of_our_hashing_to_the_index() -> None:
    """Hashes that are our keys need no table entry: a chain whose parent is in no table is
    keyed after that parent's hash, its own key, and the mirror asks the index for it."""
    mirror = WorkerMirror(UnifiedIndex(), W, "g", block_size=BS)
    tokens = list(range(3 * BS))
    keys = chain_keys(tokens, BS, namespace(None))
    root = BlockStored(keys[:2], None, tokens[: 2 * BS], BS, None, "GPU")
    child = BlockStored(keys[2:], keys[1], tokens[2 * BS :], BS, None, "GPU")
    orphan = BlockStored([5], 4, tokens[:BS], BS, None, "GPU")  # keyed after 4: not ours
    batch = decode_for_ingest(
        encode_batch(EventBatch(0.0, [root, child, orphan]), array_like=False)
    )
    assert keyed_ops is not None
    ops: list[object] = []
    assert keyed_ops(batch.events, 0, mirror._keys, BS, ops) == 2
    assert ops == [0, keys[:2], None, 1, keys[2:], keys[1]]
    assert len(mirror._keys) == 0
    mirror.apply(0, batch, 0.0)
    assert mirror.index.residency(W, "g") == set(keys)
    assert mirror.skipped_orphans == 1
