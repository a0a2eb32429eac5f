"""The torch engine on its own thread, behind the HTTP layer's Backend contract.

Forward passes block for milliseconds to seconds, so the engine cannot share the event loop:
one thread owns it. Handlers submit and abort through an inbox the thread drains before every
step; after a step, the thread publishes its KV events (per kv_group) and hands one batch of
updates to the loop with `call_soon_threadsafe`, where the generations change and wake their
handlers. Nothing on the loop touches the engine but `validate`, which reads only constants.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from backends.engine.engine import EngineLoad, TorchEngine
from backends.engine.request import Request, SamplingParams, Status
from backends.http.generation import Generation, WorkerLoad
from core.kv_events import KVEvent

log = logging.getLogger(__name__)

Publish = Callable[[str, list[KVEvent]], None]  # (kv_group, events)


class _Message(NamedTuple):
    kind: str  # "submit" or "abort"
    req: Request
    gen: Generation


class _Call(NamedTuple):
    """Run `fn` on the engine thread between steps; its result (or error) goes to `future`."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]


class _Update(NamedTuple):
    gen: Generation
    output_len: int
    cached_tokens: int | None  # set once admitted
    finish_reason: str | None
    aborted: bool


class EngineThread:
    """`start(loop)`, then use it as the HTTP layer's Backend; `await stop()` at the end."""

    def __init__(self, engine: TorchEngine, publish: Publish | None = None) -> None:
        self.engine = engine
        self.publish = publish
        self._inbox: queue.SimpleQueue[_Message | _Call | None] = queue.SimpleQueue()
        self._live: dict[int, Generation] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._load = WorkerLoad(0, 0, 0, self._capacity_tokens())
        self.engine_load = EngineLoad(0, 0, 0)  # a snapshot: the engine's lists are its thread's

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._main, name="torch-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is in flight and stop the thread."""
        if self._thread is None:
            return
        self._inbox.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    # -- Backend -------------------------------------------------------------------------------

    def submit(self, gen: Generation) -> None:
        s = gen.sampling
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            ignore_eos=s.ignore_eos,
        )
        req = self.engine.new_request(gen.model.name, gen.prompt, params, gen.cache_salt)
        if gen.cache_salt:  # shared isolation: the public part, whole blocks of the prompt
            full = len(gen.prompt) // self.engine.config.page_size
            req.public_blocks = min(gen.public_tokens // self.engine.config.page_size, full)
        self.engine.validate(req)
        gen.handle = req
        self._inbox.put(_Message("submit", req, gen))

    def abort(self, gen: Generation) -> None:
        if not gen.done and gen.handle is not None:
            self._inbox.put(_Message("abort", gen.handle, gen))

    def load(self) -> WorkerLoad:
        return self._load  # refreshed by the engine thread after every step

    # -- the engine thread ---------------------------------------------------------------------

    def _capacity_tokens(self) -> int:
        return sum(p.memory.capacity for p in self.engine.pools.values()) * (
            self.engine.config.page_size
        )

    def _main(self) -> None:
        engine = self.engine
        while True:
            updates: list[_Update] = []
            try:
                block = not engine.has_work()
                message = self._inbox.get(block=block)
                while True:
                    if message is None:
                        self._shutdown()
                        return
                    self._handle(message, updates)
                    message = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if engine.has_work():
                try:
                    self._step(updates)
                except Exception:  # a bug: fail what is in flight, keep serving new requests
                    log.exception("engine step failed")
                    self._abort_all(updates)
            self._refresh_load()
            if updates:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_apply, updates)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the engine thread, between steps (operator calls: invalidation)."""
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        self._inbox.put(_Call(fn, future))
        return await future

    def _handle(self, message: _Message | _Call, updates: list[_Update]) -> None:
        if isinstance(message, _Call):
            self._run_call(message)
            return
        req, gen = message.req, message.gen
        if message.kind == "submit":
            try:
                self.engine.submit(req)
            except ValueError:
                updates.append(_Update(gen, 0, None, None, True))
                return
            self._live[req.rid] = gen
        elif self._live.pop(req.rid, None) is not None and self.engine.abort(req):
            updates.append(_Update(gen, len(req.output), None, None, True))

    def _run_call(self, call: _Call) -> None:
        assert self._loop is not None
        future = call.future
        try:
            result = call.fn()
        except Exception as exc:  # the caller's to report
            self._loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            self._loop.call_soon_threadsafe(_settle, future, result, None)

    def _step(self, updates: list[_Update]) -> None:
        result = self.engine.step()
        if self.publish is not None:
            for group, events in result.events.items():
                try:
                    self.publish(group, events)
                except Exception:
                    log.exception("publishing KV events failed")
        touched: dict[int, Request] = {}
        for req in result.admitted + result.emitted + result.finished:
            touched[req.rid] = req
        for rid, req in touched.items():
            gen = self._live.get(rid)
            if gen is None:
                continue
            if req.status is Status.FINISHED:
                del self._live[rid]
            cached = req.cached_tokens if req.admitted else None
            updates.append(_Update(gen, len(req.output), cached, req.finish_reason, False))

    def _abort_all(self, updates: list[_Update]) -> None:
        for rid, gen in list(self._live.items()):
            req: Request = gen.handle
            self.engine.abort(req)
            del self._live[rid]
            updates.append(_Update(gen, len(req.output), None, None, True))

    def _shutdown(self) -> None:
        updates: list[_Update] = []
        self._abort_all(updates)
        if updates and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_apply, updates)

    def _refresh_load(self) -> None:
        engine = self.engine
        load = self.engine_load = engine.load()
        used = sum(p.cache.capacity_tokens - p.cache.free_tokens for p in engine.pools.values())
        self._load = WorkerLoad(load.running, load.waiting, used, self._load.capacity_tokens)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _apply(updates: list[_Update]) -> None:
    """On the event loop: move each generation forward and wake its handler."""
    for u in updates:
        gen = u.gen
        req: Request | None = gen.handle
        if req is not None and u.output_len > len(gen.output):
            gen.output.extend(req.output[len(gen.output) : u.output_len])
        if u.cached_tokens is not None and not gen.admitted:
            gen.cached_tokens = u.cached_tokens
            gen.admitted = True
        if u.finish_reason is not None:
            gen.finish_reason = u.finish_reason
        if u.aborted:
            gen.aborted = True
        gen.changed.set()
