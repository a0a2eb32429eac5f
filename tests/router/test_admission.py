"""Admission (router/admission.py) and budgets (router/budgets.py), in virtual time: strict
bands, fair shares by GPU cost, budgets over sliding minutes, shedding, queue limits."""

from __future__ import annotations

import pytest

from router.admission import (
    Admission,
    FlowSettings,
    Refused,
    TenantFlow,
    saturated,
    saturation,
)
from router.budgets import Budget
from router.policies import WorkerLoad

POOL = "g"


def admission(*tenants: TenantFlow, **settings: object) -> Admission:
    return Admission(FlowSettings(enabled=True, **settings), tenants)  # type: ignore[arg-type]


def test_saturated_when_every_worker_has_the_threshold_queued() -> None:
    a, b = WorkerLoad("a"), WorkerLoad("b")
    a.queued_prefill_tokens = 7_500  # 500 ms at 15k tokens/s
    assert not saturated([a, b], 15_000.0, 500.0)
    b.queued_prefill_tokens = 8_000
    assert saturated([a, b], 15_000.0, 500.0)
    assert saturation([a, b], 15_000.0, 500.0) == 1.0
    assert not saturated([], 15_000.0, 500.0)


def test_unsaturated_requests_go_at_once_and_saturated_ones_queue_in_fair_order() -> None:
    a, b, c = TenantFlow("a"), TenantFlow("b"), TenantFlow("c")
    adm = admission(a, b, c, saturation_ms=2_000.0)  # no flow gets ahead of its share here
    first = adm.ticket("a", "a", POOL, 5_000, 5_000, 16)
    assert adm.arrive(first, False, 0.0)
    floods = [adm.ticket("a", "a", POOL, 5_000, 5_000, 16) for _ in range(3)]
    assert not any(adm.arrive(t, True, 0.1) for t in floods)
    late = adm.ticket("b", "b", POOL, 100, 1_100, 16)
    assert not adm.arrive(late, True, 0.2)  # a is not ahead by 2 s: b waits its turn
    assert adm.pop(POOL, 0.3) is late  # it arrived last, but its flow is behind
    assert [adm.pop(POOL, 0.3) for _ in range(3)] == floods
    assert adm.pop(POOL, 0.3) is None and adm.queued == 0


def test_a_request_ranked_ahead_of_the_saturating_work_goes_at_once() -> None:
    """Saturated by a flow ahead of its share (its requests rank after on the workers), a
    request of a flow at its share, first in line, does not lengthen a queue: it goes."""
    flood, quiet = TenantFlow("flood"), TenantFlow("quiet")
    adm = admission(flood, quiet)
    assert adm.arrive(adm.ticket("flood", "flood", POOL, 5_000, 5_000, 16), False, 0.0)
    floods = [adm.ticket("flood", "flood", POOL, 5_000, 5_000, 16) for _ in range(5)]
    assert not any(adm.arrive(t, True, 0.1) for t in floods)
    quiet_ticket = adm.ticket("quiet", "quiet", POOL, 100, 1_100, 16)
    assert adm.arrive(quiet_ticket, True, 0.2) and adm.queued == 5
    assert adm.engine_priority(quiet_ticket) == 0  # ranked before the flood's 1
    # a flow ahead of its share, or behind a queued request of a higher band, waits
    assert not adm.arrive(adm.ticket("flood", "flood", POOL, 5_000, 5_000, 16), True, 0.2)
    high = adm.ticket("quiet", "quiet", POOL, 20_000, 20_000, 16, priority=1)
    assert not adm.arrive(high, True, 0.2)  # ahead of its share by itself: it queues
    assert not adm.arrive(adm.ticket("quiet", "quiet", POOL, 100, 1_100, 16), True, 0.2)
    # a band above the sheddable one's work in flight goes too
    shed = admission(TenantFlow("batch", priority=-1), TenantFlow("critical", priority=1))
    assert shed.arrive(shed.ticket("batch", "batch", POOL, 5_000, 5_000, 16), False, 0.0)
    assert shed.arrive(shed.ticket("critical", "critical", POOL, 100, 100, 16), True, 0.1)


def test_shares_follow_gpu_cost_not_requests() -> None:
    """Two backlogged tenants of equal weight: one's prompts mostly cached (cheap), the other's
    not. Each gets about half the GPU time, so the cached one gets more requests through."""
    cached, cold = TenantFlow("cached"), TenantFlow("cold")
    adm = admission(cached, cold)
    for _ in range(200):
        adm.arrive(adm.ticket("cached", "cached", POOL, 500, 5_000, 16), True, 0.0)
        adm.arrive(adm.ticket("cold", "cold", POOL, 5_000, 5_000, 16), True, 0.0)
    served = [adm.pop(POOL, 1.0) for _ in range(100)]
    work = {"cached": 0.0, "cold": 0.0}
    count = {"cached": 0, "cold": 0}
    for ticket in served:
        assert ticket is not None
        work[ticket.tenant.name] += ticket.cost
        count[ticket.tenant.name] += 1
    assert work["cached"] == pytest.approx(work["cold"], rel=0.15)
    assert count["cached"] > 5 * count["cold"]


