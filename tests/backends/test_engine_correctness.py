"""The prefix cache changes nothing but speed: greedy decoding with it on produces exactly the
tokens it produces with it off, and logits within 1e-4, over randomized prompts that share
prefixes, batches that mix prefills and decodes, several chunk sizes, and pools small enough
to force evictions and preemptions. Models with the same layout share a pool but never a page;
aliases of one model share pages. The integrity check runs after every step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from backends.torch_worker.engine import EngineConfig, TorchEngine
from backends.torch_worker.loader import LoadedModel, load_model
from backends.torch_worker.request import Request, SamplingParams
from backends.torch_worker.scheduler import SchedulerConfig

torch.set_num_threads(2)
CPU = torch.device("cpu")


@dataclass(slots=True)
class Job:
    at_step: int  # submitted before this step
    model: str
    prompt: list[int]
    max_tokens: int
    salt: str | None = None


def workload(seed: int, n: int, models: tuple[str, ...] = ("m",)) -> list[Job]:
    """Prompts over a few shared prefixes (some salted), arriving over the first steps."""
    rng = random.Random(seed)
    bases = [[rng.randrange(256) for _ in range(rng.randrange(40, 140))] for _ in range(3)]
    jobs = []
    for i in range(n):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(1, len(base))] + [
            rng.randrange(256) for _ in range(rng.randrange(1, 40))
        ]
        salt = "tenant" if rng.random() < 0.2 else None
        jobs.append(
            Job(i // 3 * 2, rng.choice(models), prompt, rng.randrange(1, 24), salt)
        )  # three per arrival, every other step
    return jobs


def run(
    served: dict[str, LoadedModel], jobs: list[Job], num_pages: int, chunk: int, cache: bool
) -> tuple[list[Request], TorchEngine]:
    scheduler = SchedulerConfig(chunk_size=chunk, max_running=6, prefix_cache=cache)
    engine = TorchEngine(
        served, EngineConfig(num_pages=num_pages, record_logits=True, scheduler=scheduler)
    )
    for pool in engine.pools.values():  # stale K/V: what no masked-out slot may ever leak
        kv = pool.memory.kv
        kv.normal_(0.0, 1e4, generator=torch.Generator(kv.device).manual_seed(0))
    reqs = [
        engine.new_request(j.model, j.prompt, SamplingParams(j.max_tokens, ignore_eos=True), j.salt)
        for j in jobs
    ]
    step = 0
    while step <= jobs[-1].at_step or engine.has_work():
        for job, req in zip(jobs, reqs, strict=True):
            if job.at_step == step:
                engine.submit(req)
        engine.step()
        engine.check()
        step += 1
        assert step < 5000, "no progress"
    return reqs, engine


def assert_same(got: list[Request], want: list[Request]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.output == b.output, (a.rid, a.prompt[:8])
        assert a.logits is not None and b.logits is not None
        diff = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits, strict=True))
        assert diff < 1e-4, (a.rid, diff)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", device=CPU)


@pytest.fixture(scope="module")
def tiny_b() -> LoadedModel:
    return load_model("tiny", device=CPU, seed=1)  # the same layout, other weights


@pytest.mark.parametrize(
    ("chunk", "pages"),
    [(4096, 400), (7, 400), (32, 26), (64, 18)],
    ids=["one-chunk", "tiny-chunks", "evictions", "preemptions"],
)
def test_greedy_output_is_identical_with_the_cache_on_and_off(
    tiny: LoadedModel, chunk: int, pages: int
) -> None:
    jobs = workload(seed=chunk, n=18)
    baseline, _ = run({"m": tiny}, jobs, num_pages=400, chunk=4096, cache=False)
    cached, engine = run({"m": tiny}, jobs, num_pages=pages, chunk=chunk, cache=True)
    assert_same(cached, baseline)
    stats = next(iter(engine.pools.values())).cache.stats()
    assert sum(r.cached_tokens for r in cached) > 0, "the cache was never hit"
    if pages < 30:
        assert stats.evicted_blocks > 0, "the pool never ran short"
    if pages < 20:
        assert sum(r.preemptions for r in cached) > 0, "nothing was preempted"
    assert stats.protected_tokens == stats.allocated_tokens == 0  # everything finished let go
    assert all(torch.isfinite(p.memory.kv).all() for p in engine.pools.values())


def test_cached_tokens_are_what_a_repeat_finds(tiny: LoadedModel) -> None:
    engine = TorchEngine({"m": tiny}, EngineConfig(num_pages=100))
    prompt = list(range(50))
    for expected in (0, 48):  # 50 tokens: 3 full blocks of the first 49 are reusable
        req = engine.new_request("m", prompt, SamplingParams(3, ignore_eos=True))
        engine.submit(req)
        while engine.has_work():
            engine.step()
        assert req.cached_tokens == expected
    salted = engine.new_request("m", prompt, SamplingParams(3, ignore_eos=True), "tenant")
    engine.submit(salted)
    while engine.has_work():
        engine.step()
    assert salted.cached_tokens == 0


def finish(engine: TorchEngine, model: str, prompt: list[int], n: int = 4) -> Request:
    req = engine.new_request(model, prompt, SamplingParams(n, ignore_eos=True))
    engine.submit(req)
    while engine.has_work():
        engine.step()
        engine.check()  # includes: every page on a request's path is in its own group's tree
    return req


def test_two_models_share_a_pool_but_never_a_page(tiny: LoadedModel, tiny_b: LoadedModel) -> None:
    assert tiny.layout == tiny_b.layout and tiny.kv_group != tiny_b.kv_group
    jobs = workload(seed=3, n=18, models=("a", "b"))
    alone_a, _ = run({"a": tiny}, [j for j in jobs if j.model == "a"], 400, 4096, False)
    alone_b, _ = run({"b": tiny_b}, [j for j in jobs if j.model == "b"], 400, 4096, False)
    shared, engine = run({"a": tiny, "b": tiny_b}, jobs, num_pages=30, chunk=32, cache=True)
    assert len(engine.pools) == 1  # one pool, each model's share following its traffic
    assert_same([r for r in shared if r.model == "a"], alone_a)
    assert_same([r for r in shared if r.model == "b"], alone_b)

    prompt = list(range(100, 180))
    assert finish(engine, "a", prompt).cached_tokens == 0
    assert finish(engine, "b", prompt).cached_tokens == 0  # a's pages hold a's K/V only
    assert finish(engine, "b", prompt).cached_tokens == 64
    assert finish(engine, "a", prompt).cached_tokens == 64
    cache = next(iter(engine.pools.values())).cache
    a_keys, b_keys = cache.keys(tiny.kv_group), cache.keys(tiny_b.kv_group)
    assert a_keys & b_keys  # the same token blocks, cached twice: once per model


def test_aliases_of_one_model_share_pages(tiny: LoadedModel) -> None:
    engine = TorchEngine({"x": tiny, "y": tiny}, EngineConfig(num_pages=100))
    assert len(engine.models) == 1  # one set of weights, one batch, one tree
    prompt = list(range(40, 90))
    x = finish(engine, "x", prompt)
    y = finish(engine, "y", prompt)
    assert (x.cached_tokens, y.cached_tokens) == (0, 48) and x.output == y.output


def test_a_model_with_another_layout_gets_its_own_pool(tiny: LoadedModel) -> None:
    half = load_model("tiny", device=CPU, dtype="bfloat16")  # half the bytes per page
    engine = TorchEngine({"f32": tiny, "bf16": half}, EngineConfig(kv_cache_mb=1.0))
    capacities = sorted(p.memory.capacity for p in engine.pools.values())
    assert capacities == [2**19 // 8192 - 1, 2**19 // 4096 - 1]  # the budget split in two
    assert finish(engine, "f32", list(range(60))).output
    assert finish(engine, "bf16", list(range(60))).output


def first_token_steps(tiny: LoadedModel, chunk: int, max_running: int, urgent: int) -> list[int]:
    """The step of each request's first token: six 40-token prompts, then (after one step) a
    10-token one of priority `urgent`, last in the list. Greedy outputs as when alone."""
    scheduler = SchedulerConfig(chunk_size=chunk, max_running=max_running, prefix_cache=False)
    engine = TorchEngine({"m": tiny}, EngineConfig(num_pages=200, scheduler=scheduler))
    prompts = [[(7 * i + j) % 256 for j in range(40)] for i in range(6)] + [list(range(10))]
    reqs = [engine.new_request("m", p, SamplingParams(6, ignore_eos=True)) for p in prompts]
    reqs[-1].priority = urgent
    first: dict[int, int] = {}
    for step in range(200):
        for req in reqs[:6] if step == 0 else reqs[6:] if step == 1 else []:
            engine.submit(req)
        for req in engine.step().emitted:
            first.setdefault(req.rid, step)
        engine.check()
        if not engine.has_work():
            break
    for req in reqs:
        assert req.output == finish(TorchEngine({"m": tiny}), "m", req.prompt, 6).output
    return [first[r.rid] for r in reqs]


def test_a_better_priority_request_is_admitted_and_prefilled_first(tiny: LoadedModel) -> None:
    # one at a time: it takes the place the running one frees, before the five queued
    fifo = first_token_steps(tiny, chunk=4096, max_running=1, urgent=0)
    ranked = first_token_steps(tiny, chunk=4096, max_running=1, urgent=-1)
    assert fifo[-1] > max(fifo[:6])
    assert ranked[0] == fifo[0] < ranked[-1] < min(ranked[1:6])  # the running one kept on
    # all six prefilling in 16-token chunks: its 10 tokens lead the next step's budget
    fifo = first_token_steps(tiny, chunk=16, max_running=8, urgent=0)
    ranked = first_token_steps(tiny, chunk=16, max_running=8, urgent=-1)
    assert fifo[-1] > max(fifo[:6])
    assert ranked[-1] == 1


def test_the_step_budget_caps_worse_ranked_prefill_while_a_better_one_runs(
    tiny: LoadedModel,
) -> None:
    scheduler = SchedulerConfig(chunk_size=512, protect_tokens=8, prefix_cache=False)
    engine = TorchEngine({"m": tiny}, EngineConfig(num_pages=200, scheduler=scheduler))
    urgent = engine.new_request("m", list(range(10)), SamplingParams(6, ignore_eos=True))
    urgent.priority = -1
    backlog = engine.new_request(
        "m", [3 * j % 256 for j in range(100)], SamplingParams(2, ignore_eos=True)
    )
    engine.submit(urgent)
    engine.submit(backlog)
    steps: list[tuple[int, bool]] = []  # the backlog's prefill in each step, urgent running
    while engine.has_work():
        before, running = backlog.computed, not urgent.done
        engine.step()
        engine.check()
        steps.append((backlog.computed - before, running))
    # 8 tokens a step while the urgent one prefills and decodes, then the rest at once
    assert [n for n, running in steps if running] == [8] * 6
    assert steps[6][0] == 100 - 6 * 8 and urgent.output and backlog.output
    assert backlog.output == finish(TorchEngine({"m": tiny}), "m", backlog.prompt, 2).output


def test_a_protect_hint_caps_prefill_before_the_better_rank_arrives(tiny: LoadedModel) -> None:
    # the gateway's x-urc-protect: a better rank (0) is active in the pool, not on this worker
    scheduler = SchedulerConfig(chunk_size=512, protect_tokens=8, prefix_cache=False)
    engine = TorchEngine({"m": tiny}, EngineConfig(num_pages=200, scheduler=scheduler))
    backlog = engine.new_request("m", [5 * j % 256 for j in range(40)], SamplingParams(2))
    backlog.priority, backlog.protect = 1, 0
    engine.submit(backlog)
    steps: list[int] = []
    while engine.has_work():
        before = backlog.computed
        engine.step()
        engine.check()
        steps.append(backlog.computed - before)
    assert steps[:5] == [8] * 5 and backlog.output  # 8 tokens a step, as if one were here


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cache_on_and_off_agree_on_cuda() -> None:
    gpu = load_model("tiny", device=torch.device("cuda"), dtype="float32")
    jobs = workload(seed=5, n=18)
    baseline, _ = run({"m": gpu}, jobs, num_pages=400, chunk=4096, cache=False)
    cached, _ = run({"m": gpu}, jobs, num_pages=26, chunk=32, cache=True)
    assert_same(cached, baseline)
