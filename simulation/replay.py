"""The discrete-event replay (docs/dispatch.md, "The replay does the same"): requests through
the gateway's index and policy to emulated workers in virtual time."""

from __future__ import annotations

import gc
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Final, cast

from backends.emulated.config import EngineConfig
from backends.emulated.request import Request
from core.heap import Heap
from router.adapters import DEFAULT_LOAD_S, Adapters
from router.index import DEFAULT_APPROX_TTL_S, UnifiedIndex
from router.policies import Policy, WorkerLoad
from router.route import LoadShare, Routing
from simulation.client import INF, Client
from simulation.flow import GO, REFUSED, Flow, FlowConfig
from simulation.requests import SimRequest
from simulation.sim_worker import Change, SimWorker, adapter_counts, sim_adapters

if TYPE_CHECKING:
    from simulation.rollout import ReplayRollout

EXPIRE_EVERY_S: Final = 0.5  # residency expires as often as the gateway checks health (0.5 s)


@dataclass(slots=True)
class FleetConfig:
    """The fleet (each worker an emulated engine of `engine`'s settings), the gateway's settings
    and the client."""

    workers: int = 8
    names: list[str] | None = None  # worker names (default w0, w1, ...): rendezvous hashes them
    engine: EngineConfig = field(default_factory=EngineConfig)  # every worker's
    max_model_len: int = 0  # 0: the worker's default (context_len)
    event_delay_s: float = 0.002
    # what a live request's HTTP, gateway and event loops add to its TTFT and latency (both
    # ways together); the engines' timing is unchanged by it
    hop_s: float = 0.0
    kv_events: bool = True  # False: approximate residency from routing history
    approx_ttl_s: float = DEFAULT_APPROX_TTL_S
    pending_ttl_s: float = 0.0  # dispatched keys held until confirmed, e.g. 10 (0: off)
    index_max_blocks: int = 20_000_000
    concurrency: int | None = None  # closed loop with this many in flight; None: open loop
    max_in_flight: int = 1024  # the open loop's cap (the bench's --max-in-flight)
    # LoRA adapters (docs/adapters.md): the gateway's load call before a worker has one (its
    # slots, sizes and activation time are the engine's: max_loras, lora_default_mb, ...)
    adapter_load_s: float = DEFAULT_LOAD_S

    def worker_names(self) -> list[str]:
        names = self.names or [f"w{i}" for i in range(self.workers)]
        if len(names) != self.workers or len(set(names)) != len(names):
            raise ValueError("need one distinct name per worker")
        return list(names)

    def context_len(self) -> int:
        """`max_model_len`, or the emulated worker's default: min(capacity, 131072)."""
        return self.max_model_len or min(self.engine.capacity_tokens, 131_072)

    def engine_config(self) -> EngineConfig:
        """`engine` as a simulated worker runs it."""
        return replace(
            self.engine,
            report_tokens=False,
            emit_events=False,  # the simulated workers listen to their caches (worker.py)
            event_tokens=False,
        )


@dataclass(slots=True)
class RunResult:
    """Everything one policy's run measured; per-request lists are indexed like the requests
    (a request never sent has worker -1)."""

    workers: list[str]
    sent_s: list[float]
    worker: list[int]
    predicted_tokens: list[int]
    cached_tokens: list[int]  # both tiers
    host_tokens: list[int]  # of those, promoted from the host tier
    ttft_s: list[float]  # nan when it never produced a token (rejected, or dropped)
    latency_s: list[float]
    ok: list[bool]
    reasons: Counter[str]
    dropped: int
    index_peak_blocks: int
    index_blocks: int
    index_runs: int
    index_residencies: int
    events_applied: int
    engine_steps: int
    refused: dict[int, str] = field(default_factory=dict)  # flow control's 429s: request -> why
    adapters: dict[str, int] = field(default_factory=dict)  # LoRA: loads, evictions, unloads


