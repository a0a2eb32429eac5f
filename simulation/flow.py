"""Flow control in the replay (docs/flow-control.md, "In the replay"): the gateway's admission
(router/admission.py) on the virtual clock. Each arriving request gets a ticket (its tenant's
flow and band, what its uncached prompt costs); it goes now, waits in its pool's queue while the
pool is saturated, or is refused. The replay routes a waiting request when its pool's load
ledger moves and the pool is no longer saturated, and fails it when it waits too long."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

from router.admission import Admission, FlowSettings, Refused, TenantFlow, Ticket, saturated
from router.budgets import Budget
from router.policies import WorkerLoad
from router.route import Routing
from simulation.requests import SimRequest

SHARED_TENANT: Final = "default"  # a request without a tenant (the gateway's, auth off)
GO: Final = 0  # route it now
WAIT: Final = 1  # queued: the replay routes it when `next` hands it out
REFUSED: Final = 2  # a 429: the request fails
QUEUE_TIMEOUT: Final = "queue_timeout"

# `--tenant-flow NAME:KEY=VALUE,...`: the keys of a gateway's [[tenants]] table that the replay
# takes (docs/config.md), and their types
TENANT_KEYS: Final[dict[str, type]] = {
    "weight": float,
    "priority": int,
    "requests_per_minute": int,
    "tokens_per_minute": int,
    "max_concurrent_requests": int,
}


@dataclass(slots=True)
class FlowConfig:
    """The replay's flow-control settings (its prefill speed is the fleet's) and tenants."""

    settings: FlowSettings = field(default_factory=lambda: FlowSettings(enabled=True))
    tenants: list[TenantFlow] = field(default_factory=list)

    def admission(self, prefill_tokens_per_s: float) -> Admission:
        """A fresh admission for one run: its own queues, budgets and learnt means."""
        settings = FlowSettings(
            enabled=True,
            saturation_ms=self.settings.saturation_ms,
            queue_max=self.settings.queue_max,
            queue_timeout_s=self.settings.queue_timeout_s,
            prefill_tokens_per_s=prefill_tokens_per_s,
            protect_window_s=self.settings.protect_window_s,
        )
        fresh = []
        for t in self.tenants:
            b = t.budget
            budget = Budget(b.rpm, b.tpm, b.max_concurrent)
            fresh.append(TenantFlow(t.name, t.weight, t.priority, t.fairness, budget))
        return Admission(settings, fresh)

    def describe(self) -> dict[str, Any]:
        """The report's `config.flow`."""
        s = self.settings
        tenants = {
            t.name: {
                "weight": t.weight,
                "priority": t.priority,
                "requests_per_minute": t.budget.rpm,
                "tokens_per_minute": t.budget.tpm,
                "max_concurrent_requests": t.budget.max_concurrent,
            }
            for t in self.tenants
        }
        return {
            "saturation_ms": s.saturation_ms,
            "queue_max": s.queue_max,
            "queue_timeout_s": s.queue_timeout_s,
            "tenants": tenants,
        }


def parse_tenant_flow(text: str) -> TenantFlow:
    """`NAME:weight=2,priority=1,tokens_per_minute=100000` -> its TenantFlow; ValueError."""
    name, colon, rest = text.partition(":")
    name = name.strip()
    if not colon or not name:
        raise ValueError(f"--tenant-flow wants NAME:KEY=VALUE,..., got {text!r}")
    values: dict[str, float] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in TENANT_KEYS:
            known = ", ".join(TENANT_KEYS)
            raise ValueError(f"--tenant-flow {text!r}: {item!r} is not KEY=VALUE ({known})")
        number = TENANT_KEYS[key](value.strip())
        if number < 0 or (key == "weight" and number <= 0):
            raise ValueError(f"--tenant-flow {text!r}: {key} must be positive")
        values[key] = number
    budget = Budget(
        int(values.get("requests_per_minute", 0)),
        int(values.get("tokens_per_minute", 0)),
        int(values.get("max_concurrent_requests", 0)),
    )
    return TenantFlow(
        name, values.get("weight", 1.0), int(values.get("priority", 0)), budget=budget
    )


