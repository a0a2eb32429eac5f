"""The host tier under the radix cache (backends/cache/host.py): what GPU eviction drops is
demoted with its KV, promoted back on a match, evicted by its own LRU; the KV of every cached
page is its block's after every operation; its events, mirrored, are what each tier holds."""

from __future__ import annotations

import random

from backends.cache.check import check
from backends.cache.host import HostTier
from backends.cache.radix import RadixCache
from backends.cache.scopes import invalidate
from core.blocks import block_keys, salt_scope
from core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    block_stored,
)
from router.index import UnifiedIndex, host_group
from router.kv_mirror import WorkerMirror

BS = 4


class Fleet:
    """One GPU cache (paged) with a host tier, their memories as page -> block key, and the
    KV events they publish."""

    def __init__(self, gpu_blocks: int, host_blocks: int) -> None:
        self.events: list[KVEvent] = []
        self.gpu = RadixCache(
            gpu_blocks * BS,
            BS,
            page_ids=list(range(gpu_blocks, 0, -1)),
            keep_tokens=True,
            on_stored=lambda g, p, k, t, s: self.events.append(
                block_stored(list(k), p, list(t or []), BS, medium=MEDIUM_GPU, salt=s)
            ),
            on_removed=lambda g, k: self.events.append(BlockRemoved(list(k), MEDIUM_GPU)),
        )
        self.host = HostTier(
            host_blocks * BS,
            BS,
            page_ids=list(range(host_blocks)),
            keep_tokens=True,
            on_stored=lambda g, p, k, t, s: self.events.append(
                block_stored(list(k), p, list(t or []), BS, medium=MEDIUM_CPU, salt=s)
            ),
            on_removed=lambda g, k: self.events.append(BlockRemoved(list(k), MEDIUM_CPU)),
        )
        self.gpu_mem: dict[int, int] = {}  # GPU page -> the block key whose KV it holds
        self.host_mem: dict[int, int] = {}
        self.host.attach(self.gpu, self._copy_out, self._copy_in)

    def _copy_out(self, src: list[int], dst: list[int]) -> None:
        for s, d in zip(src, dst, strict=True):
            self.host_mem[d] = self.gpu_mem[s]

    def _copy_in(self, src: list[int], dst: list[int]) -> None:
        for s, d in zip(src, dst, strict=True):
            self.gpu_mem[d] = self.host_mem[s]

    def serve(self, tokens: list[int], salt: str | None = None) -> tuple[int, int]:
        """Admit (GPU match, promotion), compute the rest, cache it, release: (gpu, host) hits."""
        gpu, host = self.gpu, self.host
        keys = block_keys(tokens, BS, salt)
        limit = (len(tokens) - 1) // BS
        match = gpu.match(keys, limit, "", tokens)
        node = match.node
        gpu.lock(node)
        node, promoted = host.promote(node, keys, match.blocks, limit, "", tokens, salt)
        cached = match.blocks + promoted
        rest = len(keys) - cached
        pages = gpu.allocate_pages(rest)
        if pages is None:
            gpu.unlock(node)
            return match.blocks, promoted
        for p, k in zip(pages, keys[cached:], strict=True):
            self.gpu_mem[p] = k  # computed here
        span = tokens[cached * BS : len(keys) * BS]
        ins = gpu.insert(node, keys[cached:], span, salt, -cached, pages)
        gpu.free_pages(pages[ins.inserted :])
        gpu.move_lock(node, ins.node)
        gpu.unlock(ins.node)
        return match.blocks, promoted

    def check(self) -> None:
        check(self.gpu)
        self.host.check()
        for tree in self.gpu.trees.values():
            for run in tree.runs:
                assert run.pages is not None
                for key, page in zip(run.keys, run.pages, strict=True):
                    assert self.gpu_mem[page] == key, "a GPU page holds another block's KV"
        for (_, key), block in self.host._lru.items():
            assert self.host_mem[block.page] == key, "a host page holds another block's KV"


