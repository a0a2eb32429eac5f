"""The gateway's side of a rollout (docs/rollouts.md): each request's arm (router/rollout.py
decides), the candidate's policy or model, what each arm's answers measured, the plan evaluated
every second, its admin routes (its metrics: rollout_metrics.py). Compiled with the request path;
off (`on` False) it costs a request one test."""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client.registry import CollectorRegistry

from core.errors import APIError
from router.gateway.isolation import SESSION_HEADERS, Scope
from router.gateway.parsing import bad_request, parse_body
from router.gateway.rollout_metrics import RolloutCollector
from router.gateway.routing import Keyed, Plan, Router, RoutingModes
from router.policies import Policy, make_policy
from router.rollout import CANDIDATE, ENDED, Event, Placement, Rollout, conversation_key
from router.rollout_plan import RolloutPlan

if TYPE_CHECKING:
    from router.gateway.fleet import Worker
    from router.gateway.proxy import Usage

log = logging.getLogger(__name__)
EVALUATE_EVERY_S = 1.0  # simulation/rollout.py evaluates as often, in virtual time
ACTIONS = ("start", "pause", "resume", "promote", "abort")
_json = msgspec.json.Encoder(order="sorted")
_U64 = struct.Struct("<Q")  # a block key's bytes, its format parsed once


def fallback_key(routed: Mapping[str, Any], chat: bool, keys: Sequence[int] | None) -> bytes:
    """A conversation without a session or user: a chat's messages up to its first user message
    (every later turn repeats them), else the prompt's first block key (or its first 256
    characters before it is keyed)."""
    if chat:
        messages = routed.get("messages") or []
        first = 0
        for i, m in enumerate(messages):
            if isinstance(m, dict) and m.get("role") == "user":
                first = i
                break
        return _json.encode(messages[: first + 1])
    if keys:
        return _U64.pack(keys[0] & 0xFFFF_FFFF_FFFF_FFFF)
    prompt = routed.get("prompt")
    return _json.encode(prompt[:256] if isinstance(prompt, str | list) else prompt)


