"""The emulated GPU engine: continuous batching over a real radix KV cache, in modelled time; a
pure state machine (the driver passes the time in). The model: docs/workers.md."""

from __future__ import annotations

import math
from collections import deque
from functools import partial
from typing import Any, Final

from backends.cache.check import check, check_locks
from backends.cache.host import HostTier
from backends.cache.radix import RadixCache
from backends.cache.scopes import Invalidated, SaltTest, invalidate_tiers
from backends.emulated.adapters import EmulatedAdapters
from backends.emulated.config import EngineConfig
from backends.emulated.events import EventLog
from backends.emulated.paging import admit, cache_output, cache_prompt, release
from backends.emulated.request import EngineLoad, Request, State, StepResult, by_priority, ranks
from backends.emulated.step_budget import StepBudget
from core.blocks import block_keys
from core.heap import Heap
from core.kv_events import MEDIUM_CPU, KVEvent

_EPS: Final = 1e-9  # float slack when counting steps between two times

# the members as Final names: compiled, a constant instead of a lookup in the hot paths
_WAITING: Final = State.WAITING
_PREFILL: Final = State.PREFILL
_DECODE: Final = State.DECODE
_FINISHED: Final = State.FINISHED
_ABORTED: Final = State.ABORTED


class EmulatedEngine:
    """Continuous batching over a RadixCache; see the module doc. Drive it with `submit`,
    `step(now)` at `next_time()` (or every `next_step_time()`), and `abort`."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self._tokens_out = cfg.emit_events and cfg.event_tokens  # events carry token ids
        self.log = log = EventLog(cfg.block_size, cfg.event_tokens)
        tiered = cfg.host_capacity_tokens > 0
        self.cache = RadixCache(
            cfg.capacity_tokens,
            cfg.block_size,
            keep_tokens=tiered and self._tokens_out,  # a demotion's event carries them
            on_stored=log.stored if cfg.emit_events else None,
            on_removed=log.removed if cfg.emit_events else None,
        )
        self.host: HostTier | None = None  # under it (docs/tiers.md): unpaged, no KV here
        if tiered:
            self.host = HostTier(
                cfg.host_capacity_tokens,
                cfg.block_size,
                on_stored=partial(log.stored, medium=MEDIUM_CPU) if cfg.emit_events else None,
                on_removed=partial(log.removed, medium=MEDIUM_CPU) if cfg.emit_events else None,
            )
            self.host.attach(self.cache)
        self.adapters = EmulatedAdapters(cfg, self.cache, self.host, log)  # LoRA slots
        self._queue: deque[Request] = deque()  # arrival order
        # waiting or prefilling requests with a non-zero priority: while any, planning ranks
        self._ranked = 0
        self._guard = StepBudget(cfg.protect_tokens(), cfg.protect_window_s)  # caps worse ranks
        self._prefilling: list[Request] = []  # admission order
        self._decoding: dict[Any, Request] = {}
        self._finishing: Heap[Request] = Heap()  # decoding requests by their last step
        self._steps = 0  # forward passes completed
        # the segment in flight: `seg_k` equal steps of `seg_d` seconds from `seg_start`,
        # `seg_done` of them already accounted; `seg_chunks` is the prefill of its one step
        self._active = False
        self._seg_start = self._seg_d = 0.0
        self._seg_k = self._seg_done = 0
        self._seg_chunks: list[tuple[Request, int]] = []
        self._blocked = False  # the queue head did not fit at the last planning
        # the head that last did not fit: it, the room it needed, the blocks it matched
        self._stuck: tuple[Request, int, int] | None = None
        self._queued_prefill = self.finished_requests = self.generated_tokens = 0
        self.prompt_tokens = self.cached_tokens = self.host_hit_tokens = 0  # cached: both tiers

    # -- KV events ---------------------------------------------------------------------------

    def invalidate(self, scope: SaltTest | None, kv_group: str | None = None) -> Invalidated:
        """Scoped invalidation of both tiers (backends/cache/scopes.py) of one tree (the base
        model's "", an adapter's by its name; None: all). What the step in flight cached is
        announced first, so its BlockStored comes before the BlockRemoved."""
        self.log.release()
        return invalidate_tiers(self.cache, self.host, scope, kv_group)

    def drain_events(self) -> list[KVEvent]:
        """Events not yet handed out by a step (an invalidation's, and any before it), in order."""
        return self.log.drain()

    # -- the driver's API --------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue `req` (arrived at `req.arrival`). ValueError when it can never run."""
        cfg = self.config
        prompt_len = len(req.prompt)
        if not prompt_len or req.max_tokens < 1:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        # its footprint: the KV it holds at its peak (the last output token has none)
        if prompt_len + req.max_tokens - 1 > self.cache.capacity_tokens:
            raise ValueError(
                f"prompt + max_tokens ({prompt_len} + {req.max_tokens}) exceeds the KV "
                f"capacity of {self.cache.capacity_tokens} tokens"
            )
        if req.public_blocks:  # only a salted prompt has a public part, of its full blocks
            full = prompt_len // cfg.block_size
            req.public_blocks = min(req.public_blocks, full) if req.cache_salt else 0
        if req.lora_name is not None:  # ValueError when not loaded
            req.lora = self.adapters.resolve(req.lora_name)
        if req.keys is None:
            salt, public, lora = req.cache_salt, req.public_blocks, req.lora_name
            req.keys = block_keys(req.prompt, cfg.block_size, salt, public, lora)
        req.prompt_len = prompt_len
        req.state = _WAITING
        self._queue.append(req)
        self._queued_prefill += req.prompt_len
        if ranks(req):
            self._ranked += 1
        running = len(self._prefilling) + len(self._decoding)
        stuck = self._stuck  # ranked before the request that last did not fit: it goes first
        outranks = stuck is not None and req.priority < stuck[0].priority
        if self._active and running < cfg.max_batch and (not self._blocked or outranks):
            self._cut(req.arrival)

    def abort(self, req: Request, now: float) -> bool:
        """Drop a request (its client went away). Its room and locks are released now; blocks
        it already cached stay cached. False when it had already finished."""
        if ranks(req) and (req.state is _WAITING or req.state is _PREFILL):
            self._ranked -= 1
        if req.state is _WAITING:
            self._queue.remove(req)
            self._queued_prefill -= req.prompt_len
            if self._active and self._blocked:  # the head may have been what blocked the queue
                self._blocked = False
                self._cut(now)
        elif req.state is _PREFILL or req.state is _DECODE:
            if req.state is _PREFILL:
                self._prefilling.remove(req)
                self._queued_prefill -= req.prompt_len - req.computed
            else:
                del self._decoding[req.rid]
            release(self.cache, req)
            if self._active:
                self._cut(now)  # the batch changed: replan after the step in flight
        else:
            return False
        req.state = _ABORTED
        req.finish_time = now
        return True

    def _cut(self, t: float) -> None:
        """End the segment at the first step boundary at or after `t` (at least one step)."""
        j = max(1, math.ceil((t - self._seg_start) / self._seg_d - _EPS))
        if j < self._seg_k:
            self._seg_k = max(j, self._seg_done)

    def next_time(self) -> float | None:
        """When calling `step` next changes more than token counts: the end of the segment in
        flight, or the arrival of the first queued request; None when idle."""
        if self._active:
            return self._seg_start + self._seg_k * self._seg_d
        return self._queue[0].arrival if self._queue else None

    def next_step_time(self) -> float | None:
        """The end of the step in flight (a real-time loop streams tokens step by step); the
        segment's end when a submission cut it at the boundary just accounted."""
        if self._active:
            return self._seg_start + min(self._seg_done + 1, self._seg_k) * self._seg_d
        return self.next_time()

    def generated(self, req: Request) -> int:
        """Tokens `req` has produced as of the last `step` call."""
        return 1 + self._steps - req.decode_from if req.state is _DECODE else req.generated

    def load(self) -> EngineLoad:
        decoding = len(self._decoding)
        running = len(self._prefilling) + decoding
        return EngineLoad(running, len(self._queue), self._queued_prefill, decoding)

    def step(self, now: float) -> StepResult:
        """Account the steps completed by `now`; at the end of the segment, finish what it
        finished and plan the next one, starting `now`."""
        result = StepResult()
        if self._active:
            done = min(self._seg_k, int((now - self._seg_start) / self._seg_d + _EPS))
            if done > self._seg_done:
                delta = done - self._seg_done
                self._seg_done = done
                self._steps += delta
                if self.config.report_tokens:  # the result is new: nothing emitted yet
                    result.emitted = dict.fromkeys(self._decoding, delta)
            if self._seg_done < self._seg_k:
                return result
            self._active = False
            self.log.release()
            self._end_segment(self._seg_start + self._seg_k * self._seg_d, result)
        self._plan(now, result)
        if self.log.events:
            result.events = self.log.drain()
        return result

    # -- the segment's end -------------------------------------------------------------------

    def _end_segment(self, t: float, result: StepResult) -> None:
        if self._seg_chunks:
            for req, n in self._seg_chunks:
                if req.state is not _PREFILL:
                    continue  # aborted meanwhile
                req.computed += n  # its full blocks were cached when the chunk was planned
                self._queued_prefill -= n
                if req.computed < req.prompt_len:
                    continue
                req.state = _DECODE
                if ranks(req):
                    self._ranked -= 1
                req.first_token_time = t
                req.generated = 1
                result.first_token.append(req)
                if self.config.report_tokens:
                    result.emitted[req.rid] = result.emitted.get(req.rid, 0) + 1
                if req.max_tokens == 1:
                    self._finish(req, t, result)
                else:
                    req.decode_from = self._steps
                    self._decoding[req.rid] = req
                    self._finishing.push(self._steps + req.max_tokens - 1, req)
            self._seg_chunks = []
            self._prefilling = [r for r in self._prefilling if r.state is _PREFILL]
        finishing = self._finishing
        while len(finishing) and finishing.peek().key <= self._steps:
            req = finishing.pop().item
            if req.state is _DECODE:
                del self._decoding[req.rid]
                self._finish(req, t, result)

    def _finish(self, req: Request, t: float, result: StepResult) -> None:
        """Cache the full blocks of prompt + output, release the rest of the room and locks."""
        cache_output(self.cache, req, self._tokens_out)
        req.state = _FINISHED
        req.generated = req.max_tokens
        req.finish_time = t
        result.finished.append(req)
        self.finished_requests += 1
        self.generated_tokens += req.max_tokens

    # -- planning ----------------------------------------------------------------------------

    def _admit(self, req: Request, now: float) -> bool:
        """Match, lock and reserve the footprint beyond the cached prefix; False if no room."""
        bs = self.config.block_size
        keys = req.keys
        assert keys is not None
        cache = self.cache
        cap = (req.prompt_len - 1) // bs  # at least one prompt token is computed: the first token
        stuck = self._stuck
        if (
            stuck is not None
            and stuck[0] is req
            and cache.free_tokens + cache.evictable_tokens < stuck[1]
            and (stuck[2] >= cap or not cache.starts_run(keys[stuck[2]], req.lora_name or ""))
        ):
            return False  # still no room, and its cached prefix cannot have grown
        if req.lora is not None and not self.adapters.can_start(req.lora):
            return False  # its adapter waits for a slot
        need, blocks = admit(cache, req, bs, self.host, self._tokens_out)
        if req.node is None:
            self._stuck = (req, need, blocks)
            return False
        if req.lora is not None:
            self.adapters.start(req.lora)
        cached = req.cached_tokens
        req.state = _PREFILL
        req.admitted_time = now
        self._queued_prefill -= cached
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += cached
        self.host_hit_tokens += req.host_tokens
        return True

    def _chunk(self, req: Request, budget: int, chunks: list[tuple[Request, int]]) -> int:
        """Schedule `req`'s next chunk within `budget` and cache its full blocks now, as vLLM's
        allocate_slots does: the step computes their KV in every layer before attention reads
        it, so a request later in the same step may use them. Returns the budget left."""
        n = min(req.prompt_len - req.computed, budget)
        chunks.append((req, n))
        cache_prompt(self.cache, req, req.computed + n, self._tokens_out)
        return budget - n

    def _schedule_ranked(
        self, now: float, chunks: list[tuple[Request, int]], result: StepResult
    ) -> int:
        """`_plan` by rank: prefilling and arrived waiting requests stably sorted by priority
        (ties: prefills, then arrival); one that does not fit blocks those after it; a prefill
        loses only budget, to better ranks and to the step budget (`StepBudget`). O(n log n) a
        step, while a non-zero priority is here (or was, in the window). The budget left."""
        cfg = self.config
        budget = cfg.chunk_tokens
        queue = self._queue
        ranked = self._prefilling[:]
        for req in queue:
            if req.arrival > now + _EPS:
                break
            ranked.append(req)
        ranked.sort(key=by_priority)
        (guard := self._guard).plan(ranked, self._decoding.values(), now)
        running = len(self._prefilling) + len(self._decoding)
        admitted = self._blocked = False
        for req in ranked:
            if req.state is _WAITING:
                if self._blocked:
                    continue
                if running >= cfg.max_batch or not self._admit(req, now):
                    self._blocked = True
                    continue
                self._prefilling.append(req)
                result.admitted.append(req)
                running += 1
                admitted = True
            n = guard.limit(req.priority, budget)
            if n > 0:
                budget -= guard.spend(req.priority, n - self._chunk(req, n, chunks))
        if admitted:
            self._queue = deque([r for r in queue if r.state is _WAITING])
        return budget

    def _plan(self, now: float, result: StepResult) -> None:
        """Plan the next step: chunks for the prefills already running (admission order), then
        admissions from the queue, each admitted request getting a chunk while the budget lasts
        (by priority while one is not 0: `_schedule_ranked`). A chunk's full blocks are cached
        as it is scheduled, so a request admitted after it matches them; they are announced when
        the step ends, as vLLM publishes a step's BlockStored after its forward pass
        (docs/workers.md); evictions are announced at once."""
        cfg = self.config
        budget = cfg.chunk_tokens
        chunks: list[tuple[Request, int]] = []
        self.log.planning = True  # the cache's stores until the admissions end are this step's
        try:
            if self._ranked or self._guard.protecting(now):
                budget = self._schedule_ranked(now, chunks, result)
            else:  # all priorities 0, the replay's path: inline, no call
                for req in self._prefilling:
                    if budget <= 0:
                        break
                    budget = self._chunk(req, budget, chunks)
                queue = self._queue
                running = len(self._prefilling) + len(self._decoding)
                self._blocked = False
                while queue and queue[0].arrival <= now + _EPS:
                    if running >= cfg.max_batch or not self._admit(queue[0], now):
                        self._blocked = True
                        break
                    req = queue.popleft()
                    self._prefilling.append(req)
                    result.admitted.append(req)
                    running += 1
                    if budget > 0:
                        budget = self._chunk(req, budget, chunks)
        finally:
            self.log.planning = False
        decoding = len(self._decoding)
        if not chunks and not decoding:
            return
        copied = 0  # host-tier blocks promoted for the first chunks: copied in before them
        for req, _ in chunks:
            if req.host_tokens and req.computed == req.cached_tokens:
                copied += req.host_tokens
        d = cfg.step_s(decoding, cfg.chunk_tokens - budget, copied) + self.adapters.take_load_s()
        if chunks:
            k = 1
        else:
            finishing = self._finishing
            while finishing.peek().item.state is not _DECODE:
                finishing.pop()  # aborted
            k = int(finishing.peek().key) - self._steps
            queue = self._queue
            if queue and not self._blocked:  # a request submitted ahead of its arrival
                k = min(k, max(1, math.ceil((queue[0].arrival - now) / d - _EPS)))
        self._active = True
        self._seg_start, self._seg_d, self._seg_k, self._seg_done = now, d, k, 0
        self._seg_chunks = chunks

    # -- integrity ---------------------------------------------------------------------------

    def check(self) -> None:
        """The cache's invariants, plus: its allocated room is exactly what the running
        requests reserve, and its lock counts are exactly their locked paths."""
        check(self.cache)
        if self.host is not None:
            self.host.check()
        running = self._prefilling + list(self._decoding.values())
        assert sum(r.reserved for r in running) == self.cache.allocated_tokens, "reserved room"
        check_locks(self.cache, [r.node for r in running if r.node is not None])
        self.adapters.check([r.lora for r in running])
        assert len(running) <= self.config.max_batch, "batch over max_batch"
        ranked = sum(1 for r in [*self._queue, *self._prefilling] if ranks(r))
        assert ranked == self._ranked, "requests ranked by priority"
        assert self._active or not self.log.held, "events held past their step"