def test_demote_promote_keep_every_page_right_and_the_mirror_in_step() -> None:
    rng = random.Random(7)
    fleet = Fleet(gpu_blocks=24, host_blocks=40)
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "m", BS, media={MEDIUM_GPU, MEDIUM_CPU, None})
    prefixes = [[rng.randrange(1000) for _ in range(BS * rng.randint(1, 6))] for _ in range(6)]
    hits = {"gpu": 0, "host": 0}
    for seq in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
        gpu_hit, host_hit = fleet.serve(tokens, rng.choice([None, None, "t.a", "t.b"]))
        hits["gpu"] += gpu_hit
        hits["host"] += host_hit
        fleet.check()
        mirror.apply(seq, EventBatch(float(seq), fleet.events), float(seq))
        fleet.events = []
        assert index.residency("w", "m") == fleet.gpu.keys(""), "GPU tier mirrored"
        assert index.residency("w", host_group("m")) == fleet.host.keys(""), "host tier mirrored"
    assert hits["host"] > 0 and hits["gpu"] > 0
    assert fleet.host.stats().promoted_blocks > 0 and fleet.host.stats().evicted_blocks > 0


def test_invalidation_reaches_the_host_tier() -> None:
    fleet = Fleet(gpu_blocks=3, host_blocks=40)
    secret = list(range(100, 100 + 3 * BS))
    fleet.serve(secret + [1], "t.a")
    fleet.serve(list(range(200, 200 + 3 * BS)) + [2])  # evicts the secret to the host
    assert fleet.host.match(block_keys(secret, BS, "t.a"), 0, 3) == 3
    invalidate(fleet.gpu, salt_scope(salt_prefix="t"))
    assert fleet.host.invalidate(salt_scope(salt_prefix="t")) == 3
    assert fleet.host.match(block_keys(secret, BS, "t.a"), 0, 3) == 0
    assert fleet.host.match(block_keys(list(range(200, 212)), BS), 0, 3) == 0  # still on GPU
    fleet.check()


def test_a_full_host_keeps_the_shallow_blocks_and_pins_what_it_promotes() -> None:
    fleet = Fleet(gpu_blocks=6, host_blocks=3)
    long = list(range(300, 300 + 5 * BS))
    fleet.serve(long + [1])
    fleet.serve(list(range(400, 400 + 5 * BS)) + [2])  # evicts 4 of `long`'s blocks: 3 fit
    keys = block_keys(long, BS)
    assert fleet.host.match(keys, 1, 5) == 3, "the shallowest blocks are kept"
    fleet.check()
    gpu_hit, host_hit = fleet.serve(long + [3])
    assert (gpu_hit, host_hit) == (1, 3)  # the GPU's evictions meanwhile find it pinned
    fleet.check()


def test_an_unpaged_tier_counts_room_only() -> None:
    gpu = RadixCache(8 * BS, BS)
    host = HostTier(16 * BS, BS)
    host.attach(gpu)
    root = gpu.root()
    for base in (0, 100, 200):
        tokens = list(range(base, base + 4 * BS))
        keys = block_keys(tokens, BS)
        assert gpu.allocate(4 * BS)
        gpu.insert(root, keys, tokens)
        check(gpu)
        host.check()
    assert len(host) == 4 and host.stats().demoted_blocks == 4
    keys = block_keys(list(range(0, 4 * BS)), BS)
    gpu.lock(root)
    node, n = host.promote(root, keys, 0, 4)
    assert n == 4 and gpu.match(keys).blocks == 4
    gpu.unlock(node)
    check(gpu)
    host.check()


def test_repeated_host_announcements_are_counted() -> None:
    """vLLM's self-describing offload events announce a hash once per chunk holding it (engine
    hashes, not our keys), and remove it as often: held until the last removal."""
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "m", BS)
    tokens = list(range(3 * BS))
    keys = block_keys(tokens, BS)
    hashes: list[int | bytes] = [b"h0", b"h1", b"h2"]
    gpu = BlockStored(hashes, None, tokens, BS, medium=MEDIUM_GPU)
    first = BlockStored(hashes[:2], None, tokens[: 2 * BS], BS, medium=MEDIUM_CPU)
    second = BlockStored(hashes[1:], b"h0", tokens[BS:], BS, medium=MEDIUM_CPU)
    mirror.apply(0, EventBatch(0.0, [gpu, first, second]), 0.0)
    assert index.residency("w", host_group("m")) == set(keys)
    mirror.apply(1, EventBatch(1.0, [BlockRemoved(hashes[:2], MEDIUM_CPU)]), 1.0)
    assert index.residency("w", host_group("m")) == set(keys[1:]), "h1 still in a chunk"
    mirror.apply(2, EventBatch(2.0, [BlockRemoved(hashes[1:], MEDIUM_CPU)]), 2.0)
    assert index.residency("w", host_group("m")) == set()
    assert index.residency("w", "m") == set(keys), "the GPU tier untouched"
