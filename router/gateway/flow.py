"""Flow control at the edge (docs/flow-control.md): the gateway's and the endpoint picker's
shell around the pure admission (router/admission.py). It owns the `Admission`, the clock, the
waiters (one future per queued request), the pump that lets queued requests go when their pool
is no longer saturated, the queue-timeout sweep, and the 429 answers with their headers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any, Final

from core.errors import APIError
from router.admission import (
    PRIORITY_HEADER,
    PROTECT_HEADER,
    Admission,
    FlowSettings,
    Refused,
    TenantFlow,
    Ticket,
)
from router.admission import saturated as pool_saturated
from router.budgets import WINDOW_S, Budget
from router.gateway.access import RequestNote
from router.gateway.config_schema import GatewayConfig
from router.gateway.fleet import Fleet
from router.gateway.flow_metrics import OUTCOMES, FlowMetrics
from router.gateway.isolation import SESSION_HEADERS, Tenant
from router.gateway.parsing import forwarded
from router.gateway.reply import JSON_HEADERS, Headers, Reply
from router.gateway.routing import Keyed, Plan
from router.policies import RouteRequest
from router.route import Routing

# Final: compiled, these are constants on the request path, not lookups in the module's globals
_EMBEDDINGS: Final = "/embeddings"  # an embeddings pool's suffix: budgets only, never queued
_PROTECT_LINE: Final = PROTECT_HEADER.encode()
PUMP_PERIOD_S = 0.05  # while anything waits: the pump and the timeout sweep
LIMITED: Final = frozenset({"requests_per_minute", "tokens_per_minute", "concurrency"})
_OUTCOME_AT: Final = {outcome: i for i, outcome in enumerate(OUTCOMES)}  # its row's column


def protect_line(hint: int | None) -> bytes:
    """The protect hint's header line for a worker (b"": none)."""
    return b"" if hint is None else b"%s: %d\r\n" % (_PROTECT_LINE, hint)


class Entry:
    """What flow control keeps with a ticket (`ticket.item`): its waiter and what it used."""

    __slots__ = ("future", "prompt_tokens", "output_tokens", "used", "request")

    def __init__(self, prompt_tokens: int, request: RouteRequest | None = None) -> None:
        self.future: asyncio.Future[None] | None = None  # set while it waits
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0
        self.used = False  # the worker reported its usage
        # its keys until it is priced: before it queues, or once routed (Admission.price)
        self.request = request