def test_weights_scale_shares() -> None:
    heavy, light = TenantFlow("heavy", weight=3.0), TenantFlow("light")
    adm = admission(heavy, light)
    for _ in range(100):
        adm.arrive(adm.ticket("heavy", "heavy", POOL, 1_000, 1_000, 0), True, 0.0)
        adm.arrive(adm.ticket("light", "light", POOL, 1_000, 1_000, 0), True, 0.0)
    names = [t.tenant.name for t in (adm.pop(POOL, 1.0) for _ in range(80)) if t is not None]
    assert names.count("heavy") == pytest.approx(3 * names.count("light"), abs=2)


def test_bands_are_strict_and_sheddable_requests_are_refused_when_saturated() -> None:
    low, high = TenantFlow("low"), TenantFlow("high", priority=1)
    shed = TenantFlow("batch", priority=-1)
    adm = admission(low, high, shed)
    lows = [adm.ticket("low", "low", POOL, 10, 10, 0) for _ in range(3)]
    for t in lows:
        adm.arrive(t, True, 0.0)
    urgent = adm.ticket("high", "high", POOL, 10_000, 10_000, 0)
    adm.arrive(urgent, True, 0.5)
    assert adm.pop(POOL, 1.0) is urgent
    with pytest.raises(Refused) as refused:
        adm.arrive(adm.ticket("batch", "batch", POOL, 10, 10, 0), True, 1.0)
    assert refused.value.reason == "shed"
    assert adm.arrive(adm.ticket("batch", "batch", "other", 10, 10, 0), False, 1.0)
    header = adm.ticket("low", "low", POOL, 10, 10, 0, priority=-1)  # x-urc-priority: -1
    with pytest.raises(Refused):
        adm.arrive(header, True, 1.0)


def test_queue_limit_and_timeout() -> None:
    adm = admission(TenantFlow("t"), queue_max=2, queue_timeout_s=5.0)
    tickets = [adm.ticket("t", "t", POOL, 10, 10, 0) for _ in range(3)]
    adm.arrive(tickets[0], True, 0.0)
    adm.arrive(tickets[1], True, 3.0)
    with pytest.raises(Refused) as full:
        adm.arrive(tickets[2], True, 3.0)
    assert full.value.reason == "queue_full"
    assert adm.expire(4.0) == []
    assert adm.expire(5.0) == [tickets[0]]
    assert adm.queued == 1 and adm.pop(POOL, 6.0) is tickets[1]


def test_tokens_per_minute_over_a_sliding_minute() -> None:
    budget = Budget(0, 10_000, 0)
    admitted = 0
    now = 0.0
    while now < 120.0:  # twice the budget offered: 1,000 tokens every 3 s
        if budget.refusal(1_000, now) is None:
            budget.settle(budget.grant(1_000, now), 1_000, now + 1.0)
            admitted += 1_000
        now += 3.0
    assert admitted == 20_000  # two minutes' worth, never more in any 60 s
    reason, retry = budget.refusal(1_000, 60.0) or ("", 0.0)
    assert reason == "tokens_per_minute" and retry > 0


def test_settling_corrects_the_reservation() -> None:
    budget = Budget(0, 1_000, 0)
    grant = budget.grant(900, 0.0)  # reserved: prompt + max_tokens
    assert budget.refusal(200, 1.0) is not None
    budget.settle(grant, 300, 2.0)  # it used less
    assert budget.refusal(200, 2.0) is None
    assert budget.remaining(2.0) == (-1, 700)


def test_requests_per_minute_and_concurrency() -> None:
    budget = Budget(2, 0, 1)
    first = budget.grant(1, 0.0)
    assert budget.refusal(1, 0.0) == ("concurrency", 1.0)
    budget.settle(first, 1, 0.5)
    budget.settle(budget.grant(1, 1.0), 1, 1.5)
    reason, retry = budget.refusal(1, 2.0) or ("", 0.0)
    assert reason == "requests_per_minute" and retry == pytest.approx(58.0)
    assert Budget(10, 0, 0, share=0.5).rpm == 5


def test_over_budget_is_refused_with_a_retry_time() -> None:
    adm = admission(TenantFlow("t", budget=Budget(0, 1_000, 0)))
    assert adm.arrive(adm.ticket("t", "t", POOL, 10, 600, 100), False, 0.0)
    with pytest.raises(Refused) as over:
        adm.arrive(adm.ticket("t", "t", POOL, 10, 600, 100), False, 10.0)
    assert over.value.reason == "tokens_per_minute"
    assert over.value.retry_after_s == pytest.approx(50.0)


