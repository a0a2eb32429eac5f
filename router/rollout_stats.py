"""A rollout's guardrails (docs/rollouts.md, "The statistics"): what each arm measured during one
step, and the one-sided tests that say whether the candidate is worse than the baseline beyond a
margin. Pure: the gateway and `urc replay --rollout` feed it the same numbers.

Every comparison is a confidence interval for "how much worse the candidate is" (`excess`):

    worse   lower bound > margin      (confidently worse beyond the margin: roll back)
    ok      upper bound <= margin     (confidently within the margin: may advance)
    unsure  anything else             (more samples needed)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Final, NamedTuple

TTFT_SAMPLES: Final = 4096  # the latest TTFTs an arm keeps for its quantiles (a ring)
WORSE, OK, UNSURE = "worse", "ok", "unsure"


CLUSTERS: Final = 65_536  # conversations an arm tells apart in a step; past it, some share one
_CLUSTER_MASK: Final = CLUSTERS - 1
# a cluster's sums: cached tokens, |predicted - cached|, prompt (Final: constants when compiled)
HIT: Final = 0
MISS: Final = 1
PROMPT: Final = 2


class Estimate(NamedTuple):
    value: float  # nan: nothing measured
    variance: float  # inf: too few clusters to tell


@dataclass(slots=True)
class Clustered:
    """Token sums per conversation (cluster): a token-weighted rate Σx / Σn whose variance is
    the cluster-robust one, since the turns of one conversation are not independent (its later
    turns hit what its first one cached). Totals are summed when asked (once per evaluation),
    not per request."""

    sums: dict[int, list[float]] = field(default_factory=dict)

    def add(self, cluster: int, hit: float, miss: float, prompt: float) -> None:
        at = cluster & _CLUSTER_MASK
        row = self.sums.get(at)
        if row is None:
            self.sums[at] = [hit, miss, prompt]
            return
        row[HIT] += hit
        row[MISS] += miss
        row[PROMPT] += prompt

    def total(self, which: int) -> float:
        return math.fsum([row[which] for row in self.sums.values()])

    def value(self, which: int) -> float:
        n = self.total(PROMPT)
        return self.total(which) / n if n else math.nan

    def variance(self, which: int) -> float:
        return self.estimate(which).variance

    def estimate(self, which: int) -> Estimate:
        """The rate Σx/Σn and its variance, Var(Σx/Σn) ~ G/(G-1) Σ_g (x_g - R n_g)² / (Σn)² over
        the G clusters (the ratio estimator's linearisation, clusters as the independent units);
        each total summed once."""
        g, n = len(self.sums), self.total(PROMPT)
        if not n:
            return Estimate(math.nan, math.inf)
        r = self.total(which) / n
        if g < 2:
            return Estimate(r, math.inf)
        spread = sum([(row[which] - r * row[PROMPT]) ** 2 for row in self.sums.values()])
        return Estimate(r, spread * g / (g - 1) / (n * n))


@dataclass(slots=True)
class ArmStats:
    """One arm's requests during one step."""

    ended: int = 0  # answered or failed (the client leaving counts as neither)
    errors: int = 0
    tokens: Clustered = field(default_factory=Clustered)  # as predicted and as the worker said
    ttft_s: list[float] = field(default_factory=list)

    def served(
        self, cluster: int, prompt_tokens: int, predicted: int, cached: int, ttft_s: float
    ) -> None:
        """One answered request of the conversation `cluster`: its tokens as predicted and as
        the worker reported them, and its time to first token."""
        self.ended += 1
        if prompt_tokens > 0:
            self.tokens.add(cluster, cached, abs(predicted - cached), prompt_tokens)
        samples = self.ttft_s
        if len(samples) < TTFT_SAMPLES:
            samples.append(ttft_s)
        else:
            samples[self.ended % TTFT_SAMPLES] = ttft_s

    def failed(self) -> None:
        self.ended += 1
        self.errors += 1

    @property
    def conversations(self) -> int:
        return len(self.tokens.sums)

    def summary(self) -> dict[str, float | int | None]:
        ttft = sorted(self.ttft_s)
        return {
            "requests": self.ended,
            "conversations": self.conversations,
            "errors": self.errors,
            "hit_rate": finite(self.tokens.value(HIT)),
            "prediction_error": finite(self.tokens.value(MISS)),
            "ttft_p50_s": finite(quantile(ttft, 0.5)),
            "ttft_p99_s": finite(quantile(ttft, 0.99)),
        }


@dataclass(slots=True)
class Margins:
    """How much worse the candidate may be: hit rate and prediction error in points of a rate
    (0.03: three points), error rate in points, TTFT quantiles relative (0.25: 25 % slower)."""

    hit_rate: float = 0.03
    prediction_error: float = 0.05
    error_rate: float = 0.02
    ttft_p50: float = 0.25
    ttft_p99: float = 0.5


class Verdict(NamedTuple):
    metric: str
    state: str  # worse | ok | unsure
    baseline: float
    candidate: float
    excess_low: float  # the confidence interval of how much worse the candidate is
    excess_high: float
    margin: float

    def describe(self) -> str:
        return (
            f"{self.metric} {self.state}: candidate {self.candidate:.4g} vs baseline "
            f"{self.baseline:.4g} (worse by [{self.excess_low:.3g}, {self.excess_high:.3g}], "
            f"margin {self.margin:.3g})"
        )


def z_of(confidence: float) -> float:
    """The one-sided normal quantile of `confidence` (0.95 -> 1.645)."""
    return NormalDist().inv_cdf(confidence)


def quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def finite(value: float) -> float | None:
    """`value`, or None for inf and nan (JSON has neither)."""
    return value if math.isfinite(value) else None


def _verdict(
    metric: str, base: float, cand: float, low: float, high: float, margin: float
) -> Verdict:
    state = WORSE if low > margin else OK if high <= margin else UNSURE
    return Verdict(metric, state, base, cand, low, high, margin)


def ratio_verdict(
    metric: str, which: int, base: Clustered, cand: Clustered, z: float, margin: float
) -> Verdict:
    """A normal interval for the difference of two ratio estimates (independent arms); a
    higher hit rate is better, a higher prediction error worse."""
    on_base, on_cand = base.estimate(which), cand.estimate(which)
    b, c = on_base.value, on_cand.value
    excess = b - c if which == HIT else c - b
    half = z * math.sqrt(on_base.variance + on_cand.variance)
    if math.isnan(excess):
        return Verdict(metric, UNSURE, b, c, -math.inf, math.inf, margin)
    return _verdict(metric, b, c, excess - half, excess + half, margin)


def wilson(errors: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of a proportion: sound at 0 and small n, where Wald's is not."""
    if n == 0:
        return 0.0, 1.0
    p = errors / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def error_verdict(base: ArmStats, cand: ArmStats, z: float, margin: float) -> Verdict:
    """Newcombe's hybrid score interval (his method 10) for the difference of two error rates,
    built from each arm's Wilson interval."""
    pb = base.errors / base.ended if base.ended else 0.0
    pc = cand.errors / cand.ended if cand.ended else 0.0
    lb, ub = wilson(base.errors, base.ended, z)
    lc, uc = wilson(cand.errors, cand.ended, z)
    low = (pc - pb) - math.sqrt((pc - lc) ** 2 + (ub - pb) ** 2)
    high = (pc - pb) + math.sqrt((uc - pc) ** 2 + (pb - lb) ** 2)
    return _verdict("error_rate", pb, pc, low, high, margin)


def quantile_bounds(ordered: list[float], q: float, z: float, units: int) -> tuple[float, float]:
    """A distribution-free interval for the q-quantile: the order statistics at ranks
    n (q -/+ z sqrt(q(1-q) / units)) (the binomial count of samples below it, over `units`
    independent units: the conversations, fewer than the samples), clipped to the sample."""
    n = len(ordered)
    spread = n * z * math.sqrt(q * (1 - q) / max(1, min(units, n)))
    low = max(0, math.floor(n * q - spread) - 1)
    high = min(n - 1, math.ceil(n * q + spread))
    return ordered[low], ordered[high]


def ttft_verdict(
    q: float,
    base: ArmStats,
    cand: ArmStats,
    z: float,
    margin: float,
    b: list[float],
    c: list[float],
) -> Verdict:
    """How much slower (relative) the candidate's q-quantile of TTFT is: the ratio of the
    quantiles' order-statistic intervals, the pessimistic corners for each bound (`b`, `c`:
    each arm's TTFTs sorted)."""
    metric = f"ttft_p{round(q * 100)}"
    if not b or not c:
        return Verdict(metric, UNSURE, math.nan, math.nan, -math.inf, math.inf, margin)
    b_low, b_high = quantile_bounds(b, q, z, base.conversations)
    c_low, c_high = quantile_bounds(c, q, z, cand.conversations)
    floor = 1e-9  # a zero TTFT (virtual time) divides as a tiny one
    low = c_low / max(b_high, floor) - 1
    high = c_high / max(b_low, floor) - 1
    return _verdict(metric, quantile(b, q), quantile(c, q), low, high, margin)


def compare(base: ArmStats, cand: ArmStats, margins: Margins, z: float) -> list[Verdict]:
    """Every guardrail, the candidate against the baseline on the same step's traffic."""
    b, c = sorted(base.ttft_s), sorted(cand.ttft_s)  # once for both quantiles
    return [
        ratio_verdict("hit_rate", HIT, base.tokens, cand.tokens, z, margins.hit_rate),
        ratio_verdict(
            "prediction_error", MISS, base.tokens, cand.tokens, z, margins.prediction_error
        ),
        error_verdict(base, cand, z, margins.error_rate),
        ttft_verdict(0.5, base, cand, z, margins.ttft_p50, b, c),
        ttft_verdict(0.99, base, cand, z, margins.ttft_p99, b, c),
    ]
