"""The emulated engine's host tier (docs/tiers.md): GPU evictions demoted, promoted back at
admission and counted in cached_tokens, the copy on the critical path of the first chunk's
step, invalidation reaching the host, and KV events that keep the mirror equal to both tiers
after every step. The integrity check (both tiers) runs after every step."""

from __future__ import annotations

import random

import pytest

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request, StepResult
from core.blocks import salt_scope
from core.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, EventBatch
from router.index import UnifiedIndex, host_group
from router.kv_mirror import WorkerMirror
from tests.backends.test_emulated_engine import BASE, BS, TPS, config, drive, prompt

COPY = 100_000.0  # host -> GPU tokens/s


def tiered(**kw: object) -> EngineConfig:
    return config(host_copy_tokens_per_s=COPY, **kw)


def evict_then_return(host_tokens: int) -> tuple[EmulatedEngine, Request]:
    """`a` caches a 1000-token prompt (62 blocks), `b` evicts 55 of them, `c` asks for `a`'s
    prompt again; returns the engine and `c`."""
    engine = EmulatedEngine(tiered(capacity_tokens=70 * BS, host_capacity_tokens=host_tokens))
    p = prompt(1000, 1)
    a = Request("a", p, 4, arrival=0.0)
    b = Request("b", prompt(1000, 2), 4, arrival=1.0)
    c = Request("c", p, 4, arrival=2.0)
    drive(engine, [a, b, c])
    return engine, c


def test_a_demoted_prefix_is_promoted_counted_and_its_copy_is_on_the_critical_path() -> None:
    engine, c = evict_then_return(200 * BS)
    assert c.cached_tokens == 62 * BS and c.host_tokens == 55 * BS  # 7 blocks stayed on GPU
    assert engine.host_hit_tokens == 55 * BS and engine.cached_tokens == 62 * BS
    ttft = c.first_token_time - c.arrival  # type: ignore[operator]
    assert ttft == pytest.approx(BASE + (1000 - 62 * BS) / TPS + 55 * BS / COPY, abs=1e-12)
    assert engine.host is not None and engine.host.stats().promoted_blocks == 55
    assert engine.host.stats().demoted_blocks >= 55 + 55  # a's, then b's for c's promotion


def test_without_a_tier_the_evicted_prefix_is_recomputed() -> None:
    engine = EmulatedEngine(tiered(capacity_tokens=70 * BS))
    p = prompt(1000, 1)
    reqs = [Request("a", p, 4), Request("b", prompt(1000, 2), 4, arrival=1.0)]
    c = Request("c", p, 4, arrival=2.0)
    drive(engine, [*reqs, c])
    assert engine.host is None and c.cached_tokens == 7 * BS and c.host_tokens == 0
    ttft = c.first_token_time - c.arrival  # type: ignore[operator]
    assert ttft == pytest.approx(BASE + (1000 - 7 * BS) / TPS, abs=1e-12)


def test_the_copy_is_charged_to_the_step_of_the_first_chunk_only() -> None:
    engine = EmulatedEngine(
        tiered(capacity_tokens=70 * BS, host_capacity_tokens=200 * BS, chunk_tokens=64)
    )
    p = prompt(1000, 1)
    reqs = [Request("a", p, 4), Request("b", prompt(1000, 2), 4, arrival=10.0)]
    c = Request("c", p, 4, arrival=20.0)
    drive(engine, [*reqs, c])
    assert c.host_tokens == 55 * BS
    ttft = c.first_token_time - c.arrival  # type: ignore[operator]
    # one chunk of the 8 uncached tokens: one step, with the copy
    assert ttft == pytest.approx(BASE + 8 / TPS + 55 * BS / COPY, abs=1e-12)


def test_invalidation_reaches_the_host_tier() -> None:
    engine = EmulatedEngine(tiered(capacity_tokens=70 * BS, host_capacity_tokens=200 * BS))
    secret = Request("s", prompt(1000, 1), 4, "t.a")
    other = Request("o", prompt(1000, 2), 4, arrival=1.0)
    drive(engine, [secret, other])
    host = engine.host
    assert host is not None and len(host.keys()) == 55
    engine.drain_events()
    done = engine.invalidate(salt_scope(salt_prefix="t"))
    assert done.freed_blocks == 7 + 55 and not host.keys()
    events = engine.drain_events()
    cpu = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU]
    assert sum(len(e.block_hashes) for e in cpu) == 55
    engine.check()
    again = Request("again", secret.prompt, 4, "t.a", arrival=5.0)
    drive(engine, [again])
    assert again.cached_tokens == 0


def test_kv_events_keep_the_mirror_equal_to_both_tiers_after_every_step() -> None:
    engine = EmulatedEngine(
        tiered(capacity_tokens=64 * BS, host_capacity_tokens=160 * BS, chunk_tokens=256)
    )
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "g", block_size=BS)
    rng = random.Random(21)
    prefixes = [prompt(rng.randrange(0, 500), 100 + i) for i in range(8)]
    reqs = []
    for i in range(300):
        p = prefixes[rng.randrange(8)] + prompt(rng.randrange(1, 200), 1000 + i)
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        reqs.append(Request(i, p, rng.randrange(1, 120), salt, arrival=i // 4 * 0.08))
    seq = 0
    host = engine.host
    assert host is not None

    def apply(t: float, result: StepResult) -> None:
        nonlocal seq
        if result.events:
            mirror.apply(seq, EventBatch(t, result.events), t)
            seq += 1
        held = engine.log.held
        in_flight = {k for e in held if isinstance(e, BlockStored) for k in e.block_hashes}
        assert index.residency("w", "g") == engine.cache.keys() - in_flight, "GPU tier"
        assert index.residency("w", host_group("g")) == host.keys(), "host tier"

    drive(engine, reqs, on_step=apply)
    stats = host.stats()
    assert stats.promoted_blocks > 0 and stats.evicted_blocks > 0
    assert engine.host_hit_tokens > 0 and sum(r.host_tokens for r in reqs) == engine.host_hit_tokens
    assert all(r.host_tokens <= r.cached_tokens for r in reqs)
    assert mirror.stats().skipped_orphans == mirror.stats().skipped_unkeyable == 0


def test_host_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        tiered(host_capacity_tokens=BS - 1)
    with pytest.raises(ValueError):
        tiered(host_capacity_tokens=-BS)
    with pytest.raises(ValueError):
        config(host_copy_tokens_per_s=0.0)
