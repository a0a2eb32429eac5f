"""A rollout's plan (docs/rollouts.md): what to roll out and how, declared once as settings (the
gateway's `[gateway.rollout]`, `urc replay --rollout-*`). Apart from router/rollout.py, which
mypyc compiles: a settings dataclass is read by field metadata and msgspec, as Python source."""

from __future__ import annotations

from dataclasses import dataclass

from core.settings import setting
from router.rollout_stats import Margins

DEFAULT_SALT = "urc-rollout"
DEFAULT_STEPS = "1,5,25,50,100"


def parse_steps(text: str) -> list[float]:
    """`1,5,25,50,100` -> candidate shares in percent, rising, in (0, 100]; ValueError."""
    try:
        steps = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"steps must be comma-separated percents, got {text!r}") from None
    if not steps or any(not 0 < s <= 100 for s in steps):
        raise ValueError(f"steps must be percents in (0, 100], got {text!r}")
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError(f"steps must rise, got {text!r}")
    return steps


@dataclass(slots=True)
class RolloutPlan:
    """What to roll out and how (the gateway's `[gateway.rollout]`, `urc replay --rollout-*`):
    the candidate's shares, each held `dwell_s` at least and until every guardrail says `ok`
    with `min_requests` per arm; a `worse` guardrail rolls back at once."""

    policy: str = setting(
        "", "canary this policy against the live one (docs/rollouts.md)", "--rollout-policy"
    )
    policy_params: dict[str, str | int | float | bool] = setting(
        {}, "the candidate policy's parameters", None
    )
    model: str = setting(
        "", "canary this served model behind --rollout-alias (a model rollout)", "--rollout-model"
    )
    alias: str = setting(
        "", "the model name clients send whose requests the model rollout splits", "--rollout-alias"
    )
    steps: str = setting(
        DEFAULT_STEPS, "the candidate's shares in percent, rising, to 100", "--rollout-steps"
    )
    dwell_s: float = setting(
        300.0, "seconds each step lasts at least (virtual in urc replay)", "--rollout-dwell"
    )
    min_requests: int = setting(
        300, "requests each arm ends in a step before it is judged", "--rollout-min-requests"
    )
    confidence: float = setting(
        0.95, "the one-sided confidence of every guardrail's test", "--rollout-confidence"
    )
    hit_rate_margin: float = setting(
        0.03, "hit-rate points the candidate may lose", "--rollout-hit-rate-margin"
    )
    prediction_error_margin: float = setting(
        0.05,
        "points of predicted-vs-actual error (per prompt token) it may add",
        "--rollout-prediction-error-margin",
    )
    error_rate_margin: float = setting(
        0.02, "error-rate points it may add", "--rollout-error-rate-margin"
    )
    ttft_p50_margin: float = setting(
        0.25, "how much slower its TTFT p50 may be (0.25: a quarter)", "--rollout-ttft-p50-margin"
    )
    ttft_p99_margin: float = setting(
        0.5, "how much slower its TTFT p99 may be", "--rollout-ttft-p99-margin"
    )
    salt: str = setting(
        DEFAULT_SALT,
        "keys the hash that picks each conversation's arm (replicas: the same)",
        "--rollout-salt",
    )

    @property
    def kind(self) -> str:
        return "model" if self.model else "policy"

    @property
    def candidate(self) -> str:
        return self.model or self.policy

    @property
    def configured(self) -> bool:
        return bool(self.model or self.policy)

    def margins(self) -> Margins:
        return Margins(
            self.hit_rate_margin,
            self.prediction_error_margin,
            self.error_rate_margin,
            self.ttft_p50_margin,
            self.ttft_p99_margin,
        )

    def check(self) -> list[float]:
        """The steps; ValueError naming what is wrong."""
        if self.policy and self.model:
            raise ValueError("a rollout has one candidate: a policy or a model, not both")
        if not self.configured:
            raise ValueError("a rollout needs a candidate: a policy or a model")
        if self.model and not self.alias:
            raise ValueError("a model rollout needs the alias clients send (alias)")
        if self.dwell_s < 0 or self.min_requests < 1 or not 0.5 <= self.confidence < 1:
            raise ValueError("dwell_s >= 0, min_requests >= 1, confidence in [0.5, 1)")
        m = self.margins()
        if min(m.hit_rate, m.prediction_error, m.error_rate, m.ttft_p50, m.ttft_p99) < 0:
            raise ValueError("margins are >= 0")
        return parse_steps(self.steps)
