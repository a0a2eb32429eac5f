"""The emulated engine in virtual time: the time model (prefill of uncached tokens only, chunks,
decode steps that grow with the batch), continuous batching, the batch limit, capacity
pressure, skipping over decode stretches, and KV events that rebuild exactly its cache in the
gateway's mirror. The integrity check runs after every step."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request, State, StepResult, output_tokens
from core.blocks import block_keys
from core.kv_events import BlockRemoved, BlockStored, EventBatch
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror

BS = 16
BASE = 0.01
PER_REQ = 0.001
TPS = 10_000.0


def config(**kw: object) -> EngineConfig:
    defaults: dict[str, object] = {
        "block_size": BS,
        "decode_base_s": BASE,
        "decode_per_request_s": PER_REQ,
        "prefill_tokens_per_s": TPS,
        "capacity_tokens": 100_000,
    }
    defaults.update(kw)
    return EngineConfig(**defaults)  # type: ignore[arg-type]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def drive(
    engine: EmulatedEngine,
    reqs: list[Request],
    *,
    fine: bool = False,
    on_step: Callable[[float, StepResult], None] | None = None,
    max_calls: int = 1_000_000,
) -> int:
    """Submit each request at its arrival and step at `next_time` (or every step boundary when
    `fine`), checking integrity after every step. Returns the number of step calls."""
    pending = sorted(reqs, key=lambda r: r.arrival)
    i = calls = 0
    while True:
        t = engine.next_step_time() if fine else engine.next_time()
        if i < len(pending) and (t is None or pending[i].arrival <= t):
            engine.submit(pending[i])
            i += 1
            continue
        if t is None:
            return calls
        result = engine.step(t)
        engine.check()
        calls += 1
        if on_step is not None:
            on_step(t, result)
        assert calls < max_calls, "no progress"


def test_a_cached_prefix_shortens_ttft_by_exactly_its_prefill_time() -> None:
    engine = EmulatedEngine(config())
    p = prompt(1000, 1)
    a = Request("a", p, 4, arrival=0.0)
    b = Request("b", p, 4, arrival=10.0)
    drive(engine, [a, b])
    assert a.cached_tokens == 0 and b.cached_tokens == 62 * BS  # 1000 // 16 full blocks
    ttft_a = a.first_token_time - a.arrival  # type: ignore[operator]
    ttft_b = b.first_token_time - b.arrival  # type: ignore[operator]
    assert ttft_a == pytest.approx(BASE + 1000 / TPS, abs=1e-12)
    assert ttft_a - ttft_b == pytest.approx(b.cached_tokens / TPS, abs=1e-12)


def test_a_fully_cached_prompt_still_computes_one_token() -> None:
    engine = EmulatedEngine(config())
    p = prompt(4 * BS, 2)
    a, b = Request("a", p, 2, arrival=0.0), Request("b", p, 2, arrival=5.0)
    drive(engine, [a, b])
    assert b.cached_tokens == 3 * BS
    assert b.first_token_time - b.arrival == pytest.approx(BASE + BS / TPS, abs=1e-12)  # type: ignore[operator]


def test_chunked_prefill_caches_each_chunk_as_it_is_scheduled() -> None:
    engine = EmulatedEngine(config(chunk_tokens=1024))
    p = prompt(3000, 3)
    a = Request("a", p, 2, arrival=0.0)
    seen: list[int] = []
    drive(engine, [a], fine=True, on_step=lambda t, r: seen.append(len(engine.cache)))
    assert a.first_token_time == pytest.approx(3 * BASE + 3000 / TPS, abs=1e-12)
    assert seen[:3] == [64, 128, 187]  # blocks cached as each chunk is planned (3000 // 16)
    # arriving during a's second chunk, it is admitted when that chunk ends, after a's third
    # is scheduled: it matches all of it and computes its last 8 tokens in the same step
    b = Request("b", p, 2, arrival=0.0)
    late = Request("late", p, 2, arrival=BASE + 1024 / TPS + 0.01)
    drive(EmulatedEngine(config(chunk_tokens=1024)), [b, late])
    assert late.admitted_time == pytest.approx(2 * BASE + 2048 / TPS, abs=1e-12)
    assert late.cached_tokens == 187 * BS
    assert late.first_token_time == b.first_token_time
    assert b.first_token_time == pytest.approx(3 * BASE + (3000 + 8) / TPS, abs=1e-12)


def test_requests_sharing_a_prefix_in_one_step_compute_it_once() -> None:
    # vLLM caches a chunk's blocks when it schedules it: requests admitted after it in the
    # same step reuse them (each layer writes its KV before attention reads it)
    engine = EmulatedEngine(config())
    shared = prompt(320, 40)  # 20 blocks
    reqs = [Request(i, shared + prompt(50, 41 + i), 3, arrival=0.0) for i in range(4)]
    events: list[StepResult] = []
    drive(engine, reqs, on_step=lambda t, r: events.append(r))
    assert [r.cached_tokens for r in reqs] == [0, 320, 320, 320]
    step = BASE + (370 + 3 * 50) / TPS  # one forward pass: the prefix once, four tails
    assert all(r.first_token_time == pytest.approx(step, abs=1e-12) for r in reqs)
    assert engine.prompt_tokens == 4 * 370 and engine.cached_tokens == 3 * 320
    # the prefix is announced once, when the step that computes it ends
    stored = [e for r in events for e in r.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored[:4]] == [23, 3, 3, 3]
    assert not events[0].events and events[1].events[:4] == stored[:4]


def test_a_chunk_is_matchable_at_once_but_announced_when_its_step_ends() -> None:
    engine = EmulatedEngine(config(chunk_tokens=256))
    a = Request("a", prompt(600, 50), 2, arrival=0.0)
    engine.submit(a)
    first = engine.step(0.0)  # plans a's first chunk
    engine.check()
    assert len(engine.cache) == 16 and not first.events  # cached, not yet announced
    second = engine.step(engine.next_time())  # type: ignore[arg-type]
    engine.check()
    announced = [e for e in second.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in announced] == [16]  # the first chunk's, not the second's
    assert len(engine.cache) == 32
    # an invalidation in the middle of a step announces the step's blocks first
    engine.invalidate(None)
    drained = engine.drain_events()
    assert [type(e) for e in drained] == [BlockStored, BlockRemoved]
    assert set(drained[1].block_hashes) == {*announced[0].block_hashes, *drained[0].block_hashes}
    drive(engine, [])
    assert a.state is State.FINISHED and engine.cache.allocated_tokens == 0


def test_decode_steps_grow_with_the_batch() -> None:
    def inter_token(n: int) -> float:
        engine = EmulatedEngine(config())
        reqs = [Request(i, prompt(40, 10 + i), 11, arrival=0.0) for i in range(n)]
        drive(engine, reqs)
        assert len({r.first_token_time for r in reqs}) == 1  # one prefill step for all
        r = reqs[0]
        return (r.finish_time - r.first_token_time) / 10  # type: ignore[operator]

    assert inter_token(1) == pytest.approx(BASE + PER_REQ, abs=1e-12)
    assert inter_token(8) == pytest.approx(BASE + 8 * PER_REQ, abs=1e-12)
    assert inter_token(32) == pytest.approx(BASE + 32 * PER_REQ, abs=1e-12)


def test_continuous_batching_admits_a_request_at_the_next_step_boundary() -> None:
    engine = EmulatedEngine(config())
    a = Request("a", prompt(100, 4), 100, arrival=0.0)
    b = Request("b", prompt(50, 5), 5, arrival=0.0555)
    drive(engine, [a, b])
    t1 = BASE + 100 / TPS  # a's first token
    d1 = BASE + PER_REQ  # a decoding alone
    j = math.ceil((b.arrival - t1) / d1)
    assert b.admitted_time == pytest.approx(t1 + j * d1, abs=1e-12)
    assert b.first_token_time == pytest.approx(
        b.admitted_time + BASE + PER_REQ + 50 / TPS,  # type: ignore[operator]
        abs=1e-12,
    )
    assert b.finish_time < a.finish_time  # type: ignore[operator]
    assert a.finish_time > t1 + 99 * d1  # type: ignore[operator]  # b's steps slowed it down
    assert a.generated == 100 and b.generated == 5


def test_the_batch_never_exceeds_max_batch() -> None:
    engine = EmulatedEngine(config(max_batch=3))
    reqs = [Request(i, prompt(30, 20 + i), 5 + i, arrival=0.0) for i in range(10)]
    peak = 0

    def watch(t: float, result: StepResult) -> None:
        nonlocal peak
        peak = max(peak, engine.load().running)

    drive(engine, reqs, on_step=watch)
    assert peak == 3
    assert all(r.state is State.FINISHED for r in reqs)
    assert reqs[3].admitted_time == reqs[0].finish_time  # a place freed by the first to end


def test_capacity_pressure_makes_requests_wait_and_never_deadlocks() -> None:
    engine = EmulatedEngine(config(capacity_tokens=64 * BS))
    rng = random.Random(7)
    reqs = []
    for i in range(200):
        n = rng.randrange(1, 700)
        reqs.append(Request(i, prompt(n, rng.randrange(30)), rng.randrange(1, 1024 - n + 2)))
        reqs[-1].arrival = i * 0.01
    blocked = 0

    def watch(t: float, result: StepResult) -> None:
        nonlocal blocked
        load = engine.load()
        blocked += load.waiting > 0 and load.running < engine.config.max_batch

    drive(engine, reqs, on_step=watch)
    assert blocked > 0  # memory, not the batch limit, held requests back
    assert all(r.state is State.FINISHED and r.generated == r.max_tokens for r in reqs)
    stats = engine.cache.stats()
    assert stats.allocated_tokens == stats.protected_tokens == 0 and stats.evicted_blocks > 0
    with pytest.raises(ValueError):
        engine.submit(Request("huge", prompt(1000, 1), 100))


def test_skipping_decode_stretches_changes_nothing_but_the_number_of_calls() -> None:
    def workload() -> list[Request]:
        rng = random.Random(11)
        return [
            Request(
                i,
                prompt(rng.randrange(1, 400), rng.randrange(5)),
                rng.randrange(1, 400),
                arrival=rng.random() * 2.0,
            )
            for i in range(60)
        ]

    coarse, fine = workload(), workload()
    emitted: dict[int, int] = {}

    def count(t: float, result: StepResult) -> None:
        for rid, n in result.emitted.items():
            emitted[rid] = emitted.get(rid, 0) + n

    calls_coarse = drive(EmulatedEngine(config(report_tokens=False)), coarse)
    calls_fine = drive(EmulatedEngine(config()), fine, fine=True, on_step=count)
    for c, f in zip(coarse, fine, strict=True):
        assert (c.admitted_time, c.cached_tokens) == (f.admitted_time, f.cached_tokens)
        assert c.first_token_time == pytest.approx(f.first_token_time, abs=1e-9)
        assert c.finish_time == pytest.approx(f.finish_time, abs=1e-9)
        assert emitted[f.rid] == f.max_tokens
    assert calls_coarse * 3 < calls_fine


def test_an_arrival_at_the_boundary_just_streamed_joins_there_as_when_skipping() -> None:
    # stepping every boundary, the loop already stepped the one the arrival rounds to: the cut
    # ends the segment there (not one step later), as when the stretch is skipped
    runs = []
    for fine in (False, True):
        a = Request("a", prompt(32, 1), 10, arrival=0.0)  # first token at 0.75, then 0.25 steps
        b = Request("b", prompt(32, 2), 2, arrival=1.25 + 1e-12)  # float noise past a boundary
        engine = EmulatedEngine(
            config(decode_base_s=0.25, decode_per_request_s=0.0, prefill_tokens_per_s=64.0)
        )
        drive(engine, [a, b], fine=fine)
        runs.append((b.admitted_time, b.first_token_time, a.finish_time))
    assert runs[0] == runs[1]
    assert runs[0][0] == 1.25


def test_outputs_are_exact_and_the_next_turn_reuses_them() -> None:
    engine = EmulatedEngine(config())
    p = prompt(100, 6)
    a = Request("a", p, 40, cache_salt="t1", arrival=0.0)
    drive(engine, [a])
    nxt = p + output_tokens(40) + prompt(30, 7)
    b = Request("b", nxt, 3, cache_salt="t1", arrival=5.0)
    c = Request("c", nxt, 3, cache_salt="t2", arrival=5.0)
    drive(engine, [b, c])
    assert b.cached_tokens == (100 + 39) // BS * BS  # the last output token has no KV
    assert c.cached_tokens == 0  # another tenant's namespace
    assert bytes(output_tokens(9)) == b"The quick"


def test_abort_releases_room_and_locks() -> None:
    engine = EmulatedEngine(config())
    a = Request("a", prompt(200, 8), 1000, arrival=0.0)
    b = Request("b", prompt(10, 9), 1000, arrival=0.0)
    engine.submit(a)
    engine.submit(b)
    engine.step(0.0)
    engine.step(engine.next_time())  # type: ignore[arg-type]  # prefilled, decoding
    now = engine.next_time() / 2  # type: ignore[operator]
    engine.step(now)
    assert engine.abort(a, now)
    engine.check()
    assert engine.load().running == 1
    assert engine.next_time() == pytest.approx(engine.next_step_time())  # cut to this step
    drive(engine, [])
    assert b.state is State.FINISHED and a.state is State.ABORTED
    assert engine.cache.allocated_tokens == 0
    assert not engine.abort(b, 100.0)


def test_kv_events_rebuild_exactly_the_cache_in_the_mirror() -> None:
    engine = EmulatedEngine(config(capacity_tokens=96 * BS, chunk_tokens=256))
    index = UnifiedIndex()
    mirror = WorkerMirror(index, "w", "g", block_size=BS)
    rng = random.Random(13)
    prefixes = [prompt(rng.randrange(0, 500), 100 + i) for i in range(6)]
    reqs = []
    for i in range(300):
        p = prefixes[rng.randrange(6)] + prompt(rng.randrange(1, 200), 1000 + i)
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        # in bursts of 4: requests sharing a prefix are often planned into one step
        reqs.append(Request(i, p, rng.randrange(1, 120), salt, arrival=i // 4 * 0.08))
    seq = 0
    stored = removed = 0

    def apply(t: float, result: StepResult) -> None:
        nonlocal seq, stored, removed
        if result.events:
            stored += sum(type(e).__name__ == "BlockStored" for e in result.events)
            removed += sum(type(e).__name__ == "BlockRemoved" for e in result.events)
            mirror.apply(seq, EventBatch(t, result.events), t)
            seq += 1
        # the blocks the step in flight caches are announced when it ends
        held = engine.log.held
        in_flight = {k for e in held if isinstance(e, BlockStored) for k in e.block_hashes}
        assert index.residency("w", "g") == engine.cache.keys() - in_flight

    drive(engine, reqs, on_step=apply)
    assert index.residency("w", "g") == engine.cache.keys()
    assert stored and removed and engine.cache.stats().evicted_blocks > 0
    assert mirror.stats().skipped_orphans == mirror.stats().skipped_unkeyable == 0
    assert any(r.cache_salt and r.cached_tokens for r in reqs)  # salted roots travel too
    for r in reqs[-30:]:  # the gateway would predict exactly what the worker would reuse
        keys = block_keys(r.prompt, BS, r.cache_salt)
        assert index.match(keys, "g").get("w", 0) == engine.cache.match(keys).blocks


# -- priority (vLLM's `priority`: lower first, ties by arrival; no preemption) ----------------


@pytest.mark.parametrize(("backlog_priority", "urgent_priority"), [(0, -1), (10, 0), (0, 0)])
def test_a_later_better_priority_request_goes_before_the_queued_backlog(
    backlog_priority: int, urgent_priority: int
) -> None:
    engine = EmulatedEngine(config(max_batch=2, chunk_tokens=1024))
    backlog = [
        Request(i, prompt(1500, 50 + i), 30, arrival=0.0, priority=backlog_priority)
        for i in range(8)
    ]
    urgent = Request("urgent", prompt(200, 60), 5, arrival=0.05, priority=urgent_priority)
    drive(engine, [*backlog, urgent])
    order = [r.rid for r in sorted([*backlog, urgent], key=lambda r: r.first_token_time or 0)]
    if urgent_priority < backlog_priority:
        # the two running when it arrived keep their places; it takes the first one freed
        assert order == [0, 1, "urgent", 2, 3, 4, 5, 6, 7]
        assert urgent.admitted_time == backlog[0].finish_time
    else:  # equal priorities: first come, first served
        assert order == [0, 1, 2, 3, 4, 5, 6, 7, "urgent"]


def test_the_chunk_budget_goes_to_the_best_priority_prefill_first() -> None:
    engine = EmulatedEngine(config(chunk_tokens=1024, protect_step_s=0.0))  # no step budget
    backlog = [Request(i, prompt(3000, 70 + i), 4, arrival=0.0) for i in range(4)]
    urgent = Request("urgent", prompt(500, 80), 4, arrival=0.05, priority=-1)
    drive(engine, [*backlog, urgent])
    step = BASE + 1024 / TPS  # every step is a full chunk: nothing decodes yet
    assert all(r.admitted_time == 0.0 for r in backlog)  # none preempted, none held back
    assert urgent.admitted_time == pytest.approx(step, abs=1e-12)  # the next boundary
    # its 500 tokens lead the second step, the backlog's prefill fills the rest
    assert urgent.first_token_time == pytest.approx(2 * step, abs=1e-12)
    assert all(urgent.first_token_time < r.first_token_time for r in backlog)  # type: ignore[operator]


def backlog_prefill(
    engine: EmulatedEngine, reqs: list[Request], backlog: list[Request]
) -> list[tuple[float, int]]:
    """(the time of each step boundary, the backlog's prefill tokens computed in the step that
    ended there), driving `reqs` step by step."""
    steps: list[tuple[float, int]] = []
    done = [0]

    def on_step(t: float, _: StepResult) -> None:
        computed = sum(r.computed - r.cached_tokens for r in backlog)
        steps.append((t, computed - done[0]))
        done[0] = computed

    drive(engine, reqs, fine=True, on_step=on_step)
    return steps


def test_the_step_budget_caps_worse_ranked_prefill_while_a_better_one_is_here() -> None:
    # 5 ms of prefill at 10k tokens/s: 50 tokens a step for the backlog while protected
    cfg = config(chunk_tokens=1024, protect_step_s=0.005, protect_window_s=0.1)
    assert cfg.protect_tokens() == 50
    engine = EmulatedEngine(cfg)
    backlog = [Request(i, prompt(4000, 100 + i), 4, arrival=0.0, priority=1) for i in range(3)]
    urgent = Request("urgent", prompt(300, 110), 20, arrival=0.05, priority=0)
    steps = backlog_prefill(engine, [*backlog, urgent], backlog)
    assert steps[1][1] == 1024  # alone, the backlog runs full chunks
    first, finish = urgent.first_token_time, urgent.finish_time
    assert first is not None and finish is not None
    admitted = urgent.admitted_time
    protected = [n for t, n in steps if admitted is not None and admitted < t <= finish + 0.1]
    # its own prefill is not capped: it leads the step after its arrival, 50 of backlog beside
    assert first == pytest.approx(admitted + BASE + (300 + 50) / TPS, abs=1e-9)
    # each step while it decodes, and in the window after it, carries 50 backlog tokens
    assert len(protected) >= 20 and set(protected) == {50}
    after = [n for t, n in steps if t > finish + 0.1 + BASE + 0.2]
    assert after and max(after) == 1024  # then full chunks again
    assert all(r.state is State.FINISHED for r in backlog)


def test_the_step_budget_protects_a_decoding_request_from_later_priority_0_prefill() -> None:
    # a critical request (-1) decodes alone; priority-0 prompts arrive later: the plain path
    # of every-0 scheduling would not see it, the window does
    engine = EmulatedEngine(config(chunk_tokens=1024, protect_step_s=0.005))
    critical = Request("critical", prompt(100, 120), 60, arrival=0.0, priority=-1)
    backlog = [Request(i, prompt(3000, 121 + i), 4, arrival=0.1) for i in range(2)]
    steps = backlog_prefill(engine, [critical, *backlog], backlog)
    finish = critical.finish_time
    assert finish is not None
    protected = [n for t, n in steps if 0.1 < t <= finish]
    assert protected[0] == 0 and set(protected[1:]) == {50}  # after the step in flight


def test_every_priority_equal_or_no_step_budget_runs_full_chunks() -> None:
    for protect_s, priorities in ((0.005, (3, 3)), (0.0, (1, 0))):
        engine = EmulatedEngine(config(chunk_tokens=1024, protect_step_s=protect_s))
        backlog = [Request(0, prompt(4000, 130), 4, arrival=0.0, priority=priorities[0])]
        other = Request("o", prompt(300, 131), 40, arrival=0.05, priority=priorities[1])
        steps = backlog_prefill(engine, [*backlog, other], backlog)
        assert max(n for _, n in steps) == 1024 and sum(n for _, n in steps) == 4000


def test_a_better_priority_arrival_passes_a_queue_head_that_does_not_fit() -> None:
    def run(urgent_priority: int) -> tuple[Request, Request, Request]:
        engine = EmulatedEngine(config(capacity_tokens=64 * BS))
        a = Request("a", prompt(600, 90), 200, arrival=0.0)  # holds 50 of the 64 blocks
        big = Request("big", prompt(500, 91), 100, arrival=0.0)  # needs 38: waits for a
        small = Request("small", prompt(100, 92), 20, arrival=0.2, priority=urgent_priority)
        drive(engine, [a, big, small])
        return a, big, small

    a, big, small = run(-1)
    assert small.admitted_time is not None and small.admitted_time < a.finish_time  # type: ignore[operator]
    assert big.admitted_time == a.finish_time
    a, big, small = run(0)  # FIFO: behind the head that does not fit
    assert big.admitted_time == a.finish_time
    assert small.admitted_time == a.finish_time  # admitted right after it, in the same step


def test_one_priority_for_all_schedules_exactly_as_first_come_first_served() -> None:
    def workload(priority: int) -> list[Request]:
        rng = random.Random(7)
        reqs = []
        for i in range(120):
            n = rng.randrange(1, 700)
            max_tokens = rng.randrange(1, 1024 - n + 2)
            p = prompt(n, rng.randrange(30))
            reqs.append(Request(i, p, max_tokens, arrival=i * 0.01, priority=priority))
        return reqs

    fifo, ranked = workload(0), workload(7)  # 7: every plan takes the ranked path
    drive(EmulatedEngine(config(capacity_tokens=64 * BS, chunk_tokens=256)), fifo)
    drive(EmulatedEngine(config(capacity_tokens=64 * BS, chunk_tokens=256)), ranked)
    for f, r in zip(fifo, ranked, strict=True):
        assert (f.admitted_time, f.cached_tokens) == (r.admitted_time, r.cached_tokens)
        assert (f.first_token_time, f.finish_time) == (r.first_token_time, r.finish_time)


def test_aborting_ranked_requests_keeps_the_ranking_count() -> None:
    engine = EmulatedEngine(config(chunk_tokens=256, max_batch=1))
    a = Request("a", prompt(1000, 93), 4, arrival=0.0, priority=2)  # prefilling when aborted
    b = Request("b", prompt(100, 94), 4, arrival=0.0, priority=3)  # waiting when aborted
    c = Request("c", prompt(100, 95), 4, arrival=0.0, priority=5)
    for r in (a, b, c):
        engine.submit(r)
    engine.step(0.0)
    engine.check()
    assert a.state is State.PREFILL and b.state is State.WAITING
    now = engine.next_time() / 2  # type: ignore[operator]
    assert engine.abort(b, now) and engine.abort(a, now)
    engine.check()  # the count of ranked requests matches the queue and the prefills
    drive(engine, [])
    assert c.state is State.FINISHED


def test_a_protect_hint_caps_its_request_before_the_better_rank_arrives() -> None:
    # the gateway's hint (x-urc-protect): a better rank is active in the pool, not here yet
    cfg = config(chunk_tokens=1024, protect_step_s=0.005, protect_window_s=0.1)
    for hint in (None, 0):
        engine = EmulatedEngine(cfg)
        backlog = [Request(i, prompt(3000, 140 + i), 4, arrival=0.0, priority=1) for i in range(2)]
        for req in backlog:
            req.protect = hint
        steps = backlog_prefill(engine, backlog, backlog)
        if hint is None:  # alone at one rank: full chunks
            assert max(n for _, n in steps) == 1024
        else:  # as if a request at priority 0 were here: 50 tokens a step, all the way
            assert {n for _, n in steps if n} == {50} and sum(n for _, n in steps) == 6000
        assert all(r.state is State.FINISHED for r in backlog)
