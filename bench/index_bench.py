"""Unified index benchmark: prompt keys + match, ingest rate, memory per block-residency.

    python bench/index_bench.py [--blocks N] [--workers W]

Against the pure-Python keys of the same run; targets and method: docs/benchmarks.md."""

import argparse
import gc
import itertools
import random
import time
import timeit
import tracemalloc
from functools import partial

from harness import percentile

from core.blocks import _python_chain_keys as python_chain_keys
from core.blocks import block_keys, chain_keys, has_native, namespace, parent_prefix
from core.kv_events import BlockStored, EventBatch, decode_for_ingest, encode_batch
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror

BS = 16
SYSTEM_TOKENS = 1024
CONV_TOKENS = 8192


def conversation_tokens(conv: int, system: int) -> list[int]:
    head = list(range(system * SYSTEM_TOKENS, (system + 1) * SYSTEM_TOKENS))
    base = 10_000_000 + conv * CONV_TOKENS
    return head + list(range(base, base + CONV_TOKENS - SYSTEM_TOKENS))


def build(index: UnifiedIndex, blocks: int, workers: list[str], rng: random.Random) -> int:
    n_system = 256
    for s in range(n_system):
        keys = block_keys(list(range(s * SYSTEM_TOKENS, (s + 1) * SYSTEM_TOKENS)), BS)
        for w in rng.sample(workers, 4):
            index.insert(keys, w, "llama-8b", 0.0)
    convs = (blocks - n_system * SYSTEM_TOKENS // BS) // ((CONV_TOKENS - SYSTEM_TOKENS) // BS)
    for c in range(convs):
        keys = block_keys(conversation_tokens(c, c % n_system), BS)
        holders = rng.sample(workers, 2) if rng.random() < 0.2 else [rng.choice(workers)]
        for w in holders:
            index.insert(keys, w, "llama-8b", float(c))
    return convs


def bench_match(index: UnifiedIndex, convs: int, rng: random.Random, n: int = 2000) -> None:
    prompts = [conversation_tokens(c, c % 256) for c in rng.sample(range(convs), 200)]
    cold = [[50_000_000 + i * CONV_TOKENS + t for t in range(CONV_TOKENS)] for i in range(20)]
    for label, pool in (("fully cached 8k prompt", prompts), ("cold 8k prompt", cold)):
        times = []
        for i in range(n):
            tokens = pool[i % len(pool)]
            t0 = time.perf_counter()
            index.match(block_keys(tokens, BS), "llama-8b", now=1e9)
            times.append(time.perf_counter() - t0)
        print(
            f"keys + match, {label:24s} median {percentile(times, 0.5) * 1e6:7.1f} us"
            f"   p99 {percentile(times, 0.99) * 1e6:7.1f} us"
        )
    tokens, ns = prompts[0], namespace(None)
    variants = [("keys only (native)", chain_keys), ("keys only (pure Python)", python_chain_keys)]
    for label, keys in variants:
        times = timeit.repeat(partial(keys, tokens, BS, ns), setup=gc.enable, number=1, repeat=300)
        print(f"{label:38s} median {percentile(times, 0.5) * 1e6:7.1f} us")


def bench_ingest(blocks: int = 192_000) -> None:
    """Event ingest through the whole path (payload -> decode -> mirror -> index), as the
    subscriber does it, and the bare insert; `vllm`: random engine hashes, so the mirror keeps
    the engine-hash -> key map. CPU time of this process (one core), the best of 3 runs, with
    the mirror's common case in C (core/_kv_ingest.c) and, the in-run baseline, all in Python."""
    rng = random.Random(1)
    # (blocks per BlockStored, events per batch): vLLM sends one batch per engine step
    shapes = ((8, 1), (8, 8), (32, 1), (32, 8))
    for (per_event, per_batch), label in itertools.product(shapes, ("ours", "vllm")):
        events, parent, parent_key = [], None, None
        for e in range(blocks // per_event):
            if e % 64 == 0:
                parent = parent_key = None  # a new conversation every 64 events
            base = 90_000_000 + e * per_event * BS
            tokens = list(range(base, base + per_event * BS))
            first = namespace(None) if parent_key is None else parent_prefix(parent_key)
            keys = chain_keys(tokens, BS, first)
            hashes = keys if label == "ours" else [rng.getrandbits(64) for _ in keys]
            events.append(BlockStored(hashes, parent, tokens, BS, None, "GPU"))
            parent, parent_key = hashes[-1], keys[-1]
        payloads = [
            # tagged-map events in a positional batch: what vLLM 0.32 and our workers send
            encode_batch(EventBatch(float(i), events[i : i + per_batch]), array_like=False)
            for i in range(0, len(events), per_batch)
        ]
        rates = {
            keyed: blocks / min(ingest(payloads, blocks, keyed) for _ in range(3)) / 1e3
            for keyed in (True, False)
        }
        shape = f"{label}, {per_event} blocks/event, {per_batch} events/batch"
        print(
            f"event ingest ({shape:36s}) {rates[True]:7.0f} k blocks/s"
            f"   mirror in Python {rates[False]:6.0f} k/s   x{rates[True] / rates[False]:.2f}"
        )
    index = UnifiedIndex()
    chains = [list(range(base, base + 512)) for base in range(0, blocks * BS, 512)]
    t0 = time.process_time()
    for tokens in chains:
        index.insert(block_keys(tokens, BS), "w0", "llama-8b", 0.0)
    dt = time.process_time() - t0
    print(f"bare insert (keys + insert, 32 blocks/chain)  {blocks / dt / 1e3:7.0f} k blocks/s")


def ingest(payloads: list[bytes], blocks: int, keyed: bool = True) -> float:
    """CPU seconds to apply `payloads` to a fresh mirror, as the subscriber does (`keyed`
    False: the mirror's common case in Python too)."""
    mirror = WorkerMirror(UnifiedIndex(), "w0", "llama-8b", block_size=BS, keyed=keyed)
    t0 = time.process_time()
    for seq, payload in enumerate(payloads):
        mirror.apply(seq, decode_for_ingest(payload), 0.0)
    dt = time.process_time() - t0
    assert mirror.stats().blocks_stored == blocks
    return dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    workers = [f"worker-{i}" for i in range(args.workers)]
    print(f"native block keys: {has_native()}")

    gc.collect()
    tracemalloc.start()
    index = UnifiedIndex()
    t0 = time.perf_counter()
    convs = build(index, args.blocks, workers, rng)
    build_s = time.perf_counter() - t0
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stats = index.stats()
    print(
        f"index: {stats.blocks:,} blocks, {stats.residencies:,} block-residencies over "
        f"{args.workers} workers, built in {build_s:.1f} s"
    )
    print(
        f"memory: {used / 2**20:.0f} MiB, {used / stats.blocks:.0f} bytes per block, "
        f"{used / stats.residencies:.0f} bytes per block-residency"
    )
    pauses = timeit.repeat(gc.collect, number=1, repeat=3)  # what a process holding it pays
    print(
        f"full garbage collection with the index: {min(pauses) * 1e3:.1f} ms "
        f"({len(gc.get_objects()):,} objects tracked)"
    )
    bench_match(index, convs, rng)
    bench_ingest()


if __name__ == "__main__":
    main()
