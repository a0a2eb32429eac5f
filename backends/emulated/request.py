"""One generation as the emulated engine tracks it, and its output: exactly `max_tokens` tokens
of OUTPUT_TEXT repeated, so the blocks it adds to the cache (`tail_keys`) are known before it runs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from backends.cache.nodes import Run
from backends.lora_slots import Adapter
from core.blocks import chain_keys, namespace, parent_prefix
from core.kv_events import KVEvent

OUTPUT_TEXT = b"The quick brown fox jumps over the lazy dog. "


def output_bytes(start: int, end: int) -> bytes:
    """Output tokens [start, end) of every request: printable ASCII, so the byte tokenizer's
    ids and text at once."""
    size = len(OUTPUT_TEXT)
    offset = start % size
    n = max(0, end - start)
    return (OUTPUT_TEXT * ((offset + n) // size + 1))[offset : offset + n]


def output_tokens(n: int) -> list[int]:
    """The first `n` output token ids."""
    return list(output_bytes(0, n))


def tail_tokens(prompt: Sequence[int], keys: Sequence[int], max_tokens: int, bs: int) -> list[int]:
    """The tokens of the full blocks of prompt + output past the prompt's `keys` (all but the
    last output token, whose KV is never computed): what a request caches when it finishes."""
    start = len(keys) * bs
    full = (len(prompt) + max_tokens - 1) // bs * bs
    if full <= start:
        return []
    return (list(prompt[start:]) + output_tokens(max_tokens - 1))[: full - start]


def tail_keys(
    prompt: Sequence[int],
    keys: Sequence[int],
    max_tokens: int,
    bs: int,
    salt: str | None,
    lora: str | None = None,
) -> list[int]:
    """The keys of `tail_tokens`, chained from the prompt's last key."""
    tail = tail_tokens(prompt, keys, max_tokens, bs)
    if not tail:
        return []
    return chain_keys(tail, bs, parent_prefix(keys[-1]) if keys else namespace(salt, lora))


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(init=False, eq=False, slots=True)
class Request:
    """One generation. The caller fills the first fields (`rid` unique among the requests in
    flight); the engine fills the rest. The `__init__` is written out: compiled, it is native."""

    rid: Any
    prompt: Sequence[int]  # token ids (read only where keys, tail_keys or event tokens need them)
    max_tokens: int
    cache_salt: str | None
    arrival: float
    keys: list[int] | None  # the prompt's block keys; computed on submit when None
    tail_keys: list[int] | None  # `tail_keys(...)` of the request; on finish when None
    # shared isolation: leading prompt blocks keyed in the shared namespace (core/blocks.py)
    public_blocks: int
    # vLLM's `priority`: lower is scheduled earlier, ties by arrival (docs/workers.md)
    priority: int
    # the gateway's hint that work ranked at this priority is active elsewhere in the request's
    # pool: while the request is here, the step budget protects that rank as if a request of
    # it were present (`StepBudget`, docs/workers.md); None: no hint
    protect: int | None
    # the LoRA adapter it names (None: the base model); its blocks are keyed and cached apart
    lora_name: str | None
    state: State
    cached_tokens: int  # prompt tokens found in the cache on admission (both tiers)
    host_tokens: int  # of those, promoted from the host tier: copied in before its first chunk
    computed: int  # prompt tokens whose KV exists (cached ones included)
    generated: int  # current at first token and finish; `engine.generated(req)` meanwhile
    admitted_time: float | None
    first_token_time: float | None
    finish_time: float | None
    # engine bookkeeping: the locked run the request's cached path ends at, its length in
    # blocks, private room still held, and the step number its decoding started at
    node: Run | None = field(repr=False)
    prompt_len: int  # len(prompt), taken on submit
    node_blocks: int
    reserved: int
    decode_from: int
    lora: Adapter | None  # the adapter `lora_name` names, resolved on submit

    def __init__(
        self,
        rid: Any,
        prompt: Sequence[int],
        max_tokens: int,
        cache_salt: str | None = None,
        arrival: float = 0.0,
        keys: list[int] | None = None,
        tail_keys: list[int] | None = None,
        public_blocks: int = 0,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.arrival = arrival
        self.keys = keys
        self.tail_keys = tail_keys
        self.public_blocks = public_blocks
        self.priority = priority
        self.protect = None
        self.lora_name = lora_name
        self.lora = None
        self.state = State.WAITING
        self.cached_tokens = self.host_tokens = self.computed = self.generated = 0
        self.admitted_time = self.first_token_time = self.finish_time = None
        self.node = None
        self.prompt_len = self.node_blocks = self.reserved = self.decode_from = 0


def by_priority(req: Request) -> int:
    """The sort key of ranked scheduling: vLLM's sense, lower first."""
    return req.priority


def ranks(req: Request) -> bool:
    """Whether `req` needs ranked scheduling: a priority, or the gateway's protect hint."""
    return req.priority != 0 or req.protect is not None


def floor(req: Request) -> int:
    """The best rank `req` stands for: its priority, or the better one its hint protects."""
    hint = req.protect
    return req.priority if hint is None or hint > req.priority else hint


class StepResult:
    """What one `step` call did (a plain class: compiled, it is built natively)."""

    __slots__ = ("admitted", "first_token", "finished", "emitted", "events")

    def __init__(self) -> None:
        self.admitted: list[Request] = []  # left the queue this call: cached_tokens is known
        self.first_token: list[Request] = []  # prefill done: first token at first_token_time
        self.finished: list[Request] = []  # every token emitted (finish_time set)
        self.emitted: dict[Any, int] = {}  # rid -> tokens emitted this call, first included
        self.events: list[KVEvent] = []  # the cache's changes, in order


class EngineLoad(NamedTuple):
    running: int
    waiting: int
    queued_prefill_tokens: int  # prompt tokens not yet computed (cached ones of waiting included)
    decoding: int  # running requests past their prefill