def max_tokens_of(body: dict[str, Any]) -> int | None:
    """The output the client capped (chat, completions or the Responses API), None: uncapped."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _reset(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it: 1s, 6m0s, 20ms."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    minutes, rest = divmod(int(seconds + 0.999), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class FlowCounts:
    """Requests by tenant and outcome (a row per tenant, in OUTCOMES' order), tokens by tenant
    (input, output) and requests sent with the protect hint by tenant: plain numbers the
    request path adds to here (compiled), FlowMetrics' families at scrape time
    (flow_metrics.py)."""

    __slots__ = ("outcomes", "tokens_used", "hinted")

    def __init__(self) -> None:
        self.outcomes: dict[str, list[float]] = {}
        self.tokens_used: dict[str, list[float]] = {}
        self.hinted: dict[str, float] = {}

    def outcome(self, ticket: Ticket, outcome: str) -> None:
        name = ticket.tenant.name
        row = self.outcomes.get(name)
        if row is None:
            row = self.outcomes[name] = [0.0] * len(OUTCOMES)
        row[_OUTCOME_AT[outcome]] += 1

    def tokens(self, ticket: Ticket, prompt: int, output: int) -> None:
        name = ticket.tenant.name
        row = self.tokens_used.get(name)
        if row is None:
            row = self.tokens_used[name] = [0.0, 0.0]
        row[0] += prompt
        row[1] += output

    def hint(self, ticket: Ticket) -> None:
        name = ticket.tenant.name
        self.hinted[name] = self.hinted.get(name, 0.0) + 1


class FlowControl:
    """One process's admission: `ticket` -> `admit` (may wait) -> route -> `done`."""

    def __init__(self, config: GatewayConfig, fleet: Fleet, routing: Routing, share: float):
        settings = FlowSettings(
            True,
            config.flow_saturation_ms,
            config.flow_queue_max,
            config.flow_queue_timeout_s,
            config.prefill_tokens_per_s,
            share,
            config.flow_protect_window_s,
        )
        tenants = []
        for t in config.tenants:
            limits = (t.requests_per_minute, t.tokens_per_minute, t.max_concurrent_requests)
            budget = Budget(*limits, share)
            tenants.append(TenantFlow(t.name, t.weight, t.priority, t.fairness, budget))
        self.admission = Admission(settings, tenants)
        self.settings = settings
        self.fleet = fleet
        self.routing = routing
        self.counts = FlowCounts()  # on the request path; `metrics` reads them at scrape
        self.metrics = FlowMetrics(self.admission, fleet, settings, self.counts)
        self._timer: asyncio.Task[None] | None = None
        self._pump_soon = False

    def saturated(self, kv_group: str) -> bool:
        s = self.settings
        return pool_saturated(self.fleet.loads(kv_group), s.prefill_tokens_per_s, s.saturation_ms)

    def ticket(
        self, tenant: Tenant, keyed: Keyed, body: dict[str, Any], headers: Mapping[str, str]
    ) -> Ticket:
        """`keyed`'s ticket: its flow by the tenant's fairness, its band (the x-urc-priority
        header when it is an integer, else the tenant's), charged its uncached prefill."""
        flow = self.admission.tenant(tenant.name)
        key = tenant.name
        if flow.fairness == "user":
            key = f"{key}/u/{body.get('user') or ''}"
        elif flow.fairness == "session":
            session = next((v for h in SESSION_HEADERS if (v := headers.get(h))), "")
            key = f"{key}/s/{session}"
        band: int | None = None
        said = headers.get(PRIORITY_HEADER)
        if said is not None:
            with contextlib.suppress(ValueError):
                band = int(said)
        request = keyed.request
        prompt = request.prompt_tokens
        ticket = self.admission.ticket(
            tenant.name, key, request.kv_group, 0, prompt, max_tokens_of(body), band
        )
        ticket.item = Entry(prompt, request)  # priced in `enter` if it queues, else once routed
        return ticket

    def embedding_ticket(self, tenant: str, request: RouteRequest) -> Ticket:
        """An embeddings request: budgets only (a pool of its own, never saturated, no queue)."""
        tokens = request.prompt_tokens
        pool = f"{request.kv_group}{_EMBEDDINGS}"
        ticket = self.admission.ticket(tenant, tenant, pool, 0, tokens, 0)
        ticket.item = Entry(tokens)
        return ticket

    def arrive(self, ticket: Ticket, reply: Reply, note: RequestNote | None) -> bool:
        """True: go now; False: queued (then `wait`), or refused (the 429 answered)."""
        try:
            return self.enter(ticket)
        except Refused as exc:
            self.refuse(reply, exc, ticket, note)
            return False

    async def wait(self, ticket: Ticket, reply: Reply, note: RequestNote | None) -> bool:
        """After `arrive`: True once `ticket` may go, False when refused (the 429 answered)."""
        if not ticket.queued:  # refused on arrival
            return False
        try:
            await self.turn(ticket)
        except Refused as exc:
            self.refuse(reply, exc, ticket, note)
            return False
        return True

    def enter(self, ticket: Ticket) -> bool:
        """True: go now; False: queued (then `turn`). Raises Refused (counted)."""
        pool = ticket.pool
        busy = not pool.endswith(_EMBEDDINGS) and self.saturated(pool)
        entry: Entry = ticket.item  # type: ignore[assignment]
        if entry.request is not None and self.admission.busy(pool, busy):  # it will queue
            uncached = self.routing.uncached(entry.request, time.monotonic())
            self.admission.price(ticket, uncached)
            entry.request = None
        try:
            go = self.admission.arrive(ticket, busy, time.monotonic())
        except Refused as exc:
            self.counts.outcome(ticket, "limited" if exc.reason in LIMITED else exc.reason)
            raise
        if go:
            self.counts.outcome(ticket, "admitted_now")
            return True
        self._start_timer()
        self.pump_soon()  # the pool may be free already, with others queued before it
        return False

    async def turn(self, ticket: Ticket) -> None:
        """A queued `ticket`: until the pump lets it go; Refused (queue_timeout) when it waited
        too long. A client that leaves (cancelled) is withdrawn from the queue."""
        entry: Entry = ticket.item  # type: ignore[assignment]
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry.future = future
        try:
            await future
        except asyncio.CancelledError:
            self.admission.withdraw(ticket)
            raise
        finally:
            entry.future = None
        self.metrics.waited(ticket, time.monotonic() - ticket.arrived, "admitted_after_wait")

    def pump(self) -> None:
        """Let one queued request of each pool that is no longer saturated go; again right
        after (its waiter routes and dispatches first, so the next check sees its load)."""
        self._pump_soon = False
        admission = self.admission
        if not admission.queued:
            return
        now = time.monotonic()
        released = False
        for pool in list(admission.pools):
            if not admission.waiting(pool) or self.saturated(pool):
                continue
            ticket = admission.pop(pool, now)
            if ticket is None:
                continue
            entry: Entry = ticket.item  # type: ignore[assignment]
            if entry.future is None or entry.future.done():  # its client left meanwhile
                admission.done(ticket, 0, 0, now)
                continue
            entry.future.set_result(None)
            released = True
        if released:
            self.pump_soon()

    def pump_soon(self) -> None:
        """The pump, once, after what is ready to run now (a load moved, a request queued)."""
        if not self._pump_soon and self.admission.queued:
            self._pump_soon = True
            asyncio.get_running_loop().call_soon(self.pump)

    def _start_timer(self) -> None:
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        """While anything waits: the timeout sweep and the pump, every PUMP_PERIOD_S."""
        admission = self.admission
        while admission.queued:
            await asyncio.sleep(PUMP_PERIOD_S)
            now = time.monotonic()
            for ticket in admission.expire(now):
                entry: Entry = ticket.item  # type: ignore[assignment]
                waited = now - ticket.arrived
                self.metrics.waited(ticket, waited, "queue_timeout")
                message = f"waited {waited:.1f} s in the gateway's queue (flow_queue_timeout_s)"
                if entry.future is not None and not entry.future.done():
                    entry.future.set_exception(Refused("queue_timeout", 1.0, message))
            self.pump()

    def used(self, ticket: Ticket, output_tokens: int | None) -> None:
        """The worker reported the request's usage (its output tokens)."""
        entry: Entry = ticket.item  # type: ignore[assignment]
        entry.used = output_tokens is not None
        entry.output_tokens = output_tokens or 0

    def done(self, ticket: Ticket) -> None:
        """The request ended, however: its budget settled on the usage reported (unreported,
        once admitted: its reservation stands), its tokens counted, the queue pumped."""
        entry: Entry = ticket.item  # type: ignore[assignment]
        if ticket.grant is None:
            return
        if entry.used:
            self.admission.done(ticket, entry.prompt_tokens, entry.output_tokens, time.monotonic())
            self.counts.tokens(ticket, entry.prompt_tokens, entry.output_tokens)
        else:
            self.admission.done(ticket, ticket.tokens, 0, time.monotonic())
        self.pump_soon()

    def forwarded(
        self, ticket: Ticket, body: dict[str, Any], salt: str | None, plan: Plan
    ) -> tuple[bytes | None, Headers, int | None]:
        """What goes with an admitted, routed request (`plan`): the worker's body with the
        engine `priority` for workers that take it (None: the plain body does, the priority
        being 0 and the client having sent none), the budgets' headers for the client's
        answer, and the protect hint for the worker (`x-urc-protect`; None: none). A request
        admitted at once is priced here, by its routing's uncached tokens: no second match of
        its prompt."""
        headers = self.headers(ticket.tenant.budget)
        if ticket.pool.endswith(_EMBEDDINGS):
            return None, headers, None
        entry: Entry = ticket.item  # type: ignore[assignment]
        if entry.request is not None:
            worker = plan.decision.worker
            self.admission.price(ticket, plan.request.prompt_tokens - plan.matched(worker))
            entry.request = None
        public_tokens = plan.public_tokens
        priority = self.admission.engine_priority(ticket)
        hint = self.admission.protect(ticket, priority, plan.decision.worker, time.monotonic())
        if hint is not None:
            self.counts.hint(ticket)
        if not priority and "priority" not in body:
            return None, headers, hint
        return forwarded({**body, "priority": priority}, salt, public_tokens), headers, hint

    def headers(self, budget: Budget) -> Headers:
        """OpenAI's `x-ratelimit-*` headers for a tenant with budgets (none without)."""
        if not budget.rpm and not budget.tpm:
            return []
        now = time.monotonic()
        requests, tokens = budget.remaining(now)
        grants = budget.grants
        oldest = grants[0].at + WINDOW_S - now if grants else 0.0
        out: Headers = []
        if budget.rpm:
            out += [
                ("x-ratelimit-limit-requests", str(budget.rpm)),
                ("x-ratelimit-remaining-requests", str(requests)),
                ("x-ratelimit-reset-requests", _reset(oldest if not requests else 0.0)),
            ]
        if budget.tpm:
            out += [
                ("x-ratelimit-limit-tokens", str(budget.tpm)),
                ("x-ratelimit-remaining-tokens", str(tokens)),
                ("x-ratelimit-reset-tokens", _reset(oldest if budget.tokens else 0.0)),
            ]
        return out

    def refusal(self, exc: Refused, ticket: Ticket) -> tuple[Headers, bytes]:
        """A 429's headers (Retry-After in whole seconds, at least 1; the budgets') and body."""
        retry = max(1, int(exc.retry_after_s + 0.999))
        headers = [*JSON_HEADERS, ("Retry-After", str(retry)), *self.headers(ticket.tenant.budget)]
        body = APIError(429, str(exc), type="rate_limit_error", code=exc.reason).body()
        return headers, body

    def refuse(self, reply: Reply, exc: Refused, ticket: Ticket, note: RequestNote | None) -> None:
        if note is not None:
            note.failed(429, exc.reason)
        reply.whole(429, *self.refusal(exc, ticket))

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