class Replay:
    """One policy over one fleet: `Replay(requests, policy, fleet).run()`."""

    def __init__(
        self,
        requests: Sequence[SimRequest],
        policy: Policy,
        fleet: FleetConfig,
        *,
        per_step: bool = False,
        flow: FlowConfig | None = None,
        rollout: ReplayRollout | None = None,
    ) -> None:
        self.requests = list(requests)
        self.policy = policy
        self.rollout = rollout  # a rollout's plan: each conversation's arm picks the policy
        self.fleet = fleet
        # an event per forward pass, as in real time: the same outcome, slower (a bench baseline)
        self.per_step = per_step
        if any(r.route.block_size != fleet.engine.block_size for r in self.requests):
            raise ValueError("requests are keyed with another block size than the fleet's")
        config = fleet.engine_config()
        limit = fleet.context_len()
        groups = sorted({r.kv_group for r in self.requests}) or ["emulated"]
        names = fleet.worker_names()
        if len(names) < len(groups):
            raise ValueError(f"{len(groups)} kv_groups need at least as many workers")
        self.index = UnifiedIndex(
            max_blocks=fleet.index_max_blocks,
            approx_ttl_s=fleet.approx_ttl_s,
            pending_ttl_s=fleet.pending_ttl_s,
        )
        adapters = {r.route.adapter for r in self.requests if r.route.adapter}
        self.adapters = sim_adapters(adapters, fleet) if adapters else None  # LoRA: priced
        self.routing = Routing(self.index, self.adapters)  # the gateway's request lifecycle
        # one kv_group per worker (its event stream carries no model): groups take turns
        self.workers = [
            SimWorker(name, groups[i % len(groups)], config, limit, self.index, fleet.kv_events)
            for i, name in enumerate(names)
        ]
        self.loads: dict[str, list[WorkerLoad]] = {}  # kv_group -> its workers' loads
        for w in self.workers:
            self.loads.setdefault(w.kv_group, []).append(w.load)
        self.by_name = {w.name: w for w in self.workers}
        self._expires = not fleet.kv_events or fleet.pending_ttl_s > 0  # what the gateway writes
        self.client = Client(self.requests, fleet.concurrency, fleet.max_in_flight)
        n = len(self.requests)
        self._sent = [math.nan] * n
        self._worker = [-1] * n
        self._predicted = [0] * n
        self._shares: list[LoadShare | None] = [None] * n
        self._engine_req: list[Request | None] = [None] * n
        self._worker_index = {w.name: i for i, w in enumerate(self.workers)}
        self._heap: Heap[SimWorker] = Heap()  # workers by the time of their next step call
        self._kv: deque[tuple[float, SimWorker, list[Change]]] = deque()
        self._reasons: dict[str, int] = {}  # a plain dict: a Counter's += runs Python code
        self._peak = 0
        self._events = 0
        self._steps = 0
        self._next_expire = 0.0
        self.flow: Flow | None = None  # flow control (simulation/flow.py), off: None
        if flow is not None:
            speed = fleet.engine.prefill_tokens_per_s
            self.flow = Flow(flow, speed, self.routing, self.loads, n)

    def run(self, progress: Callable[[int], None] | None = None) -> RunResult:
        """Replay every request, `progress(sent)` every 1024 sends; GC off (docs/compiled.md)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._loop(progress)
        finally:
            if collecting:
                gc.enable()
        self._deliver(INF)
        return self._result()

    def _loop(self, progress: Callable[[int], None] | None) -> None:
        heap = self._heap
        client = self.client
        flow = self.flow
        sent = 0
        while True:
            t_send = client.next_at
            if flow is not None and self._time_out(flow, t_send):
                continue
            if self._expires:
                t_next = heap.peek().key if len(heap) and heap.peek().key < t_send else t_send
                if self._next_expire <= t_next < INF:
                    self._expire(t_next)
            if len(heap) and heap.peek().key < t_send:
                entry = heap.pop()
                w = entry.item
                if entry.seq == w.wake_seq:
                    self._step(w, entry.key)
            elif t_send < INF:
                for req in client.poll(t_send):
                    if flow is None:
                        self._route(req, t_send)
                    else:
                        self._admit(flow, req, t_send)
                    sent += 1
                    if progress is not None and not sent & 1023:
                        progress(sent)
            else:
                break

    def _schedule(self, w: SimWorker) -> None:
        """Queue the worker's next step call (at most one valid heap entry per worker)."""
        t = w.next_time(self.per_step)
        if t is None:
            w.wake_seq = -1
        elif t != w.wake or w.wake_seq < 0:
            w.wake, w.wake_seq = t, self._heap.push(t, w)

    def _expire(self, now: float) -> None:
        """The gateway's health-interval sweep, at the last tick due by `now` (ticks with
        nothing between them sweep the same), after the events due by then."""
        ticks = (now - self._next_expire) // EXPIRE_EVERY_S
        tick = self._next_expire + ticks * EXPIRE_EVERY_S
        self._deliver(tick)
        self.routing.expire(tick)
        self._next_expire = tick + EXPIRE_EVERY_S

    def _time_out(self, flow: Flow, t_send: float) -> bool:
        """Fail the queued requests whose wait ends before the next send or step, at that
        moment (True: some did)."""
        deadline = flow.deadline()
        heap = self._heap
        if deadline == INF or deadline > t_send or (len(heap) and deadline > heap.peek().key):
            return False
        late = flow.expire(deadline)
        for req in late:
            self.client.complete(req, False, deadline)
        return bool(late)

    def _admit(self, flow: Flow, req: SimRequest, now: float) -> None:
        """Flow control's step before routing: go now, wait for `_release`, or fail (429)."""
        if self._kv and self._kv[0][0] <= now:
            self._deliver(now)
        state = flow.arrive(req, now)
        if state == GO:
            self._route(req, now)
        elif state == REFUSED:
            self.client.complete(req, False, now)
        else:
            self._release(flow, req.kv_group, now)

    def _release(self, flow: Flow, pool: str, now: float) -> None:
        """Route `pool`'s waiting requests while it is not saturated, against the loads of
        `now` (each one routed moves them)."""
        while (req := flow.next(pool, now)) is not None:
            self._route(req, now)

    def _route(self, req: SimRequest, now: float) -> None:
        if self._kv and self._kv[0][0] <= now:
            self._deliver(now)
        request = req.route
        policy = self.policy if self.rollout is None else self.rollout.policy_for(req, now)
        route = self.routing.route(request, self.loads[req.kv_group], policy, now)
        decision = route.decision
        w = self.by_name[decision.worker]
        reasons = self._reasons
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        i = req.index
        self._sent[i] = now
        self._worker[i] = self._worker_index[w.name]
        self._predicted[i] = route.matched(w.name)
        share = self._shares[i] = route.attempt(
            w.name, request.kv_group, self.fleet.kv_events, w.load, now
        )
        if request.prompt_tokens + req.max_tokens > w.max_model_len:
            self._reject(req, share, now)
            return
        engine_req = Request(i, req.prompt, req.max_tokens, req.salt, now, req.keys, req.tail_keys)
        if self.flow is not None:  # the gateway's rank, carried into the engine
            engine_req.priority, engine_req.protect = self.flow.rank(i, w.name, now)
        if request.adapter:  # loaded there first: it reaches the engine when registered
            engine_req.lora_name = request.adapter
            load_s = self.fleet.adapter_load_s
            if w.take_adapter(cast(Adapters, self.adapters), engine_req, now, load_s) > now:
                self._engine_req[i] = engine_req
                self._schedule(w)
                return
        try:
            w.engine.submit(engine_req)
        except ValueError:
            self._reject(req, share, now)
            return
        self._engine_req[i] = engine_req
        self._schedule(w)

    def _reject(self, req: SimRequest, share: LoadShare, now: float) -> None:
        """The worker answers 400 (too long): the gateway's load comes back, the turn fails."""
        share.finish()
        if self.rollout is not None:
            self.rollout.failed(req)
        if self.flow is not None:
            self.flow.done(req.index, 0, 0, now)
        self.client.complete(req, False, now)

    def _step(self, w: SimWorker, now: float) -> None:
        """Step `w` at `now`, and again at each of its next times that comes before anything
        else (a send, another worker's step): the heap would hand it straight back."""
        engine = w.engine
        client = self.client
        heap = self._heap
        requests = self.requests
        shares = self._shares
        sent = self._sent
        routing = self.routing
        exact = self.fleet.kv_events
        per_step = self.per_step
        flow = self.flow
        rollout = self.rollout
        while True:
            if w.pending:
                w.submit_ready(now)
            result = engine.step(now)
            self._steps += 1
            if self.adapters is not None:  # its load report: the adapters in its slots
                self.adapters.observe_active(w.name, engine.adapters.slots.active_names(), 0)
            for r in result.first_token:  # the gateway's first byte
                cast(LoadShare, shares[r.rid]).first_token()
            if result.finished:
                for r in result.finished:
                    i = r.rid
                    cast(LoadShare, shares[i]).finish()
                    req = requests[i]
                    route = req.route
                    routing.done(route, w.name, route.kv_group, exact, sent[i], now)
                    if route.adapter:
                        cast(Adapters, self.adapters).finish(w.name, route.adapter)
                    if rollout is not None:  # its guardrails: what the worker reported
                        ttft = cast(float, r.first_token_time) - sent[i]
                        rollout.served(req, self._predicted[i], r.cached_tokens, ttft)
                    if flow is not None:
                        flow.done(i, len(req.prompt), r.generated, now)
                    client.complete(req, True, now)
            if flow is not None and (result.first_token or result.finished):
                self._release(flow, w.kv_group, now)  # its load ledger moved
            if w.changes:
                self._kv.append((now + self.fleet.event_delay_s, w, w.changes))
                w.changes = []
            # this call consumed the worker's heap entry
            t = w.next_time(per_step)
            if t is None:
                w.wake_seq = -1
                return
            if t < client.next_at and (not len(heap) or t < heap.peek().key):
                if flow is not None and flow.deadline() <= t:
                    w.wake, w.wake_seq = t, heap.push(t, w)
                    return
                now = t  # it would be the next event: no heap round trip
                continue
            w.wake, w.wake_seq = t, heap.push(t, w)
            return

    def _deliver(self, now: float) -> None:
        """Apply every event batch due by `now`, in order, through each worker's mirror."""
        kv = self._kv
        applied = 0
        while kv and kv[0][0] <= now:
            due, w, changes = kv.popleft()
            w.apply(changes, due)
            applied += len(changes)
        self._events += applied
        size = len(self.index)
        if size > self._peak:
            self._peak = size

    def _result(self) -> RunResult:
        n = len(self.requests)
        nan = math.nan
        cached = [0] * n
        host = [0] * n
        ttft = [nan] * n
        latency = [nan] * n
        ok = [False] * n
        arrived = self._sent if self.flow is None else self.flow.arrived
        hop = self.fleet.hop_s
        for i, r in enumerate(self._engine_req):
            if r is None or r.finish_time is None:
                continue
            sent = arrived[i] - hop
            cached[i] = r.cached_tokens
            host[i] = r.host_tokens
            ttft[i] = r.first_token_time - sent  # type: ignore[operator]
            latency[i] = r.finish_time - sent
            ok[i] = True
        stats = self.index.stats()
        lora = {} if self.adapters is None else adapter_counts(self.workers, self.adapters)
        return RunResult(
            workers=[w.name for w in self.workers],
            sent_s=arrived,
            worker=self._worker,
            predicted_tokens=self._predicted,
            cached_tokens=cached,
            host_tokens=host,
            ttft_s=ttft,
            latency_s=latency,
            ok=ok,
            reasons=Counter(self._reasons),
            dropped=self.client.dropped,
            index_peak_blocks=self._peak,
            index_blocks=stats.blocks,
            index_runs=stats.runs,
            index_residencies=stats.residencies,
            events_applied=self._events,
            engine_steps=self._steps,
            refused={} if self.flow is None else self.flow.refused,
            adapters=lora,
        )
