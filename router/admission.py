"""Admission (docs/flow-control.md): the step before the lifecycle's `route` (router/route.py).
Each request is admitted now, queued, or refused with a 429: refused when its tenant is over a
budget (router/budgets.py) or, sheddable, when its pool is saturated; queued while its pool is
saturated; admitted otherwise. Queues are per pool (kv_group): strict order between priority
bands, and within a band start-time fair queuing between flows (tenants, or a tenant's users or
sessions), each charged what its requests cost the GPU as the cost model prices them (uncached
prefill plus expected decode, in GPU seconds) over its weight. Pure and synchronous: the gateway,
the endpoint picker and the replay own the clock and the waiting."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from router.budgets import WINDOW_S, Budget, Grant
from router.policies import WorkerLoad
from router.rank_guard import RankGuard

PRIORITY_HEADER: Final = "x-urc-priority"
PROTECT_HEADER: Final = "x-urc-protect"  # to a worker: another flow's better rank sent there
DECODE_TOKEN_S: Final = 2e-4  # a decode token's GPU time in a batch (cache_aware's default)
FIRST_OUTPUT_GUESS: Final = 128  # expected output tokens before a tenant's mean is known


@dataclass(slots=True)
class FlowSettings:
    """The gateway's flow-control knobs (docs/config.md: `[gateway]` flow_*)."""

    enabled: bool = False
    saturation_ms: float = 500.0  # a worker with this much queued prefill is saturated
    queue_max: int = 1024  # queued requests per process, all pools
    queue_timeout_s: float = 30.0
    prefill_tokens_per_s: float = 15_000.0  # the fleet's (one setting: docs/policies.md)
    share: float = 1.0  # this process's part of every budget (1/N of N processes)
    protect_window_s: float = 10.0  # a flow's rank sent to a worker is protected this long


@dataclass(slots=True)
class TenantFlow:
    """A tenant's flow settings (its `[[tenants]]` table) and budget."""

    name: str
    weight: float = 1.0
    priority: int = 0  # higher first; below 0: sheddable
    fairness: str = "tenant"  # tenant | user | session: the flows that share its weight
    budget: Budget = field(default_factory=lambda: Budget(0, 0, 0))
    mean_output: float = FIRST_OUTPUT_GUESS  # of its requests so far (a moving average)
    limited_at: float = -math.inf  # when a budget last refused one of its requests


class Ticket:
    """One request through admission: its flow, band, cost and budget reservation. `item`:
    what the caller keeps with it (a waiter, the replay's request)."""

    __slots__ = (
        "tenant",
        "flow",
        "band",
        "pool",
        "cost",
        "tokens",
        "grant",
        "arrived",
        "start",
        "seq",
        "queued",
        "item",
    )

    def __init__(
        self, tenant: TenantFlow, flow: str, band: int, pool: str, cost: float, tokens: int
    ) -> None:
        self.tenant = tenant
        self.flow = flow  # the fair queue's flow: tenant, or tenant/user, tenant/session
        self.band = band  # the priority band (higher first)
        self.pool = pool  # its kv_group
        self.cost = cost  # GPU seconds as the cost model prices it
        self.tokens = tokens  # reserved against the tenant's tokens per minute
        self.grant: Grant | None = None
        self.arrived = 0.0
        self.start = 0.0  # its virtual start time in its band
        self.seq = 0
        self.queued = False
        self.item: object = None


class Refused(Exception):
    """A 429: `reason` (a budget's name, "shed", "queue_full", "queue_timeout") and when to
    retry."""

    def __init__(self, reason: str, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Band:
    """One priority band of one pool: its queue by virtual start time, and its clock."""

    __slots__ = ("heap", "vtime", "finish", "peak")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Ticket]] = []
        self.vtime = 0.0  # the start time of the last ticket let through
        self.finish: dict[str, float] = {}  # flow -> the virtual finish of its last ticket
        self.peak = 0.0  # the latest finish of any flow

    def charge(self, ticket: Ticket) -> None:
        """Stamp `ticket` with its start time and advance its flow's finish by its cost."""
        start = self.finish.get(ticket.flow, 0.0)
        if start < self.vtime:
            start = self.vtime  # an idle flow does not bank credit
        ticket.start = start
        finish = self.finish[ticket.flow] = start + ticket.cost / ticket.tenant.weight
        if finish > self.peak:
            self.peak = finish
        if len(self.finish) > 4096:  # idle flows start at vtime anyway: forget them
            vtime = self.vtime
            self.finish = {f: t for f, t in self.finish.items() if t > vtime}


