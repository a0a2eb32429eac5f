"""The engine's KV events rebuild its cache in the gateway's index: a randomized workload over
two models in one pool (one event stream per kv_group), salts, and a pool small enough to
evict, every batch encoded and decoded in the wire format and applied by the gateway's own
WorkerMirror; after every step the index holds, per kv_group, exactly the worker's tree."""

from __future__ import annotations

import random

import torch

from backends.torch_worker.engine import EngineConfig, TorchEngine
from backends.torch_worker.loader import load_model
from backends.torch_worker.request import SamplingParams
from backends.torch_worker.scheduler import SchedulerConfig
from core.blocks import block_keys
from core.kv_events import EventBatch, decode_batch, encode_batch
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.kv_outcomes import Outcome

torch.set_num_threads(2)
CPU = torch.device("cpu")
WORKER = "torch-0"


def test_events_rebuild_each_kv_group_exactly() -> None:
    a = load_model("tiny", device=CPU)
    b = load_model("tiny", device=CPU, seed=1)
    scheduler = SchedulerConfig(chunk_size=48, max_running=5)
    engine = TorchEngine({"a": a, "b": b}, EngineConfig(num_pages=40, scheduler=scheduler))
    index = UnifiedIndex()
    mirrors = {m.kv_group: WorkerMirror(index, WORKER, m.kv_group, block_size=16) for m in (a, b)}
    seqs = dict.fromkeys(mirrors, 0)
    rng = random.Random(11)
    bases = [[rng.randrange(256) for _ in range(90)] for _ in range(3)]
    submitted = 0
    cache = next(iter(engine.pools.values())).cache
    for step in range(400):
        if submitted < 40 and rng.random() < 0.5:
            prompt = rng.choice(bases)[: rng.randrange(5, 90)] + [rng.randrange(256)] * 5
            salt = rng.choice([None, None, "t1", "t2"])
            params = SamplingParams(rng.randrange(1, 30), ignore_eos=True)
            engine.submit(engine.new_request(rng.choice("ab"), prompt, params, salt))
            submitted += 1
        result = engine.step()
        engine.check()
        for group, events in result.events.items():
            wire = encode_batch(EventBatch(float(step), events), array_like=False)
            outcome = mirrors[group].apply(seqs[group], decode_batch(wire), now=float(step))
            assert outcome.outcome is Outcome.OK
            seqs[group] += 1
        for group in mirrors:
            assert index.residency(WORKER, group) == cache.keys(group), (step, group)
        if submitted == 40 and not engine.has_work():
            break
    assert not engine.has_work()
    assert cache.evicted_blocks > 0 and all(index.residency(WORKER, g) for g in mirrors)
    for mirror in mirrors.values():
        stats = mirror.stats()
        assert stats.skipped_orphans == stats.skipped_unkeyable == 0
    # what the gateway would key for a new prompt matches what the worker would reuse
    prompt = bases[0][:80]
    keys = block_keys(prompt, 16)
    matched = cache.match(keys, len(keys), a.kv_group, prompt).blocks
    assert index.match(keys, a.kv_group).get(WORKER, 0) == matched
