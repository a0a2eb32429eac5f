"""`urc replay REC --shadow NAME`: a gateway recording replayed on its live decisions, so the
index and load view evolve as the gateway's did, while each NAME is asked beside them and counted
as the gateway counts its --shadow-policy (router/shadow.py). The report's section: docs/cli.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from router.policies import Candidate, Decision, RouteRequest
from router.shadow import ShadowPolicies, ShadowStats
from simulation.compare import Run, run_policy
from simulation.replay import FleetConfig
from simulation.report import named_rows
from simulation.requests import SimRequest
from simulation.traces import Trace, predicted_hit_rate

LIVE = "recorded"  # the followed live decisions, as a row of the report's policies


class RecordedChoice:
    """The recording's live choices as a policy, the shadows watching; a request is known by its
    `RouteRequest` object (the replay hands each request's own to `choose`)."""

    name = LIVE

    def __init__(
        self, requests: Sequence[SimRequest], workers: Sequence[str], shadows: ShadowPolicies
    ) -> None:
        self._chosen = {id(r.route): w for r, w in zip(requests, workers, strict=True)}
        self.shadows = shadows
        self.live = ShadowStats()  # the live choice counted as a shadow's (never disagrees)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        worker = self._chosen[id(request)]
        chosen = next((c for c in candidates if c.worker == worker), None)
        if chosen is None:
            names = ", ".join(c.worker for c in candidates)
            raise ValueError(f"the recording sent a request to {worker!r}, not one of {names}")
        self.shadows.watch(request, candidates, worker)
        ttft = self.shadows.estimator.ttft(request, chosen)
        predicted = request.matched_tokens(chosen.matched_blocks + chosen.host_blocks)
        self.live.count(request, predicted, ttft, True)
        return Decision(worker, "recorded", request, candidates, [0.0] * len(candidates))


def fleet_names(trace: Trace, limit: int, given: Sequence[str] | None) -> list[str]:
    """The simulated workers: `given` (the gateway's order, GET /admin/workers), else those of
    the first `limit` lines by first use. ValueError on a line without one or not in `given`."""
    used: dict[str, None] = {}
    for rec in trace.ordered(limit):
        if not rec.worker:
            raise ValueError(f"line {rec.line} of the recording names no worker")
        used.setdefault(rec.worker, None)
    if not given:
        return list(used)
    missing = [w for w in used if w not in given]
    if missing:
        raise ValueError(f"recorded workers not in --worker-names: {', '.join(missing)}")
    return list(given)


def replay_shadow(
    trace: Trace,
    requests: Sequence[SimRequest],
    shadows: Sequence[str],
    fleet: FleetConfig,
    progress: Callable[[str, int], None] | None = None,
) -> tuple[Run, dict[str, Any]]:
    """Replay `requests` (made by `trace_requests` from `trace`, a recording) on the recorded
    decisions with `shadows` watching: the run and the report's "shadow" section. The fleet's
    names must hold every recorded worker."""
    if not trace.recorded:
        raise ValueError("--shadow needs a gateway recording (urc gateway --record FILE)")
    lines = trace.ordered(len(requests))
    if len({r.kv_group for r in requests}) > 1:
        raise ValueError("--shadow replays a recording of one model (kv_group) for now")
    watch = ShadowPolicies(shadows, fleet.engine.prefill_tokens_per_s)
    policy = RecordedChoice(requests, [rec.worker or "" for rec in lines], watch)
    run = run_policy(LIVE, requests, policy, fleet, progress)
    prompt = sum(rec.input_length for rec in lines)
    cached = [rec.cached_tokens for rec in lines]
    recorded_hit = sum(c or 0 for c in cached) / prompt if prompt and None not in cached else None
    live = policy.live.summary()
    section = {
        "live": {
            "policy": trace.policy,
            "requests": len(lines),
            "recorded_hit_rate": recorded_hit,
            "recorded_predicted_hit_rate": predicted_hit_rate(trace, lines),
            "hit_rate": run.summary["hit_rate"],
            "predicted_hit_rate": live["predicted_hit_rate"],
            "predicted_ttft_mean_s": live["predicted_ttft_mean_s"],
        },
        "policies": {
            name: {
                **s.summary(),
                "prompt_tokens": s.prompt_tokens,
                "predicted_hit_tokens": s.predicted_hit_tokens,
            }
            for name, s in watch.stats.items()
        },
    }
    return run, section


SHADOW_COLUMNS = (
    ("hit rate", "hit_rate", "pct"),
    ("predicted hit rate", "predicted_hit_rate", "pct"),
    ("predicted TTFT", "predicted_ttft_mean_s", "ms"),
    ("disagreement", "disagreement_rate", "pct"),
)


def shadow_rows(section: dict[str, Any]) -> list[list[str]]:
    """The live decisions (recorded, replayed) and each shadow policy, one row each."""
    live = section["live"]
    label = f"live {live['policy'] or '?'}"
    named = {
        f"{label}, recorded": {
            "hit_rate": live["recorded_hit_rate"],
            "predicted_hit_rate": live["recorded_predicted_hit_rate"],
        },
        f"{label}, replayed": {**live, "disagreement_rate": 0.0},  # the live choice, by itself
        **section["policies"],
    }
    return named_rows("shadow", SHADOW_COLUMNS, named)
