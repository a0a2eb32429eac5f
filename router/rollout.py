"""Gradual rollout (docs/rollouts.md): a candidate (a policy, or a model version behind an alias)
serves a share of the conversations, chosen by a keyed hash, and a plan of steps raises that
share while the guardrails (router/rollout_stats.py) hold, or sets it to 0 when they fail.
Pure: the gateway (router/gateway/rollout.py) and `urc replay --rollout`
(simulation/rollout.py) drive the same object, on the monotonic clock or the virtual one.

The arm of a conversation is `bucket(key) < share`: a bucket in [0, 10000) from a salted hash of
(tenant, session or user), so every replica and --processes sibling with the same salt agrees
without talking, every turn of a conversation stays on one arm, and raising the share only moves
conversations from the baseline to the candidate, never back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from xxhash import xxh3_64_intdigest

from router.rollout_plan import RolloutPlan
from router.rollout_stats import OK, WORSE, ArmStats, Verdict, compare, finite, z_of

# Final: compiled, these are constants in the request path, not lookups in a module's globals
BUCKETS: Final = 10_000  # a share is set in hundredths of a percent
BASELINE: Final = 0
CANDIDATE: Final = 1
ARMS = ("baseline", "candidate")
EARLY = 50  # within a dwell, a rollback needs a 50x smaller error level (0.95 -> 0.999)
# states: advancing; paused by the operator (no advance; the guardrails still roll back); done
RUNNING, PAUSED, COMPLETE, ROLLED_BACK, ABORTED = (
    "running",
    "paused",
    "complete",
    "rolled_back",
    "aborted",
)
ENDED = (COMPLETE, ROLLED_BACK, ABORTED)


def hashed(key: bytes, seed: int) -> int:
    """The conversation's hash, seeded by the salt (`seed_of`), the same in every process: its
    bucket is this modulo BUCKETS, its cluster this divided by 2**32. xxh3: the arm needs a
    stable, well-spread hash on the request path, not a secret one."""
    return xxh3_64_intdigest(key, seed)


def seed_of(salt: str) -> int:
    return xxh3_64_intdigest(salt.encode())


@dataclass(slots=True)
class Placement:
    """A record, not a NamedTuple: compiled, it is made natively (a NamedTuple's constructor
    runs Python code on every request)."""

    arm: int  # BASELINE or CANDIDATE
    cluster: int  # the conversation, for the statistics (a hash: the same in every process)


def conversation_key(tenant: str, session: str | None, user: str | None, fallback: bytes) -> bytes:
    """What the arm is chosen by: the tenant and its session, else its user, else `fallback`
    (the caller's stand-in for a conversation: docs/rollouts.md, "How arms are chosen")."""
    if session:
        return f"{tenant}\0s\0{session}".encode()
    if user:
        return f"{tenant}\0u\0{user}".encode()
    return tenant.encode() + b"\0f\0" + fallback


class Event(NamedTuple):
    at: float  # the caller's clock
    kind: str  # started, advanced, complete, rolled_back, paused, resumed, promoted, aborted
    step: int  # the step's index in the plan's steps
    share: float  # the candidate's share in percent after it
    reason: str


class Rollout:
    """One plan's run: the share, the step's per-arm stats, what happened."""

    def __init__(self, plan: RolloutPlan, now: float) -> None:
        self.steps = plan.check()
        self.plan = plan
        self.state = RUNNING
        self.step = 0
        self.threshold = round(self.steps[0] * BUCKETS / 100)  # buckets below: the candidate
        self.step_started = now
        self.arms = (ArmStats(), ArmStats())
        self.z = z_of(plan.confidence)
        self.z_early = z_of(1 - (1 - plan.confidence) / EARLY)
        self.looks = 1  # full looks at this step so far, plus one
        self.margins = plan.margins()
        self.verdicts: list[Verdict] = []  # the last evaluation's
        self.holding = ""  # why a step past its dwell has not advanced
        self.events = [Event(now, "started", 0, self.share, "")]
        self._seed = seed_of(plan.salt)

    @property
    def share(self) -> float:
        """The candidate's share of conversations, in percent."""
        return self.threshold * 100 / BUCKETS

    def place(self, key: bytes) -> Placement:
        """The arm of the conversation `key` (conversation_key), and its cluster for the
        statistics (other bits of the same hash)."""
        point = hashed(key, self._seed)
        arm = CANDIDATE if point % BUCKETS < self.threshold else BASELINE
        return Placement(arm, point >> 32)

    def served(
        self, arm: int, cluster: int, prompt_tokens: int, predicted: int, cached: int, ttft: float
    ) -> None:
        """An answer of the conversation `cluster` on `arm` (its Placement's)."""
        if self.state not in ENDED:
            self.arms[arm].served(cluster, prompt_tokens, predicted, cached, ttft)

    def failed(self, arm: int) -> None:
        if self.state not in ENDED:
            self.arms[arm].failed()

    def evaluate(self, now: float) -> Event | None:
        """Compare the arms. Within a dwell, only a guardrail `worse` at the early confidence
        rolls back (the data is looked at every period: a stricter test keeps the false
        rollbacks of those many looks rare); at each dwell's end, the plan's confidence: a
        `worse` rolls back, all `ok` advances (not while paused), else the step holds for
        another dwell. The event, if any."""
        if self.state in ENDED:
            return None
        base, cand = self.arms
        wanted = self.plan.min_requests
        if base.ended < wanted or cand.ended < wanted:
            self.holding = f"samples: baseline {base.ended}, candidate {cand.ended} of {wanted}"
            return None
        due = now - self.step_started >= self.plan.dwell_s * self.looks
        self.verdicts = compare(base, cand, self.margins, self.z if due else self.z_early)
        worse = [v.describe() for v in self.verdicts if v.state == WORSE]
        if worse:
            self.threshold = 0
            return self._ended(ROLLED_BACK, now, "; ".join(worse))
        if not due or self.state == PAUSED:
            return None
        self.looks += 1  # the next full look: a dwell later
        unsure = [v.metric for v in self.verdicts if v.state != OK]
        if unsure:
            self.holding = f"unsure: {', '.join(unsure)}"
            return None
        return self._advance(now, "guardrails ok")

    def _advance(self, now: float, reason: str) -> Event:
        """The next step; past the last (a plan that stops short of 100 %, e.g. a fixed 90/10
        split), complete at the share it has."""
        if self.step + 1 == len(self.steps):
            self._new_step(now)
            return self._ended(COMPLETE, now, reason)
        self.step += 1
        self.threshold = round(self.steps[self.step] * BUCKETS / 100)
        self._new_step(now)
        if self.threshold >= BUCKETS:
            return self._ended(COMPLETE, now, reason)
        return self._note(now, "advanced", reason)

    def _new_step(self, now: float) -> None:
        self.step_started = now
        self.looks = 1
        self.arms = (ArmStats(), ArmStats())
        self.holding = ""

    def _ended(self, state: str, now: float, reason: str) -> Event:
        self.state = state
        return self._note(now, state, reason)

    def _note(self, now: float, kind: str, reason: str) -> Event:
        event = Event(now, kind, self.step, self.share, reason)
        self.events.append(event)
        return event

    def pause(self, now: float) -> Event | None:
        if self.state != RUNNING:
            return None
        self.state = PAUSED
        return self._note(now, "paused", "operator")

    def resume(self, now: float) -> Event | None:
        if self.state != PAUSED:
            return None
        self.state = RUNNING
        return self._note(now, "resumed", "operator")

    def promote(self, now: float) -> Event | None:
        """The candidate takes every conversation now, whatever the step."""
        if self.state in ENDED:
            return None
        self.step = len(self.steps) - 1
        self.threshold = BUCKETS
        self._new_step(now)
        return self._ended(COMPLETE, now, "promoted by the operator")

    def abort(self, now: float, reason: str = "aborted by the operator") -> Event | None:
        if self.state in ENDED:
            return None
        self.threshold = 0
        return self._ended(ABORTED, now, reason)

    def describe(self, now: float) -> dict[str, Any]:
        """The state as /admin/rollout shows it and `urc replay --rollout` reports it."""
        plan = self.plan
        return {
            "kind": plan.kind,
            "candidate": plan.candidate,
            "alias": plan.alias or None,
            "policy_params": plan.policy_params,
            "state": self.state,
            "step": self.step,
            "steps": self.steps,
            "share_percent": self.share,
            "step_age_s": now - self.step_started,
            "dwell_s": plan.dwell_s,
            "holding": self.holding or None,
            "arms": {name: self.arms[i].summary() for i, name in enumerate(ARMS)},
            "guardrails": [_plain(v._asdict()) for v in self.verdicts],
            "events": [e._asdict() for e in self.events],
        }


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: finite(v) if isinstance(v, float) else v for k, v in row.items()}
