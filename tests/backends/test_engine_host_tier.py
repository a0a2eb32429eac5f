"""The torch engine's host tier (docs/tiers.md) changes nothing but where K/V comes from: greedy
outputs with the tier on equal those with no cache at all, over randomized shared prefixes and
a GPU pool small enough that blocks are demoted and promoted back; the integrity check of both
tiers runs after every step; the KV events, through the wire format and the gateway's mirror,
rebuild both tiers of every kv_group after every step; invalidation reaches the host tier."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from backends.torch_worker.attention import flashinfer
from backends.torch_worker.engine import EngineConfig, TorchEngine
from backends.torch_worker.loader import LoadedModel, load_model
from backends.torch_worker.model import PRESETS
from backends.torch_worker.request import Request, SamplingParams
from backends.torch_worker.scheduler import PoolState, SchedulerConfig
from core.blocks import salt_scope
from core.kv_events import EventBatch, KVEvent, decode_batch, encode_batch
from router.index import UnifiedIndex, host_group
from router.kv_mirror import WorkerMirror
from router.kv_outcomes import Outcome
from tests.backends.test_engine_correctness import Job, assert_same

torch.set_num_threads(2)
CPU = torch.device("cpu")
WORKER = "torch-0"
# tiny with a head size FlashInfer's kernels take
PRESETS.setdefault("tiny-hd64", replace(PRESETS["tiny"], hidden_size=128, head_dim=64))


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", device=CPU)


@pytest.fixture(scope="module")
def tiny_b() -> LoadedModel:
    return load_model("tiny", device=CPU, seed=1)


def workload(seed: int, n: int, models: tuple[str, ...] = ("m",)) -> list[Job]:
    """More shared prefixes than the GPU pool holds, each revisited: one arrival every other
    step, so prefixes go cold on the GPU (demoted) between their visits (promoted)."""
    rng = random.Random(seed)
    bases = [[rng.randrange(256) for _ in range(rng.randrange(40, 100))] for _ in range(8)]
    jobs = []
    for i in range(n):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(17, len(base))]
        prompt += [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
        salt = "t.a" if rng.random() < 0.2 else None
        jobs.append(Job(2 * i, rng.choice(models), prompt, rng.randrange(1, 10), salt))
    return jobs


class Mirrored:
    """The gateway's view of an engine: one mirror per kv_group, fed every step's events
    through the wire format."""

    def __init__(self, engine: TorchEngine) -> None:
        self.index = UnifiedIndex()
        index = self.index
        self.mirrors = {g: WorkerMirror(index, WORKER, g, block_size=16) for g in engine.models}
        self.seqs = dict.fromkeys(self.mirrors, 0)

    def apply(self, events: dict[str, list[KVEvent]], now: float) -> None:
        for group, batch in events.items():
            wire = encode_batch(EventBatch(now, batch), array_like=False)
            outcome = self.mirrors[group].apply(self.seqs[group], decode_batch(wire), now=now)
            assert outcome.outcome is Outcome.OK
            self.seqs[group] += 1

    def assert_equal(self, pool: PoolState) -> None:
        assert pool.host is not None
        for group in self.mirrors:
            assert self.index.residency(WORKER, group) == pool.cache.keys(group), group
            held = self.index.residency(WORKER, host_group(group))
            assert held == pool.host.keys(group), group


def run(
    served: dict[str, LoadedModel],
    jobs: list[Job],
    num_pages: int,
    host_tokens: int | None,
    attention: str = "torch",
) -> tuple[list[Request], TorchEngine]:
    """`host_tokens` None: no prefix cache at all (the baseline)."""
    scheduler = SchedulerConfig(chunk_size=32, max_running=6, prefix_cache=host_tokens is not None)
    config = EngineConfig(
        num_pages=num_pages,
        host_capacity_tokens=host_tokens or 0,
        attention=attention,
        record_logits=True,
        scheduler=scheduler,
    )
    engine = TorchEngine(served, config)
    pool = next(iter(engine.pools.values()))
    for kv in [pool.memory.kv] + ([pool.host_memory.kv] if pool.host_memory else []):
        kv.normal_(0.0, 1e4, generator=torch.Generator(kv.device).manual_seed(0))  # stale K/V
    view = Mirrored(engine)
    reqs = [
        engine.new_request(j.model, j.prompt, SamplingParams(j.max_tokens, ignore_eos=True), j.salt)
        for j in jobs
    ]
    step = 0
    while step <= jobs[-1].at_step or engine.has_work():
        for job, req in zip(jobs, reqs, strict=True):
            if job.at_step == step:
                engine.submit(req)
        result = engine.step()
        engine.check()  # both tiers: free + cached + in use == total
        if pool.host is not None:
            view.apply(result.events, float(step))
            view.assert_equal(pool)
        step += 1
        assert step < 5000, "no progress"
    return reqs, engine


def test_greedy_output_is_identical_with_the_host_tier_on_and_off(tiny: LoadedModel) -> None:
    jobs = workload(seed=7, n=40)
    baseline, _ = run({"m": tiny}, jobs, num_pages=400, host_tokens=None)  # no cache at all
    tiered, engine = run({"m": tiny}, jobs, num_pages=16, host_tokens=3200)
    assert_same(tiered, baseline)
    pool = next(iter(engine.pools.values()))
    assert pool.host is not None and pool.host_memory is not None
    stats = pool.host.stats()
    assert stats.demoted_blocks > 0 and stats.promoted_blocks > 0, stats
    assert sum(r.host_hit_tokens for r in tiered) == stats.promoted_blocks * 16 > 0
    assert pool.host_memory.copied_in_pages == stats.promoted_blocks
    assert stats.pinned_tokens == 0


def test_a_small_host_tier_evicts_and_stays_exact(tiny: LoadedModel, tiny_b: LoadedModel) -> None:
    """Two models in one pool and one host tier smaller than their prefixes: the host LRU
    drops blocks too, and each model's promotions hold its own K/V only."""
    jobs = workload(seed=4, n=40, models=("a", "b"))
    alone_a, _ = run({"a": tiny}, [j for j in jobs if j.model == "a"], 400, None)
    alone_b, _ = run({"b": tiny_b}, [j for j in jobs if j.model == "b"], 400, None)
    shared, engine = run({"a": tiny, "b": tiny_b}, jobs, num_pages=16, host_tokens=160)
    assert_same([r for r in shared if r.model == "a"], alone_a)
    assert_same([r for r in shared if r.model == "b"], alone_b)
    pool = next(iter(engine.pools.values()))
    assert pool.host is not None
    stats = pool.host.stats()
    assert stats.evicted_blocks > 0 and stats.promoted_blocks > 0, stats


