"""A worker's event stream rebuilt in the unified index: against a reference engine's own
residency, through gaps, restarts and replays, in memory and over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable

import pytest

from core.blocks import block_keys
from core.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    block_stored,
    decode_batch,
    decode_for_ingest,
    encode_batch,
)
from core.kv_publisher import KVEventPublisher
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.kv_outcomes import Outcome
from router.kv_subscriber import KVEventSubscriber

BS = 4
W = "w0"
G = "g"
Node = tuple[str | None, tuple[int, ...]]  # (salt, every token up to the end of the block)


class RefEngine:
    """A toy prefix cache that publishes vLLM's events; its blocks are the truth.

    hashing: "ours" (engine hash == our key, like our workers), "int" (random 64-bit ints,
    like vLLM's builtin hash) or "bytes" (random digests, like vLLM's sha256).
    """

    def __init__(self, hashing: str, seed: int) -> None:
        self.hashing = hashing
        self.rng = random.Random(seed)
        self.blocks: dict[Node, BlockHash] = {}
        self.children: dict[Node, int] = {}

    def _hash(self, node: Node) -> BlockHash:
        if self.hashing == "ours":
            return block_keys(node[1], BS, node[0])[-1]
        return self.rng.getrandbits(64) if self.hashing == "int" else self.rng.randbytes(32)

    def serve(self, tokens: list[int], salt: str | None = None) -> list[KVEvent]:
        n = len(tokens) // BS
        i, prev = 0, None
        while i < n and (salt, tuple(tokens[: (i + 1) * BS])) in self.blocks:
            prev = (salt, tuple(tokens[: (i + 1) * BS]))
            i += 1
        if i == n:
            return []
        parent = None if prev is None else self.blocks[prev]
        hashes = []
        for j in range(i, n):
            node = (salt, tuple(tokens[: (j + 1) * BS]))
            self.blocks[node] = self._hash(node)
            self.children[node] = 0
            if prev is not None:
                self.children[prev] += 1
            hashes.append(self.blocks[node])
            prev = node
        tail = tokens[i * BS : n * BS]
        root_salt = salt if parent is None else None
        return [block_stored(hashes, parent, tail, BS, salt=root_salt)]

    def evict(self, count: int) -> list[KVEvent]:
        leaves = [node for node, c in self.children.items() if c == 0]
        victims = self.rng.sample(leaves, min(count, len(leaves)))
        hashes = []
        for salt, path in victims:
            hashes.append(self.blocks.pop((salt, path)))
            del self.children[(salt, path)]
            if len(path) > BS:
                self.children[(salt, path[:-BS])] -= 1
        return [BlockRemoved(hashes, "GPU")] if hashes else []

    def clear(self) -> list[KVEvent]:
        self.blocks.clear()
        self.children.clear()
        return [AllBlocksCleared()]

    def truth(self) -> set[int]:
        """Our keys of every block held, computed from scratch."""
        return {block_keys(path, BS, salt)[-1] for salt, path in self.blocks}

    def step(self, rng: random.Random, salts: list[str | None]) -> list[KVEvent]:
        """A scheduler step: a few requests (sharing a handful of prefixes), some evictions."""
        events: list[KVEvent] = []
        for _ in range(rng.randint(1, 3)):
            prefix = PREFIXES[rng.randrange(len(PREFIXES))]
            tail = [rng.randrange(40) for _ in range(rng.randrange(0, 3 * BS + 2))]
            events += self.serve(prefix + tail, rng.choice(salts))
        if rng.random() < 0.5:
            events += self.evict(rng.randint(1, 4))
        return events


PREFIXES = [[7] * BS, [7] * BS + [8] * BS, [9] * (2 * BS), [1, 2, 3, 4, 5, 6]]
SALTS_BY_HASHING = {"ours": [None, None, "tenant-a", "tenant-b"], "int": [None], "bytes": [None]}

Stream = list[tuple[int, bytes, set[int]]]  # (seq, payload, the engine's truth after it)


def record(
    engine: RefEngine,
    steps: int,
    *,
    seed: int,
    array_like: bool,
    first_seq: int = 0,
    clear_at: int | None = None,
) -> Stream:
    rng = random.Random(seed)
    salts = SALTS_BY_HASHING[engine.hashing]
    stream: Stream = []
    for i in range(steps):
        events = engine.clear() if i == clear_at else engine.step(rng, salts)
        payload = encode_batch(EventBatch(1000.0 + first_seq + i, events, 0), array_like=array_like)
        stream.append((first_seq + i, payload, engine.truth()))
    return stream


def residency(index: UnifiedIndex) -> set[int]:
    return index.residency(W, G)


def feed(
    mirror: WorkerMirror,
    seq: int,
    payload: bytes,
    replay: Stream | None = None,
    decode: Callable[[bytes], EventBatch] = decode_batch,
) -> Outcome:
    """What the subscriber does, without sockets: on a gap, replay from our last seq (one
    batch of overlap) out of `replay`; without one, reset and start afresh from this batch."""
    result = mirror.apply(seq, decode(payload), now=float(seq))
    if result.resume_from is None:
        return result.outcome
    if replay is not None:
        start = max(mirror.last_seq or 0, 0)
        for s, p, _ in replay:
            if s >= start:
                assert mirror.apply(s, decode_batch(p), now=float(s)).resume_from is None
        return result.outcome
    mirror.reset()
    assert mirror.apply(seq, decode_batch(payload), now=float(seq)).outcome is Outcome.OK
    return result.outcome


# salted roots (our workers) in both encodings, as vLLM's hashes; decoded as the subscriber
# does (token ids raw) and into plain records
@pytest.mark.parametrize("decode", [decode_for_ingest, decode_batch])
@pytest.mark.parametrize(
    ("hashing", "array_like"),
    [("ours", False), ("ours", True), ("int", False), ("int", True), ("bytes", True)],
)
def test_mirror_reproduces_the_engine_exactly(
    hashing: str, array_like: bool, decode: Callable[[bytes], EventBatch]
) -> None:
    engine = RefEngine(hashing, seed=1)
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    for seq, payload, truth in record(engine, 80, seed=2, array_like=array_like):
        assert feed(mirror, seq, payload, decode=decode) is Outcome.OK
        assert residency(index) == truth
    index.check()
    assert mirror.blocks_stored - mirror.blocks_removed == len(engine.blocks) > 0
    assert mirror.skipped_orphans == mirror.skipped_unkeyable == 0
    # our own hashing needs no map; foreign hashes need one entry per block held
    mapped = len(mirror._keys) + len(mirror._other)
    assert mapped == (0 if hashing == "ours" else len(engine.blocks))
    assert mirror.last_seq == 79 and mirror.last_event_ts == 1079.0


@pytest.mark.parametrize("hashing", ["ours", "int", "bytes"])
def test_gap_without_replay_keeps_nothing_stale(hashing: str) -> None:
    engine = RefEngine(hashing, seed=3)
    stream = record(engine, 90, seed=4, array_like=False, clear_at=60)
    lost = set(range(20, 30))  # evictions among them: what they removed must not survive
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    outcomes = []
    for seq, payload, truth in stream:
        if seq in lost:
            continue
        outcomes.append(feed(mirror, seq, payload))
        assert residency(index) <= truth  # a subset of the truth, always
        if seq > 60:  # AllBlocksCleared: the truth is fully known again
            assert residency(index) == truth
    assert outcomes.count(Outcome.GAP) == 1 and mirror.gaps == 1 and mirror.resets == 1
    assert mirror.skipped_orphans > 0  # children of blocks stored before the gap
    index.check()


@pytest.mark.parametrize("hashing", ["ours", "bytes"])
def test_gap_recovered_by_replay_is_exact(hashing: str) -> None:
    engine = RefEngine(hashing, seed=5)
    stream = record(engine, 70, seed=6, array_like=False)
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    gaps = 0
    for seq, payload, _ in stream:
        if seq % 9 in (3, 4):  # lost on the wire, still in the replay buffer
            continue
        gaps += feed(mirror, seq, payload, replay=stream[: seq + 1]) is Outcome.GAP
        assert residency(index) == stream[seq][2]
    # each replay starts with one batch of overlap: the proof that the stream is the same
    assert mirror.gaps == gaps == 8 and mirror.duplicates == 8 and mirror.resets == 0


def test_duplicates_are_ignored_and_a_new_incarnation_starts_over() -> None:
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    old = record(RefEngine("int", seed=7), 30, seed=8, array_like=False)
    for seq, payload, _ in old:
        feed(mirror, seq, payload)
    for seq, payload, _ in old[25:]:  # a replay overlapping what was applied
        assert feed(mirror, seq, payload) is Outcome.DUPLICATE
    assert residency(index) == old[-1][2]
    # the worker restarts: same seqs, other batches (its cache is empty again)
    new = record(RefEngine("int", seed=9), 10, seed=10, array_like=False)
    assert feed(mirror, 0, new[0][1]) is Outcome.RESTART
    assert residency(index) == new[0][2]
    for seq, payload, _ in new[1:7]:
        feed(mirror, seq, payload)
    # a restart first seen after its seq 0: the mirror asks for a replay from 0
    newer = record(RefEngine("int", seed=11), 10, seed=12, array_like=False)
    assert feed(mirror, 4, newer[4][1], replay=newer[:5]) is Outcome.RESTART
    assert residency(index) == newer[4][2]
    assert mirror.restarts == 2


def test_lora_groups_salts_and_what_is_not_tracked() -> None:
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    toks = list(range(3 * BS))
    k = block_keys(toks, BS)
    salted = block_keys(toks, BS, "t")
    vision = [1, 2]
    events: list[KVEvent] = [
        BlockStored([11, 12], None, toks[: 2 * BS], BS, None, "GPU"),
        BlockStored([13], 12, toks[2 * BS :], BS, None, "GPU"),
        BlockStored([21], None, toks[:BS], BS, 7, "GPU"),  # a LoRA adapter: its own kv_group
        block_stored([31], None, toks[:BS], BS, salt="t"),
        BlockStored([41], None, toks[:BS], BS, None, "CPU"),  # offloaded: not tracked
        BlockStored([51], None, toks[:BS], BS, None, "GPU", group_idx=1),  # another group
        BlockStored([61, 62], 99, toks[: 2 * BS], BS, None, "GPU"),  # parent never seen
        # a multimodal block: its hash covers more than its tokens, so it and its child go
        BlockStored([71, 72], 31, toks[BS : 3 * BS], BS, None, "GPU", extra_keys=[None, vision]),
        BlockStored([73], 72, toks[:BS], BS, None, "GPU"),
        BlockStored([81], None, toks[: BS + 1], BS, None, "GPU"),  # tokens do not fit
    ]
    mirror.apply(0, EventBatch(1.0, events), now=1.0)
    assert residency(index) == set(k) | set(salted[:2])
    assert index.residency(W, f"{G}+lora:7") == {k[0]}
    assert index.match(salted, G) == {W: 2}  # salted root at 31, then its plain child 71
    assert mirror.skipped_orphans == 3 and mirror.skipped_unkeyable == 2
    stats_before = mirror.stats()
    mirror.apply(1, EventBatch(2.0, [BlockStored([11], None, toks[:BS], BS, None, "GPU")]), 2.0)
    assert mirror.stats().blocks_stored == stats_before.blocks_stored  # stored twice: no-op
    mirror.apply(2, EventBatch(3.0, [BlockRemoved([13, 21, 999], "GPU")]), now=3.0)
    assert residency(index) == {k[0], k[1], *salted[:2]}
    assert not index.residency(W, f"{G}+lora:7")
    mirror.apply(3, EventBatch(4.0, [AllBlocksCleared()]), now=4.0)
    assert index.blocks_held(W, G) == 0 and len(mirror._keys) + len(mirror._other) == 0


def test_events_confirm_pending_blocks_and_a_resync_drops_them() -> None:
    index = UnifiedIndex(pending_ttl_s=10.0)
    mirror = WorkerMirror(index, W, G, BS)
    toks = list(range(3 * BS))
    k = block_keys(toks, BS)
    index.insert(k, W, G, 0.0, pending=True)  # the gateway sent a request with these blocks
    stored = [BlockStored([11, 12], None, toks[: 2 * BS], BS, None, "GPU")]
    mirror.apply(0, EventBatch(1.0, stored), now=1.0)
    assert mirror.blocks_stored == index.sizes(W, G)[1] == 2  # confirmed: stored once
    assert [key in index._pending for key in k] == [False, False, True]  # W is the only one
    assert index.match(k, G) == {W: 3}
    mirror.reset()  # a gap without replay: nothing stale survives, pending or not
    assert index.match(k, G) == {} and index.stats().pending == 0
    index.insert(k, W, G, 2.0, pending=True)
    mirror.apply(0, EventBatch(3.0, [AllBlocksCleared()]), now=3.0)
    assert index.match(k, G) == {} and index.stats().pending == 0
    index.check()


def test_undecodable_batch_resets_the_worker() -> None:
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    stream = record(RefEngine("int", seed=13), 5, seed=14, array_like=False)
    for seq, payload, _ in stream[:3]:
        feed(mirror, seq, payload)
    mirror.undecodable(3)
    assert not residency(index) and mirror.decode_errors == 1 and mirror.last_seq == 3
    mirror.undecodable(3)  # its replayed copy changes nothing
    assert mirror.resets == 1
    assert feed(mirror, 4, stream[4][1]) is Outcome.OK


# -- over real sockets ---------------------------------------------------------------------


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def free_endpoints(n: int) -> list[str]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


class Worker:
    """A reference engine behind a real publisher."""

    def __init__(self, seed: int, endpoint: str, replay: str | None) -> None:
        self.engine = RefEngine("int", seed)
        self.rng = random.Random(seed)
        self.pub = KVEventPublisher(endpoint, replay, buffer_steps=1000)

    def step(self, *, live: bool = True) -> int:
        return self.pub.publish(self.engine.step(self.rng, [None]), live=live)


def subscribed(
    seed: int,
) -> tuple[Worker, UnifiedIndex, WorkerMirror, KVEventSubscriber, asyncio.Task[None]]:
    """A worker with a replay socket, and a subscriber following it into a fresh index."""
    worker = Worker(seed, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    sub = KVEventSubscriber(mirror, worker.pub.endpoint, worker.pub.replay_endpoint)
    return worker, index, mirror, sub, asyncio.create_task(sub.run())


async def test_subscriber_recovers_lost_messages_and_restarts() -> None:
    worker, index, mirror, sub, task = subscribed(15)

    def caught_up(w: Worker) -> bool:
        return mirror.last_seq == w.pub.next_seq - 1 and residency(index) == w.engine.truth()

    try:
        for _ in range(10):  # history from before the gateway subscribed: learned by replay
            worker.step()
        await asyncio.wait_for(sub.synced.wait(), 5)
        await until(lambda: caught_up(worker))
        while sub.messages == 0:  # the subscription is live once a message comes through
            worker.step()
            await asyncio.sleep(0.01)
        await until(lambda: caught_up(worker))
        gaps = mirror.gaps
        for _ in range(3):
            worker.step(live=False)  # lost on the wire, kept for replay
        worker.step()  # its seq reveals the gap
        await until(lambda: caught_up(worker))
        assert mirror.gaps == gaps + 1 and mirror.resets == 1 and sub.replay_failures == 0

        # the worker restarts on the same endpoints: a new incarnation, seq from 0, cache empty;
        # then again, its new stream outrunning the old one (seq alone would not tell)
        for restart, (seed, steps) in enumerate([(16, 3), (17, 2 * worker.pub.next_seq)], 1):
            old_truth = worker.engine.truth()
            worker.pub.close()
            worker = Worker(seed, worker.pub.endpoint, worker.pub.replay_endpoint)
            for _ in range(steps):
                worker.step(live=False)
            worker.step()
            await until(lambda w=worker, n=restart: caught_up(w) and mirror.restarts == n)
            assert not residency(index) & (old_truth - worker.engine.truth())
        assert mirror.resets == 1  # replays covered everything: no history given up
    finally:
        sub.stop()
        await asyncio.wait_for(task, 5)
        worker.pub.close()


async def test_subscriber_started_before_its_worker() -> None:
    endpoint, replay = free_endpoints(2)
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    sub = KVEventSubscriber(mirror, endpoint, replay, replay_timeout_s=0.2)
    task = asyncio.create_task(sub.run())
    worker = None
    try:
        await asyncio.wait_for(sub.synced.wait(), 5)  # the start-up replay timed out
        worker = Worker(17, endpoint, replay)
        for _ in range(12):  # published while the SUB socket may not be connected yet
            worker.step()
        w = worker
        await until(lambda: mirror.last_seq == 11 and residency(index) == w.engine.truth())
        assert sub.reconnects >= 1 and mirror.resets == 1
    finally:
        sub.stop()
        await asyncio.wait_for(task, 5)
        if worker is not None:
            worker.pub.close()


async def test_subscriber_without_replay_resets_on_a_gap() -> None:
    worker = Worker(18, "tcp://127.0.0.1:0", None)
    index = UnifiedIndex()
    mirror = WorkerMirror(index, W, G, BS)
    sub = KVEventSubscriber(mirror, worker.pub.endpoint)
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.wait_for(sub.synced.wait(), 5)
        while sub.messages == 0:
            worker.step()
            await asyncio.sleep(0.01)
        for _ in range(5):
            worker.step(live=False)
        last = worker.step()
        await until(lambda: mirror.last_seq == last)
        assert mirror.gaps == 1 and residency(index) <= worker.engine.truth()
        worker.pub.publish_payload(b"\x00garbage")  # never kills the subscriber
        final = worker.step()
        await until(lambda: mirror.last_seq == final)
        assert mirror.decode_errors == 1 and residency(index) <= worker.engine.truth()
    finally:
        sub.stop()
        await asyncio.wait_for(task, 5)
        worker.pub.close()


async def test_subscriber_drains_a_burst_in_order() -> None:
    """Messages that pile up while the loop is busy are all applied, in order, on one wake."""
    worker, index, mirror, sub, task = subscribed(19)
    try:
        await asyncio.wait_for(sub.synced.wait(), 5)
        while sub.messages == 0:  # live once a message comes through (replay fills the rest)
            worker.step()
            await asyncio.sleep(0.01)
        await until(lambda: mirror.last_seq == worker.pub.next_seq - 1)
        await until(lambda: residency(index) == worker.engine.truth())
        seen, replays, first = sub.messages, sub.replays, mirror.last_seq
        for _ in range(300):  # without yielding: they wait in the SUB queue together
            last = worker.step()
        turns: list[int | None] = []  # where the mirror stood each time another task ran
        while mirror.last_seq != last:
            turns.append(mirror.last_seq)
            await asyncio.sleep(0)
            assert len(turns) < 100_000, "timed out"
        assert sub.messages == seen + 300 and sub.replays == replays  # none lost or doubted
        assert residency(index) == worker.engine.truth()
        # the drain gives the loop a turn now and then: requests are not held up behind it
        assert any(t is not None and first < t < last for t in turns)
    finally:
        sub.stop()
        await asyncio.wait_for(task, 5)
        worker.pub.close()