class Canary:
    """The rollout a gateway process runs, if any: `on` says whether requests take part."""

    def __init__(
        self, template: RolloutPlan, prefill_tokens_per_s: float, registry: CollectorRegistry
    ) -> None:
        self.template = template  # the configured plan: what an admin start leaves unsaid
        self.told = {"prefill_tokens_per_s": prefill_tokens_per_s}
        self.rollout: Rollout | None = None
        self.candidate: Policy | None = None  # a policy rollout's
        self.on = False  # the candidate has a share (running, paused, complete): requests take part
        self.outcomes = [[0.0, 0.0], [0.0, 0.0]]  # by arm: served, failed
        self.events: dict[str, float] = {}  # by kind, over every rollout of this process
        registry.register(RolloutCollector(self))

    def start(self, plan: RolloutPlan, now: float) -> Event:
        """A new rollout (the one before it, if any, ends): ValueError on a bad plan."""
        candidate = None
        if plan.policy:
            candidate = make_policy(plan.policy, self.told, **plan.policy_params)
        rollout = Rollout(plan, now)  # checks the plan
        self.rollout, self.candidate = rollout, candidate
        self.on = rollout.share > 0
        return self._note(rollout.events[0])

    def _note(self, event: Event) -> Event:
        self.events[event.kind] = self.events.get(event.kind, 0.0) + 1
        rollout = self.rollout
        self.on = rollout is not None and rollout.share > 0
        if rollout is not None:
            level = logging.WARNING if event.kind in ("rolled_back", "aborted") else logging.INFO
            what = f"{rollout.plan.kind} {rollout.plan.candidate}"
            log.log(
                level,
                "rollout of %s: %s at step %d, candidate share %g %%%s",
                what,
                event.kind,
                event.step,
                event.share,
                f": {event.reason}" if event.reason else "",
            )
        return event

    def keyed(
        self,
        router: Router,
        tenant: str,
        headers: Mapping[str, str],
        body: dict[str, Any],
        routed: dict[str, Any],
        chat: bool,
        scope: Scope,
    ) -> tuple[Keyed, Placement | None]:
        """Key the request, its arm chosen first (a model rollout's candidate arm asks for the
        candidate model; the request is rewritten so). None: it takes no part (no rollout runs,
        or it names another model)."""
        rollout = self.rollout
        salt, public = scope
        if rollout is None or not self.on:
            return router.keyed(routed, chat, salt, public), None
        plan = rollout.plan
        session = headers.get(SESSION_HEADERS[0]) or headers.get(SESSION_HEADERS[1])
        user = routed.get("user")
        if not isinstance(user, str):
            user = None
        if plan.model:
            if routed.get("model") != plan.alias:
                return router.keyed(routed, chat, salt, public), None
            at = rollout.place(
                conversation_key(tenant, session, user, fallback_key(routed, chat, None))
            )
            # each arm's worker is asked for its model by its served name, not the alias
            baseline = router.fleet.models.get(plan.alias)
            name = plan.model if at.arm == CANDIDATE else baseline.name if baseline else None
            if name is not None:
                routed["model"] = body["model"] = name
            return router.keyed(routed, chat, salt, public), at
        keyed = router.keyed(routed, chat, salt, public)
        fallback = b"" if session or user else fallback_key(routed, chat, keyed.request.block_keys)
        return keyed, rollout.place(conversation_key(tenant, session, user, fallback))

    def routed(
        self,
        router: Router,
        modes: RoutingModes,
        keyed: Keyed,
        at: Placement | None,
        now: float | None,
    ) -> Plan:
        """Route `keyed` (at `now`: router.route's) by its arm's policy. Degraded, a policy
        rollout stands aside: least load routes every arm, and nothing is counted."""
        policy = modes.active()
        if at is not None and self.candidate is not None:
            if modes.degraded:
                at = None
            elif at.arm == CANDIDATE:
                policy = self.candidate
        plan = router.route(keyed, policy, now)
        if at is not None:
            plan.arm = at.arm
            plan.cluster = at.cluster
        return plan

    def served(self, plan: Plan, worker: Worker, usage: Usage) -> None:
        """An answer with its usage: the arm's guardrails."""
        rollout = self.rollout
        if rollout is None or plan.arm < 0:
            return
        self.outcomes[plan.arm][0] += 1
        cached = usage.cached_tokens
        if cached is None or plan.ttft_s != plan.ttft_s:  # NaN: no first byte seen
            return
        predicted = plan.matched(worker.name)
        rollout.served(
            plan.arm, plan.cluster, plan.request.prompt_tokens, predicted, cached, plan.ttft_s
        )

    def answered(self, plan: Plan) -> None:
        """Forwarded without an exception: the arm failed when nothing reached the client (no
        first byte: a 5xx passed on). The caller counts the one it made (`failed`), called
        from its handler rather than around the forwarding: no coroutine more a request."""
        if plan.arm >= 0 and math.isnan(plan.ttft_s):
            self.failed(plan)

    def failed(self, plan: Plan) -> None:
        """A 5xx of the gateway's (every worker failed) for `plan`: its arm's, if any."""
        if self.rollout is not None and plan.arm >= 0:
            self.outcomes[plan.arm][1] += 1
            self.rollout.failed(plan.arm)

    def evaluate(self, now: float) -> None:
        if self.rollout is not None and self.rollout.state not in ENDED:
            event = self.rollout.evaluate(now)
            if event is not None:
                self._note(event)

    async def run(self) -> None:
        """The plan evaluated every EVALUATE_EVERY_S while a rollout runs."""
        while True:
            await asyncio.sleep(EVALUATE_EVERY_S)
            self.evaluate(time.monotonic())

    def describe(self) -> dict[str, Any]:
        if self.rollout is None:
            return {"state": "none"}
        return self.rollout.describe(time.monotonic())

    def plan_of(self, given: dict[str, Any]) -> RolloutPlan:
        """An admin start's plan: its settings over the configured ones (the salt, above all:
        replicas must share it); naming a policy or a model drops the configured candidate."""
        unknown = sorted(set(given) - set(RolloutPlan.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown rollout settings {unknown} (docs/config.md)")
        base = msgspec.to_builtins(self.template)
        if "policy" in given or "model" in given:
            base.update(policy="", model="", alias="", policy_params={})
        try:
            return msgspec.convert({**base, **given}, RolloutPlan)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None

    def act(self, body: Any) -> dict[str, Any]:
        """An admin action: start (with the plan's settings), pause, resume, promote, abort."""
        if not isinstance(body, dict) or body.get("action") not in ACTIONS:
            raise bad_request(f"'action' must be one of {', '.join(ACTIONS)}", "action")
        action, now = body["action"], time.monotonic()
        if action == "start":
            try:
                self.start(self.plan_of({k: v for k, v in body.items() if k != "action"}), now)
            except ValueError as exc:
                raise bad_request(str(exc), "plan") from None
            return self.describe()
        rollout = self.rollout
        if rollout is None:
            raise APIError(409, "no rollout to " + action, type="invalid_request_error")
        event = getattr(rollout, action)(now)
        if event is None:
            raise APIError(409, f"cannot {action} a rollout that is {rollout.state}")
        self._note(event)
        return self.describe()

    def routes(
        self,
    ) -> list[tuple[Callable[..., web.RouteDef], str, Callable[[web.Request], Any]]]:
        """GET /admin/rollout (the state), POST /admin/rollout {"action": ...}."""

        async def show(_request: web.Request) -> web.Response:
            return web.json_response(self.describe())

        async def act(request: web.Request) -> web.Response:
            return web.json_response(self.act(parse_body(await request.read())))

        return [(web.get, "/admin/rollout", show), (web.post, "/admin/rollout", act)]
