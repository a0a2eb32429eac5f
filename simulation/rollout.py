"""`urc replay --rollout`: a policy rollout's plan (router/rollout.py) run on a trace in virtual
time, the dwell times in virtual seconds, so an operator sees when each step would have advanced
or rolled back before going live (docs/rollouts.md, "Offline first")."""

from __future__ import annotations

import argparse
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from core.settings import add_setting_flags, from_flags
from router.policies import Policy, make_policy
from router.rollout import CANDIDATE, Placement, Rollout, conversation_key
from router.rollout_plan import RolloutPlan
from simulation.compare import Run, build_params, run_policy
from simulation.replay import FleetConfig
from simulation.report import format_table, rounded, write_json
from simulation.requests import SimRequest

# how often the plan is evaluated: the gateway's period (router/gateway/rollout.py), virtual here
EVALUATE_EVERY_S = 1.0
_TENANT = "default"  # the gateway's tenant when auth is off


def replay_key(req: SimRequest) -> bytes:
    """The conversation of a replayed request: its tenant and session, or, for a trace without
    sessions, its first block's key (as the gateway's fallback: docs/rollouts.md)."""
    tenant = req.tenant or _TENANT
    if req.session >= 0:
        return conversation_key(tenant, str(req.session), None, b"")
    first = req.keys[0] if req.keys else req.index
    return conversation_key(tenant, None, None, struct.pack("<Q", first & 0xFFFF_FFFF_FFFF_FFFF))


class ReplayRollout:
    """The replay's side of a rollout: each request's arm and policy, what each arm measured,
    and the plan evaluated every EVALUATE_EVERY_S of virtual time."""

    def __init__(self, plan: RolloutPlan, baseline: Policy, candidate: Policy, n: int) -> None:
        self.rollout = Rollout(plan, 0.0)
        self.policies = (baseline, candidate)
        self.placed: list[Placement | None] = [None] * n  # each request's (None: not routed)
        self._next = EVALUATE_EVERY_S
        self.now = 0.0

    def policy_for(self, req: SimRequest, now: float) -> Policy:
        """The policy that routes `req` at `now`: its conversation's arm's."""
        self.tick(now)
        at = self.placed[req.index] = self.rollout.place(replay_key(req))
        return self.policies[at.arm]

    def served(self, req: SimRequest, predicted: int, cached: int, ttft_s: float) -> None:
        at = cast(Placement, self.placed[req.index])
        self.rollout.served(at.arm, at.cluster, req.route.prompt_tokens, predicted, cached, ttft_s)

    def failed(self, req: SimRequest) -> None:
        self.rollout.failed(cast(Placement, self.placed[req.index]).arm)

    def tick(self, now: float) -> None:
        """Evaluate at every period due by `now` (at its time: a quiet spell is evaluated too)."""
        self.now = max(self.now, now)
        while self._next <= now:
            self.rollout.evaluate(self._next)
            self._next += EVALUATE_EVERY_S

    def report(self) -> dict[str, Any]:
        """The plan's run: its events (when each step advanced or rolled back) and the final
        state, with the share of requests the candidate served."""
        routed = [at.arm for at in self.placed if at is not None]
        described = self.rollout.describe(self.now)
        described["candidate_requests"] = sum(a == CANDIDATE for a in routed)
        described["requests"] = len(routed)
        return described


def timeline_rows(report: dict[str, Any]) -> list[list[str]]:
    """The events as a table: when (virtual s), what, the share after it, why."""
    rows = [["at_s", "event", "step", "share_%", "reason"]]
    for e in report["events"]:
        at = e["at"]
        shown = f"{at:.1f}" if math.isfinite(at) else "-"
        rows.append([shown, e["kind"], str(e["step"]), f"{e['share']:g}", e["reason"]])
    return rows


def add_rollout_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's settings, as the gateway's [gateway.rollout] (router/rollout_plan.py declares
    them once)."""
    group = p.add_argument_group(
        "rollout", "a policy rollout's plan against --policy, in virtual time (docs/rollouts.md)"
    )
    add_setting_flags(group, RolloutPlan)
    group.add_argument(
        "--rollout-policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of the candidate policy; repeatable",
    )


def plan_from_args(args: argparse.Namespace) -> RolloutPlan | None:
    """The plan (None: no --rollout-policy); ValueError on a bad one."""
    plan = from_flags(RolloutPlan, args)
    if plan.model or plan.alias:
        raise ValueError(
            "urc replay runs policy rollouts (--rollout-policy); a model rollout moves "
            "conversations between kv_groups, which the live gateway does (docs/rollouts.md)"
        )
    if not plan.policy:
        if args.rollout_policy_param:
            raise ValueError("--rollout-policy-param needs --rollout-policy")
        return None
    for item in args.rollout_policy_param:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--rollout-policy-param wants KEY=VALUE, got {item!r}")
        plan.policy_params[key.strip()] = value
    plan.check()
    return plan


def replay_rollout(
    requests: Sequence[SimRequest],
    baseline: str,
    plan: RolloutPlan,
    fleet: FleetConfig,
    given: Mapping[str, Any],
    seed: int = 0,
    progress: Callable[[str, int], None] | None = None,
) -> tuple[Run, dict[str, Any]]:
    """`requests` on a fresh `fleet`, each conversation routed by its arm's policy (`baseline`
    with `given` parameters, or the plan's candidate) while the plan runs; the run and the
    plan's report."""
    base = make_policy(baseline, build_params(baseline, given, fleet, seed), **given)
    params = plan.policy_params
    candidate = make_policy(plan.policy, build_params(plan.policy, params, fleet, seed), **params)
    driver = ReplayRollout(plan, base, candidate, len(requests))
    run = run_policy(f"{baseline}+rollout", requests, base, fleet, progress, None, driver)
    return run, driver.report()


def print_rollout(report: dict[str, Any], run: Run, json_path: str | None) -> None:
    """The plan's timeline, then the run's totals; `json_path`: both as JSON."""
    print(format_table(timeline_rows(report)))
    share = report["candidate_requests"] / max(report["requests"], 1)
    summary = run.summary
    print(
        f"\nfinal: {report['state']} at {report['share_percent']:g} % "
        f"(candidate served {share:.1%} of {report['requests']} requests); "
        f"fleet hit rate {summary.get('hit_rate', 0) or 0:.3f}"
    )
    if report.get("holding"):
        print(f"holding: {report['holding']}")
    if json_path:
        write_json({"rollout": rounded(report), "run": rounded(summary)}, json_path)
