"""The keyed delta of one ingest per host (router/kv_delta.py): a follower's index, fed only the
ops the leader's mirror journaled (or a snapshot of the leader's index, then the ops after it),
holds what the leader's holds, through resyncs, clears, salts, LoRA and host-tier blocks."""

from __future__ import annotations

import pytest

from core.blocks import block_keys
from core.kv_events import BlockRemoved, BlockStored, EventBatch, decode_for_ingest
from router.index import UnifiedIndex, host_group
from router.kv_delta import (
    FollowedStream,
    Op,
    StreamJournal,
    apply_ops,
    decode_ops,
    encode_ops,
    pack,
    snapshot,
    unpack,
)
from router.kv_mirror import WorkerMirror
from tests.router.test_kv_mirror import BS, G, RefEngine, W, feed, record


def journaled(index: UnifiedIndex) -> tuple[WorkerMirror, list[Op]]:
    ops: list[Op] = []
    mirror = WorkerMirror(index, W, G, BS)
    mirror.journal = StreamJournal(W, G, ops, lambda: None)
    return mirror, ops


def follower() -> tuple[UnifiedIndex, dict[tuple[str, str], FollowedStream]]:
    return UnifiedIndex(), {(W, G): FollowedStream(W, G, synced_at=-1)}


def same(a: UnifiedIndex, b: UnifiedIndex, groups: list[str]) -> None:
    for group in groups:
        assert a.residency(W, group) == b.residency(W, group), group
    b.check()


def ship(ops: list[Op]) -> list[Op]:
    """What a follower receives: the ops, encoded and decoded, and taken off the journal."""
    sent = decode_ops(encode_ops(ops))
    ops.clear()
    return sent


@pytest.mark.parametrize("hashing", ["ours", "int", "bytes"])
def test_a_follower_applying_the_journal_holds_what_the_leader_holds(hashing: str) -> None:
    leader = UnifiedIndex()
    mirror, ops = journaled(leader)
    index, streams = follower()
    stream = record(RefEngine(hashing, seed=5), 120, seed=6, array_like=False, clear_at=70)
    for seq, payload, _ in stream:
        if seq in (40, 41):  # a gap no replay closes: the leader resets, the follower too
            continue
        feed(mirror, seq, payload, decode=decode_for_ingest)
        apply_ops(index, ship(ops), streams, float(seq), seq)
        same(leader, index, [G])
        assert index.namespaces.keys() <= leader.namespaces.keys()
    truth = stream[-1][2]  # the clear at 70 left nothing stale behind
    assert index.residency(W, G) == truth and truth
    followed = streams[(W, G)]
    assert (followed.blocks_stored, followed.blocks_removed) == (
        mirror.blocks_stored,
        mirror.blocks_removed,
    )


def test_lora_host_tier_salts_and_gone() -> None:
    leader = UnifiedIndex()
    mirror, ops = journaled(leader)
    index, streams = follower()
    toks = list(range(3 * BS))
    events = [
        BlockStored([11, 12], None, toks[: 2 * BS], BS, None, "GPU", extra_keys=[["t"], None]),
        BlockStored([13], 12, toks[2 * BS :], BS, None, "GPU"),
        BlockStored([21], None, toks[:BS], BS, 7, "GPU"),  # a LoRA adapter's kv_group
        BlockStored([41, 42], None, toks[: 2 * BS], BS, None, "CPU"),  # the host tier
        BlockRemoved([13, 2**70 + 1, -5], "GPU"),  # unknown hashes: held nowhere
        BlockRemoved([42], "CPU"),
    ]
    groups = [G, f"{G}+lora:7", host_group(G)]
    for seq, ev in enumerate(events):
        mirror.apply(seq, EventBatch(float(seq), [ev]), now=float(seq))
        apply_ops(index, ship(ops), streams, float(seq), seq)
        same(leader, index, groups)
    salted = block_keys(toks[: 2 * BS], BS, "t")
    assert index.namespaces[salted[0]] == "t" and index.match(salted, G) == {W: 2}
    assert index.residency(W, f"{G}+lora:7") and index.residency(W, host_group(G))
    mirror.journal.gone()  # type: ignore[union-attr]  # the leader's stream stopped
    apply_ops(index, ship(ops), streams, 9.0, 9)
    assert all(not index.residency(W, g) for g in groups)


def test_a_snapshot_then_the_ops_after_it_give_the_same_index() -> None:
    leader = UnifiedIndex(pending_ttl_s=10.0)
    mirror, ops = journaled(leader)
    stream = record(RefEngine("int", seed=7), 60, seed=8, array_like=True)
    for seq, payload, _ in stream[:30]:
        feed(mirror, seq, payload)
    ops.clear()  # what the late follower never saw
    routed = block_keys(list(range(40, 40 + 3 * BS)), BS)
    leader.insert(routed, W, G, 0.0, pending=True)  # the leader's own dispatch: not shipped
    index, streams = follower()
    apply_ops(index, ship(snapshot(leader, W, G, mirror.groups)), streams, 30.0, 30)
    assert index.residency(W, G) == leader.residency(W, G) - set(routed)
    assert index.sizes(W, G) == (len(leader.residency(W, G) - set(routed)), mirror.blocks_stored)
    for seq, payload, truth in stream[30:]:
        feed(mirror, seq, payload)
        apply_ops(index, ship(ops), streams, float(seq), seq)
        assert index.residency(W, G) == truth
        assert index.sizes(W, G)[1] == mirror.blocks_stored  # the inflow policies read
    index.check()


def test_ops_of_streams_not_followed_or_not_live_are_dropped() -> None:
    index = UnifiedIndex()
    streams = {(W, G): FollowedStream(W, G)}  # registered, its snapshot not in yet
    keys = block_keys(list(range(2 * BS)), BS)
    ops = [Op(0, W, G, G, pack(keys)), Op(0, "other", G, G, pack(keys))]
    apply_ops(index, ops, streams, 1.0, 5)
    assert len(index) == 0
    streams[(W, G)].synced_at = 5  # its snapshot covers delta 5: applied from 6 on
    apply_ops(index, ops, streams, 1.0, 5)
    assert len(index) == 0
    apply_ops(index, ops, streams, 1.0, 6)
    assert index.residency(W, G) == set(keys) and not index.residency("other", G)
    assert unpack(pack([1, 2**64 - 1])) == [1, 2**64 - 1]
    assert unpack(pack([3, -1, 2**64])) == [3]