def finish(engine: TorchEngine, prompt: list[int], salt: str | None = None) -> Request:
    req = engine.new_request("m", prompt, SamplingParams(2, ignore_eos=True), salt)
    engine.submit(req)
    while engine.has_work():
        engine.step()
        engine.check()
    return req


def test_a_demoted_prefix_is_promoted_and_invalidation_reaches_the_host(tiny: LoadedModel) -> None:
    engine = TorchEngine({"m": tiny}, EngineConfig(num_pages=6, host_capacity_tokens=640))
    pool = next(iter(engine.pools.values()))
    assert pool.host is not None
    secret, other = list(range(60, 124)), list(range(130, 194))  # 4 blocks each
    first = finish(engine, secret + [1], "t.a")
    finish(engine, other + [2])  # the GPU holds 5 pages: the secret's go to the host
    again = finish(engine, secret + [3], "t.a")
    assert (first.cached_tokens, again.cached_tokens, again.host_hit_tokens) == (0, 64, 64)
    finish(engine, other + [4])  # demoted again
    done, events = engine.invalidate(salt_scope(salt_prefix="t"))
    assert done.freed_blocks >= 4
    assert finish(engine, secret + [5], "t.a").cached_tokens == 0
    assert finish(engine, other + [6]).cached_tokens == 64  # unsalted: untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("attention", "dtype"), [("torch", "float32"), ("flashinfer", "float16")])
def test_the_pinned_host_tier_on_cuda(attention: str, dtype: str) -> None:
    """On CUDA, the host pool pinned: outputs with the tier equal outputs without any cache
    (logits to 1e-4 in float32; FlashInfer runs in half precision, outputs only)."""
    if attention == "flashinfer" and flashinfer is None:
        pytest.skip("flashinfer is not installed")
    gpu = load_model("tiny-hd64", device=torch.device("cuda"), dtype=dtype)
    jobs = workload(seed=7, n=40)
    baseline, _ = run({"m": gpu}, jobs, num_pages=400, host_tokens=None, attention=attention)
    tiered, engine = run({"m": gpu}, jobs, num_pages=16, host_tokens=3200, attention=attention)
    if dtype == "float32":
        assert_same(tiered, baseline)
    else:
        assert [r.output for r in tiered] == [r.output for r in baseline]
    pool = next(iter(engine.pools.values()))
    assert pool.host is not None and pool.host_memory is not None
    assert pool.host_memory.kv.is_pinned() and pool.host.stats().promoted_blocks > 0
