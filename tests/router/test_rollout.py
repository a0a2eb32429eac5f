"""The rollout's pure core (router/rollout.py, router/rollout_stats.py): arms by a keyed hash
(share, stickiness, replicas that agree), the plan's state machine on synthetic arms, and the
statistics' intervals."""

from __future__ import annotations

import math

import pytest

from router.rollout import (
    BASELINE,
    CANDIDATE,
    Rollout,
    conversation_key,
)
from router.rollout_plan import RolloutPlan, parse_steps
from router.rollout_stats import (
    OK,
    UNSURE,
    WORSE,
    ArmStats,
    Clustered,
    error_verdict,
    quantile_bounds,
    ratio_verdict,
    wilson,
    z_of,
)

SESSIONS = [conversation_key("default", f"multi-turn/s{i}", None, b"") for i in range(2000)]


def plan(**kwargs: object) -> RolloutPlan:
    base = {"policy": "round_robin", "steps": "10,50,100", "dwell_s": 60.0, "min_requests": 50}
    return RolloutPlan(**{**base, **kwargs})  # type: ignore[arg-type]


def test_a_candidate_at_10_percent_serves_10_percent_of_2000_sessions() -> None:
    rollout = Rollout(plan(), 0.0)
    share = sum(rollout.place(key).arm == CANDIDATE for key in SESSIONS) / len(SESSIONS)
    assert 0.08 <= share <= 0.12, share


def test_replicas_with_one_salt_agree_on_every_session_and_another_salt_differs() -> None:
    replicas = [Rollout(plan(), float(t)) for t in range(3)]
    arms = [[r.place(key) for key in SESSIONS] for r in replicas]
    assert arms[0] == arms[1] == arms[2]
    other = Rollout(plan(salt="another"), 0.0)
    assert [other.place(k).arm for k in SESSIONS] != [a.arm for a in arms[0]]


def test_raising_the_share_only_moves_conversations_to_the_candidate() -> None:
    rollout = Rollout(plan(dwell_s=0.0, min_requests=1), 0.0)
    before = [rollout.place(key).arm for key in SESSIONS]
    rollout.promote(1.0)
    after = [rollout.place(key).arm for key in SESSIONS]
    assert all(a == CANDIDATE for a in after) and BASELINE in before
    half = Rollout(plan(steps="10,50,100"), 0.0)
    half.step, half.threshold = 1, 5000  # as after one advance
    moved = [half.place(key).arm for key in SESSIONS]
    assert all(m == CANDIDATE for b, m in zip(before, moved, strict=True) if b == CANDIDATE)


def test_the_key_is_the_session_else_the_user_else_the_fallback() -> None:
    assert conversation_key("t", "s", "u", b"f") == conversation_key("t", "s", None, b"g")
    assert conversation_key("t", None, "u", b"f") == conversation_key("t", None, "u", b"g")
    assert conversation_key("t", None, None, b"f") != conversation_key("t", None, None, b"g")
    assert conversation_key("a", "s", None, b"") != conversation_key("b", "s", None, b"")


def feed(rollout: Rollout, n: int, hit: tuple[float, float], ttft: tuple[float, float]) -> None:
    """n answers per arm, one conversation each, with the given hit rates and TTFTs (a little
    spread so the intervals are finite)."""
    for i in range(n):
        for arm in (BASELINE, CANDIDATE):
            wobble = (i % 7 - 3) / 100
            cached = int(1000 * max(0.0, min(1.0, hit[arm] + wobble)))
            rollout.served(arm, i * 2 + arm, 1000, cached, cached, ttft[arm] * (1 + wobble))


def test_a_worse_candidate_rolls_back_at_once_with_the_reason() -> None:
    rollout = Rollout(plan(), 0.0)
    feed(rollout, 100, (0.9, 0.3), (0.1, 0.1))
    event = rollout.evaluate(1.0)  # within the dwell: the early, stricter test still sees it
    assert event is not None and event.kind == "rolled_back" and rollout.share == 0
    assert event.reason.startswith("hit_rate worse") and rollout.state == "rolled_back"
    assert all(rollout.place(key).arm == BASELINE for key in SESSIONS[:200])


def test_an_equal_candidate_advances_after_each_dwell_to_complete() -> None:
    rollout = Rollout(plan(), 0.0)
    now = 0.0
    for expected in ("advanced", "complete"):
        feed(rollout, 200, (0.8, 0.8), (0.1, 0.1))  # no errors in 200: under 2 points
        assert rollout.evaluate(now + 30) is None  # not before the dwell
        event = rollout.evaluate(now + 60)
        assert event is not None and event.kind == expected, rollout.holding
        now += 60
    assert rollout.share == 100 and [e.kind for e in rollout.events] == [
        "started",
        "advanced",
        "complete",
    ]