class Flow:
    """One run's admission over the replay's routing and its pools' loads; `tickets` and
    `arrived` are indexed like the requests."""

    def __init__(
        self,
        config: FlowConfig,
        prefill_tokens_per_s: float,
        routing: Routing,
        loads: dict[str, list[WorkerLoad]],
        n: int,
    ) -> None:
        self.admission = config.admission(prefill_tokens_per_s)
        self.routing = routing
        self.loads = loads
        self.tickets: list[Ticket | None] = [None] * n
        self.arrived = [math.nan] * n  # when the client sent it (its TTFT counts from here)
        self.refused: dict[int, str] = {}  # request -> the reason of its 429
        self._queued: deque[Ticket] = deque()  # in arrival order; ones gone are skipped lazily

    def saturated(self, pool: str) -> bool:
        s = self.admission.settings
        return saturated(self.loads[pool], s.prefill_tokens_per_s, s.saturation_ms)

    def arrive(self, req: SimRequest, now: float) -> int:
        """GO, WAIT or REFUSED (counted): its ticket charged what its uncached prompt costs."""
        request = req.route
        tenant = req.tenant or SHARED_TENANT
        uncached = self.routing.uncached(request, now)
        admission = self.admission
        pool = req.kv_group  # its workers: an adapter's base's
        ticket = admission.ticket(
            tenant, tenant, pool, uncached, request.prompt_tokens, req.max_tokens
        )
        ticket.item = req
        self.tickets[req.index] = ticket
        self.arrived[req.index] = now
        try:
            if admission.arrive(ticket, self.saturated(pool), now):
                return GO
        except Refused as refusal:
            self.refused[req.index] = refusal.reason
            return REFUSED
        self._queued.append(ticket)
        return WAIT

    def next(self, pool: str, now: float) -> SimRequest | None:
        """A waiting request of `pool` to route now (None: none waits, or it is saturated)."""
        admission = self.admission
        if not admission.waiting(pool) or self.saturated(pool):
            return None
        ticket = admission.pop(pool, now)
        return None if ticket is None else cast(SimRequest, ticket.item)

    def deadline(self) -> float:
        """When the longest-waiting request times out (inf: none waits)."""
        queued = self._queued
        while queued and not queued[0].queued:
            queued.popleft()
        if not queued:
            return math.inf
        return queued[0].arrived + self.admission.settings.queue_timeout_s

    def expire(self, now: float) -> list[SimRequest]:
        """The requests that have waited the queue timeout by `now`: refused, out of the queue."""
        late = self.admission.expire(now + 1e-9)  # its deadline, less float rounding
        for ticket in late:
            self.refused[cast(SimRequest, ticket.item).index] = QUEUE_TIMEOUT
        return [cast(SimRequest, t.item) for t in late]

    def rank(self, i: int, worker: str, now: float) -> tuple[int, int | None]:
        """The engine priority of request `i` as it is sent to `worker` `now` (vLLM's sense:
        lower first), and the better rank that worker must protect (None: none)."""
        ticket = cast(Ticket, self.tickets[i])
        priority = self.admission.engine_priority(ticket)
        return priority, self.admission.protect(ticket, priority, worker, now)

    def done(self, i: int, input_tokens: int, output_tokens: int, now: float) -> None:
        """Request `i` ended (zeros: it never ran): its budget settled."""
        self.admission.done(cast(Ticket, self.tickets[i]), input_tokens, output_tokens, now)


def refusals(refused: dict[int, str]) -> dict[str, int]:
    """The 429s by reason."""
    counts: dict[str, int] = {}
    for reason in refused.values():
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def tenant_names(requests: Sequence[SimRequest]) -> list[str]:
    """The tenants of `requests`, in order of first appearance (none: [])."""
    if all(r.tenant is None for r in requests):
        return []
    return list(dict.fromkeys(r.tenant or SHARED_TENANT for r in requests))