def test_engine_priority_puts_a_flow_ahead_of_its_share_one_step_later() -> None:
    flood, quiet = TenantFlow("flood"), TenantFlow("quiet")
    adm = admission(flood, quiet, saturation_ms=100.0)
    for _ in range(10):
        adm.arrive(adm.ticket("flood", "flood", POOL, 5_000, 5_000, 0), True, 0.0)
    quiet_ticket = adm.ticket("quiet", "quiet", POOL, 100, 100, 0)
    assert adm.arrive(quiet_ticket, True, 0.0)  # at its share: it goes past the backlog
    assert adm.engine_priority(quiet_ticket) == 0
    flood_ticket = adm.pop(POOL, 0.1)
    assert flood_ticket is not None and adm.engine_priority(flood_ticket) == 1


def test_a_tenant_pressing_on_its_budget_ranks_after_the_others_for_a_minute() -> None:
    limited = TenantFlow("limited", budget=Budget(2, 0, 0))
    adm = admission(limited, TenantFlow("quiet"))
    first = adm.ticket("limited", "limited", POOL, 1_000, 1_000, 0)
    assert adm.arrive(first, False, 0.0) and adm.engine_priority(first) == 0
    assert adm.arrive(adm.ticket("limited", "limited", POOL, 1_000, 1_000, 0), False, 1.0)
    with pytest.raises(Refused):  # its third in the minute
        adm.arrive(adm.ticket("limited", "limited", POOL, 1_000, 1_000, 0), False, 2.0)
    later = adm.ticket("limited", "limited", POOL, 1_000, 1_000, 0)
    assert adm.arrive(later, False, 61.0) and adm.engine_priority(later) == 1  # refused 59 s ago
    quiet = adm.ticket("quiet", "quiet", POOL, 100, 100, 0)
    assert adm.arrive(quiet, False, 61.0) and adm.engine_priority(quiet) == 0
    last = adm.ticket("limited", "limited", POOL, 1_000, 1_000, 0)
    assert adm.arrive(last, False, 122.5) and adm.engine_priority(last) == 0  # a minute on


def test_a_request_admitted_at_once_is_priced_after_its_routing() -> None:
    """Unqueued, its price is known only once routed (no second match of its prompt): the
    flow's finish moves then, as if it had been charged on arrival."""
    now, later = admission(TenantFlow("t")), admission(TenantFlow("t"))
    early = now.ticket("t", "t", POOL, 3_000, 3_000, 0)
    assert now.arrive(early, False, 0.0)
    late = later.ticket("t", "t", POOL, 0, 3_000, 0)
    assert later.busy(POOL, False) is False
    assert later.arrive(late, False, 0.0)
    later.price(late, 3_000)
    assert late.cost == pytest.approx(early.cost)
    assert later.pools[POOL][0].finish == pytest.approx(now.pools[POOL][0].finish)


def test_the_protect_hint_names_another_flows_better_rank_on_that_worker() -> None:
    a = admission(TenantFlow("quiet"), TenantFlow("flood"), protect_window_s=10.0)
    quiet = a.ticket("quiet", "quiet", POOL, 48, 1_048, 32)
    flood = a.ticket("flood", "flood", POOL, 5_000, 5_000, 32)
    assert a.protect(flood, 0, "w0", 0.0) is None  # the flood alone, not yet ahead
    assert a.protect(flood, 1, "w0", 1.0) is None  # its own earlier rank protects nothing
    assert a.protect(quiet, 0, "w0", 2.0) is None  # the best rank sent there: no hint
    assert a.protect(flood, 1, "w0", 3.0) == 0  # another flow's better rank, 1 s ago
    assert a.protect(flood, 1, "w1", 3.0) is None  # on a worker the quiet flow never used
    assert a.protect(flood, 1, "w0", 11.9) == 0  # within the window
    assert a.protect(flood, 1, "w0", 12.1) is None  # past it
    assert a.protect(flood, 0, "w0", 13.0) is None and a.protect(flood, 1, "w0", 14.0) is None
    # two flows alternating at a rank: either one's request protects it against the flood
    a.protect(quiet, 0, "w0", 20.0)
    a.protect(flood, 0, "w0", 20.5)
    assert a.protect(flood, 1, "w0", 21.0) == 0
    off = admission(TenantFlow("quiet"), TenantFlow("flood"), protect_window_s=0.0)
    off.protect(off.ticket("quiet", "quiet", POOL, 48, 1_048, 32), 0, "w0", 0.0)
    assert off.protect(off.ticket("flood", "flood", POOL, 5_000, 5_000, 32), 1, "w0", 1.0) is None