def test_too_few_samples_hold_and_unsure_holds_another_dwell() -> None:
    rollout = Rollout(plan(min_requests=500), 0.0)
    feed(rollout, 100, (0.8, 0.8), (0.1, 0.1))
    assert rollout.evaluate(100.0) is None and rollout.holding.startswith("samples")
    close = Rollout(plan(hit_rate_margin=0.0), 0.0)
    feed(close, 200, (0.8, 0.8), (0.1, 0.1))
    assert close.evaluate(60.0) is None and "hit_rate" in close.holding
    assert close.state == "running" and close.step == 0


def test_pause_holds_the_step_but_not_a_rollback_and_abort_ends_it() -> None:
    rollout = Rollout(plan(), 0.0)
    assert rollout.pause(1.0) is not None and rollout.pause(2.0) is None
    feed(rollout, 100, (0.8, 0.8), (0.1, 0.1))
    assert rollout.evaluate(120.0) is None and rollout.step == 0
    assert rollout.resume(121.0) is not None
    feed(rollout, 100, (0.9, 0.2), (0.1, 0.1))
    rollout.pause(122.0)
    event = rollout.evaluate(123.0)
    assert event is not None and event.kind == "rolled_back"
    other = Rollout(plan(), 0.0)
    assert other.abort(5.0) is not None and other.share == 0 and other.state == "aborted"
    assert other.promote(6.0) is None


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"steps": "10,5,100"}, "rise"),
        ({"steps": "0,100"}, r"\(0, 100\]"),
        ({"policy": "", "model": "m"}, "alias"),
        ({"model": "m", "alias": "a"}, "not both"),
        ({"confidence": 1.0}, "confidence"),
    ],
)
def test_a_bad_plan_is_refused(settings: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Rollout(plan(**settings), 0.0)


def test_steps_parse() -> None:
    assert parse_steps("1, 5,25,50,100") == [1, 5, 25, 50, 100]


def test_wilson_is_sound_at_zero_and_newcombe_sees_a_real_difference() -> None:
    z = z_of(0.95)
    low, high = wilson(0, 200, z)
    assert low == 0 and 0.005 < high < 0.02
    base, cand = ArmStats(), ArmStats()
    for i in range(400):
        base.served(i, 100, 50, 50, 0.1)
        if i % 5 == 0:
            cand.failed()
        else:
            cand.served(i, 100, 50, 50, 0.1)
    verdict = error_verdict(base, cand, z, 0.02)
    assert verdict.state == WORSE and verdict.candidate == pytest.approx(0.2)
    assert error_verdict(base, base, z, 0.02).state == OK


def test_the_ratio_variance_is_the_clusters_not_the_requests() -> None:
    """Ten requests of one conversation are one unit: the same totals from ten conversations
    give a tighter interval than from two."""
    z = z_of(0.95)
    few, many, other = Clustered(), Clustered(), Clustered()
    for i in range(20):
        hit = 1000.0 if i % 2 else 0.0
        few.add(i % 2, hit, 0.0, 1000.0)
        many.add(i, hit, 0.0, 1000.0)
        other.add(i, 500.0, 0.0, 1000.0)
    assert few.value(0) == many.value(0) == 0.5
    wide = ratio_verdict("hit_rate", 0, other, few, z, 0.1)
    narrow = ratio_verdict("hit_rate", 0, other, many, z, 0.1)
    assert wide.excess_high - wide.excess_low > narrow.excess_high - narrow.excess_low
    assert math.isinf(Clustered().variance(0)) and wide.state == UNSURE


def test_quantile_bounds_bracket_the_quantile_and_narrow_with_more_units() -> None:
    ordered = [i / 1000 for i in range(1000)]
    low, high = quantile_bounds(ordered, 0.5, z_of(0.95), units=1000)
    assert low < 0.5 < high and high - low < 0.06
    low2, high2 = quantile_bounds(ordered, 0.5, z_of(0.95), units=50)
    assert high2 - low2 > high - low


def test_a_plan_short_of_100_completes_at_its_last_share() -> None:
    rollout = Rollout(plan(steps="10"), 0.0)
    feed(rollout, 200, (0.8, 0.8), (0.1, 0.1))
    event = rollout.evaluate(60.0)
    assert event is not None and event.kind == "complete" and rollout.share == 10
    assert rollout.evaluate(120.0) is None