def saturated(loads: Sequence[WorkerLoad], prefill_tokens_per_s: float, ms: float) -> bool:
    """Every worker of the pool has `ms` of prefill queued: one more request would only lengthen
    a queue (an empty pool is not saturated: routing answers 503 there)."""
    limit = ms * prefill_tokens_per_s / 1000.0
    for load in loads:
        if load.queued_prefill_tokens < limit:
            return False
    return bool(loads)


def saturation(loads: Sequence[WorkerLoad], prefill_tokens_per_s: float, ms: float) -> float:
    """The pool's least queued prefill over the threshold (1.0: saturated), for autoscalers."""
    if not loads:
        return 0.0
    least = min(load.queued_prefill_tokens for load in loads)
    return least / (ms * prefill_tokens_per_s / 1000.0)


class Admission:
    """The queues and budgets of one gateway process (docs/flow-control.md)."""

    def __init__(self, settings: FlowSettings, tenants: Sequence[TenantFlow]) -> None:
        self.settings = settings
        self.tenants = {t.name: t for t in tenants}
        self.pools: dict[str, dict[int, Band]] = {}
        self.guards: dict[str, dict[str, RankGuard]] = {}  # pool -> worker -> recent ranks
        self.queued = 0
        self._seq = 0

    def tenant(self, name: str) -> TenantFlow:
        flow = self.tenants.get(name)
        if flow is None:  # a tenant with no table (auth off: the shared one)
            flow = self.tenants[name] = TenantFlow(name)
        return flow

    def ticket(
        self,
        tenant: str,
        flow: str,
        pool: str,
        uncached: int,
        prompt_tokens: int,
        max_tokens: int | None,
        priority: int | None = None,
    ) -> Ticket:
        """A request of `tenant` (its flow key `flow`) for `pool`: its band (the tenant's
        priority, or the request's own `priority` header), its cost and its token reservation."""
        t = self.tenant(tenant)
        output = t.mean_output if max_tokens is None else min(max_tokens, t.mean_output)
        cost = uncached / self.settings.prefill_tokens_per_s + output * DECODE_TOKEN_S
        tokens = prompt_tokens + (max_tokens if max_tokens is not None else int(output))
        band = t.priority if priority is None else priority
        return Ticket(t, flow, band, pool, cost, tokens)

    def busy(self, pool: str, saturated: bool) -> bool:
        """Whether a request for `pool` would queue (saturated, or others wait): only then must
        its price be known before it is admitted (`price`); else it may be priced after its
        routing found the uncached tokens (`price` again, with them)."""
        return saturated or self.waiting(pool)

    def price(self, ticket: Ticket, uncached: int) -> None:
        """Charge `ticket` for `uncached` prompt tokens: before `arrive`, its cost; after it was
        admitted at once, its flow's finish moves by the difference."""
        added = uncached / self.settings.prefill_tokens_per_s
        ticket.cost += added
        if ticket.grant is not None:
            band = self.pools[ticket.pool][ticket.band]
            band.finish[ticket.flow] = (
                band.finish.get(ticket.flow, 0.0) + added / ticket.tenant.weight
            )

    def arrive(self, ticket: Ticket, saturated: bool, now: float) -> bool:
        """True: go now (budget granted); False: queued until `pop` hands it out. Raises
        Refused: over budget, sheddable while saturated, or the queue full."""
        budget = ticket.tenant.budget
        refusal = budget.refusal(ticket.tokens, now)
        if refusal is not None:
            ticket.tenant.limited_at = now
            reason, retry_s = refusal
            message = f"tenant '{ticket.tenant.name}' is over its {reason.replace('_', ' ')}"
            raise Refused(reason, retry_s, message)
        if saturated and ticket.band < 0:
            message = "the pool is saturated and this request is sheddable: retry later"
            raise Refused("shed", 1.0, message)
        bands = self.pools.get(ticket.pool)
        if bands is None:
            bands = self.pools[ticket.pool] = {}
        band = bands.get(ticket.band)
        if band is None:  # made once per (pool, band), not per request
            band = bands[ticket.band] = Band()
        ticket.arrived = now
        if not saturated and not self.waiting(ticket.pool):
            band.charge(ticket)
            band.vtime = ticket.start
            ticket.grant = budget.grant(ticket.tokens, now)
            return True
        band.charge(ticket)
        if self._overtakes(ticket, band):
            ticket.grant = budget.grant(ticket.tokens, now)
            return True
        if self.queued >= self.settings.queue_max:
            message = f"the gateway's queue is full ({self.settings.queue_max} requests)"
            raise Refused("queue_full", 1.0, message)
        self._seq += 1
        ticket.seq = self._seq
        ticket.queued = True
        heapq.heappush(band.heap, (ticket.start, ticket.seq, ticket))
        self.queued += 1
        return False

    def _overtakes(self, ticket: Ticket, band: Band) -> bool:
        """Whether `ticket` (charged) goes at once although its pool is saturated: a request the
        engines rank ahead of the work that saturates the pool does not lengthen its queue. So
        when it is first in line (no higher band waits, none of its band starts before it), its
        flow is not ahead of its share (its engine priority is its band's best), and the work
        in flight ranks after it: another flow of its band is ahead of its share, or a lower
        band is in use."""
        bands = self.pools[ticket.pool]
        if band.heap and band.heap[0][0] < ticket.start:
            return False
        slack = self.settings.saturation_ms / 1e3
        if band.finish[ticket.flow] - band.vtime > slack:
            return False
        lower = False
        for priority, other in bands.items():
            if priority > ticket.band and other.heap:
                return False
            lower = lower or priority < ticket.band
        return lower or band.peak - band.vtime > slack

    def pop(self, pool: str, now: float) -> Ticket | None:
        """The next ticket of `pool` (its highest band, the earliest start there), granted its
        budget; None when none waits. Call while the pool is not saturated."""
        bands = self.pools.get(pool)
        if not bands:
            return None
        for priority in sorted(bands, reverse=True):
            band = bands[priority]
            if band.heap:
                ticket = heapq.heappop(band.heap)[2]
                band.vtime = ticket.start
                self.queued -= 1
                ticket.queued = False
                ticket.grant = ticket.tenant.budget.grant(ticket.tokens, now)
                return ticket
        return None

    def engine_priority(self, ticket: Ticket) -> int:
        """The `priority` the worker gets (vLLM's sense: lower first): its band, and within it
        one step later while its flow is ahead of its fair share by more than the saturation
        threshold, or its tenant had a request refused by a budget within the minute before it
        arrived, so the engine too serves the others' requests first."""
        band = self.pools[ticket.pool][ticket.band]
        ahead = band.finish.get(ticket.flow, 0.0) - band.vtime > self.settings.saturation_ms / 1e3
        pressing = ticket.tenant.limited_at > ticket.arrived - WINDOW_S
        return -2 * ticket.band + (1 if ahead or pressing else 0)

    def protect(self, ticket: Ticket, priority: int, worker: str, now: float) -> int | None:
        """`ticket` goes to `worker` `now` at engine `priority`: the better rank another flow
        was sent to it at within `protect_window_s`, which the worker must protect (None:
        none; router/rank_guard.py)."""
        window = self.settings.protect_window_s
        if not window:
            return None
        workers = self.guards.get(ticket.pool)
        if workers is None:
            workers = self.guards[ticket.pool] = {}
        guard = workers.get(worker)
        if guard is None:
            guard = workers[worker] = RankGuard()
        return guard.note(ticket.flow, priority, now, window)

    def waiting(self, pool: str) -> bool:
        bands = self.pools.get(pool)
        return bands is not None and any(band.heap for band in bands.values())

    def expire(self, now: float) -> list[Ticket]:
        """The queued tickets past the queue timeout, taken out of their queues."""
        deadline = now - self.settings.queue_timeout_s
        late: list[Ticket] = []
        for bands in self.pools.values():
            for band in bands.values():
                if band.heap and any(t.arrived <= deadline for _, _, t in band.heap):
                    late += [t for _, _, t in band.heap if t.arrived <= deadline]
                    band.heap = [e for e in band.heap if e[2].arrived > deadline]
                    heapq.heapify(band.heap)
        for ticket in late:
            ticket.queued = False
        self.queued -= len(late)
        return late

    def withdraw(self, ticket: Ticket) -> None:
        """A queued ticket whose client left: out of its queue."""
        if not ticket.queued:
            return
        band = self.pools[ticket.pool][ticket.band]
        band.heap = [e for e in band.heap if e[2] is not ticket]
        heapq.heapify(band.heap)
        ticket.queued = False
        self.queued -= 1

    def done(self, ticket: Ticket, input_tokens: int, output_tokens: int, now: float) -> None:
        """The request ended: its budget settled on its usage, its tenant's mean output
        learnt (a request that never ran: zeros, nothing learnt)."""
        if ticket.grant is None:
            return
        tenant = ticket.tenant
        tenant.budget.settle(ticket.grant, input_tokens + output_tokens, now)
        ticket.grant = None
        if output_tokens:
            tenant.mean_output += (output_tokens - tenant.mean_output) * 0.1

    def queue_depths(self) -> dict[tuple[str, int], int]:
        """(tenant, band) -> its queued requests."""
        depths: dict[tuple[str, int], int] = {}
        for bands in self.pools.values():
            for priority, band in bands.items():
                for _, _, ticket in band.heap:
                    key = (ticket.tenant.name, priority)
                    depths[key] = depths.get(key, 0) + 1
        return depths
