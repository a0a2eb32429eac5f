"""Built-in workloads: pure, seeded, endless streams of `RequestSpec`s: the same `(name, seed,
models, params)` yields the same specs, so `urc bench` and `urc replay` agree (docs/loadgen.md)."""

from __future__ import annotations

import dataclasses
import random
from bisect import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, count, islice
from typing import Any, ClassVar, Literal, Protocol

from core.text import filler

Kind = Literal["chat", "completion"]
Message = dict[str, str]
DEFAULT_MODELS: tuple[str, ...] = ("tiny",)


@dataclass(slots=True)
class RequestSpec:
    """One request to send; a session's turn k > 0 carries only its new messages or text."""

    index: int
    kind: Kind
    model: str
    max_tokens: int
    messages: list[Message] | None = None  # chat
    prompt: str | None = None  # completion
    arrival_s: float | None = None  # open loop: send time after the start (None: when admitted)
    tenant: str | None = None  # a logical name the runner maps to an API key
    session_id: str | None = None
    turn: int = 0
    ends_session: bool = True  # the session's last turn: its history can be forgotten
    group_id: str | None = None  # the shared prefix it was built on
    base: str | None = None  # `model` names a LoRA adapter of this base model (docs/adapters.md)

    def __post_init__(self) -> None:
        assert (self.kind == "chat") == (self.messages is not None), self
        assert (self.kind == "completion") == (self.prompt is not None), self
        assert self.max_tokens >= 1, self.max_tokens


def request_text(kind: str, user: str, system: str | None = None) -> dict[str, Any]:
    """A spec's text: chat messages (a system one first when given), or the completion prompt."""
    if kind != "chat":
        return {"prompt": (system or "") + user}
    head = [] if system is None else [{"role": "system", "content": system}]
    return {"messages": [*head, {"role": "user", "content": user}]}


class Workload(Protocol):
    def requests(self, seed: int, models: Sequence[str]) -> Iterator[RequestSpec]: ...


@dataclass(slots=True)
class SystemPrompts:
    """`groups` long system prompts of `prefix_tokens` each, every request one of them plus a
    short distinct user question (chat: system + user messages; completion: prefix + question);
    `hot_share` of the requests use group 0 (a hot prefix), the rest spread evenly."""

    groups: int = 20
    prefix_tokens: int = 2000
    question_tokens: int = 48
    max_tokens: int = 32
    kind: str = "chat"
    hot_share: float = 0.0
    tag: ClassVar[str] = "system-prompts"  # seeds the text: each workload draws its own

    def model_of(self, models: Sequence[str], group: int, nth: int) -> str:
        """The model of a group's `nth` request."""
        return models[0]

    def tenant_of(self, nth: int) -> str | None:
        return None

    def requests(self, seed: int, models: Sequence[str]) -> Iterator[RequestSpec]:
        """Request i: a seeded-random group g (its j-th request) = g's prefix + a fresh question."""
        tag = self.tag
        rng = random.Random(f"{tag}/{seed}/groups")
        sent = [0] * self.groups
        hot = self.hot_share
        for i in count():
            # (no draw for the hot share when there is none: the stream stays as it was)
            g = 0 if hot > 0 and rng.random() < hot else rng.randrange(self.groups)
            j = sent[g]
            sent[g] += 1
            system = filler(self.prefix_tokens, f"{tag}/{seed}/system/{g}")
            question = filler(self.question_tokens, f"{tag}/{seed}/question/{i}")
            yield RequestSpec(
                i,
                self.kind,
                self.model_of(models, g, j),
                self.max_tokens,
                tenant=self.tenant_of(j),
                group_id=f"{tag}/g{g}",
                **request_text(self.kind, question, system),
            )


@dataclass(slots=True)
class MultiModel(SystemPrompts):
    """system-prompts spread over every model: a group's requests cycle through the models, so
    identical prefixes reach different KV groups (which must never share cache)."""

    tag: ClassVar[str] = "multi-model"

    def model_of(self, models: Sequence[str], group: int, nth: int) -> str:
        return models[(group + nth) % len(models)]


@dataclass(slots=True)
class TwoTenants(SystemPrompts):
    """system-prompts sent by two tenants alternately: the same prompts under two API keys,
    which isolation keeps apart (no cross-tenant cache hits)."""

    tenants: tuple[str, ...] = ("tenant-a", "tenant-b")
    tag: ClassVar[str] = "two-tenants"

    def tenant_of(self, nth: int) -> str | None:
        return self.tenants[nth % len(self.tenants)]


@dataclass(slots=True)
class MultiTurn:
    """Conversations of `turns` turns, `sessions` at a time: turn k+1 = turn k's messages + the
    assistant's actual reply + a new user message of `user_tokens`. One system prompt of
    `system_tokens` (0: none) opens every conversation, as in a chat product."""

    sessions: int = 16
    turns: int = 4
    system_tokens: int = 256
    user_tokens: int = 64
    max_tokens: int = 32

    def requests(self, seed: int, models: Sequence[str]) -> Iterator[RequestSpec]:
        system = filler(self.system_tokens, f"multi-turn/{seed}/system")
        i = 0
        for batch in count():
            # turn-major within a batch: a session's next turn comes after every other's turn
            for turn in range(self.turns):
                for s in range(batch * self.sessions, (batch + 1) * self.sessions):
                    text = filler(self.user_tokens, f"mt/{seed}/{s}/{turn}")
                    opening = turn == 0 and self.system_tokens > 0
                    yield RequestSpec(
                        i,
                        "chat",
                        models[s % len(models)],
                        self.max_tokens,
                        session_id=f"multi-turn/s{s}",
                        turn=turn,
                        ends_session=turn == self.turns - 1,
                        group_id="multi-turn/system" if self.system_tokens > 0 else None,
                        **request_text("chat", text, system if opening else None),
                    )
                    i += 1


@dataclass(slots=True)
class Mixed:
    """A seeded blend of the other workloads (each with its defaults), by weight."""

    weights: str = "system-prompts:2,multi-turn:2,multi-model:1,two-tenants:1"

    def requests(self, seed: int, models: Sequence[str]) -> Iterator[RequestSpec]:
        streams, shares = [], []
        for item in self.weights.split(","):
            name, _, weight = item.strip().partition(":")
            if name not in WORKLOADS or name == "mixed":
                raise ValueError(f"mixed: unknown workload {name!r} in weights")
            streams.append(WORKLOADS[name]().requests(seed, models))
            shares.append(float(weight or 1))
        rng = random.Random(f"mixed/{seed}")
        for i in count():
            (stream,) = rng.choices(streams, weights=shares)
            yield dataclasses.replace(next(stream), index=i)


@dataclass(slots=True)
class NoisyNeighbour:
    """Two tenants on one fleet (docs/flow-control.md): `quiet` (`quiet_share` of the requests)
    asks short questions on one shared system prompt, `flood` sends long prompts that no cache
    holds (each distinct). Its shape is an open loop (`--rate` past the fleet's prefill
    capacity): the flood fills every queue while the quiet tenant keeps its small rate."""

    quiet_share: float = 0.15
    system_tokens: int = 1000
    question_tokens: int = 48
    flood_tokens: int = 5000
    max_tokens: int = 32
    kind: str = "chat"
    tenants: tuple[str, ...] = ("quiet", "flood")

    def requests(self, seed: int, models: Sequence[str]) -> Iterator[RequestSpec]:
        rng = random.Random(f"noisy-neighbour/{seed}")
        system = filler(self.system_tokens, f"noisy-neighbour/{seed}/system")
        quiet, flood = self.tenants[0], self.tenants[-1]
        for i in count():
            if rng.random() < self.quiet_share:
                question = filler(self.question_tokens, f"noisy-neighbour/{seed}/question/{i}")
                text = request_text(self.kind, question, system)
                tenant, group = quiet, "noisy-neighbour/system"
            else:
                prompt = filler(self.flood_tokens, f"noisy-neighbour/{seed}/flood/{i}")
                text, tenant, group = request_text(self.kind, prompt), flood, None
            yield RequestSpec(
                i, self.kind, models[0], self.max_tokens, tenant=tenant, group_id=group, **text
            )


@dataclass(slots=True)
class LoraAdapters:
    """`adapters` LoRA adapters of models[0] (served names `<adapter_prefix><k>`), adapter k
    asked for with Zipf popularity 1/(k+1)^zipf_s; each has `prompts` system prompts of its own
    (`prefix_tokens` each), every request one of them plus a short distinct question."""

    adapters: int = 100
    zipf_s: float = 1.0
    prompts: int = 2
    prefix_tokens: int = 1000
    question_tokens: int = 48
    max_tokens: int = 32
    kind: str = "chat"
    adapter_prefix: str = "lora-"

    def requests(self, seed: int, models: Sequence[str]) -> Iterator[RequestSpec]:
        rng = random.Random(f"lora/{seed}")
        weights = [1.0 / (k + 1) ** self.zipf_s for k in range(self.adapters)]
        cumulative = list(accumulate(weights))
        base = models[0]
        for i in count():
            k = bisect(cumulative, rng.random() * cumulative[-1])
            k = min(k, self.adapters - 1)
            p = rng.randrange(self.prompts)
            system = filler(self.prefix_tokens, f"lora/{seed}/system/{k}/{p}")
            question = filler(self.question_tokens, f"lora/{seed}/question/{i}")
            yield RequestSpec(
                i,
                self.kind,
                f"{self.adapter_prefix}{k}",
                self.max_tokens,
                group_id=f"lora/{k}/{p}",
                base=base,
                **request_text(self.kind, question, system),
            )


WORKLOADS: dict[str, type] = {
    "system-prompts": SystemPrompts,
    "multi-turn": MultiTurn,
    "multi-model": MultiModel,
    "two-tenants": TwoTenants,
    "noisy-neighbour": NoisyNeighbour,
    "mixed": Mixed,
    "lora": LoraAdapters,
}


def defaults(cls: type) -> dict[str, Any]:
    """A workload's parameters and their defaults."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _coerce(value: Any, default: Any, name: str) -> Any:
    """A parameter given as text (`--param k=v`) -> the type of its default (int or tuple)."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    try:
        if isinstance(default, tuple):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return type(default)(value)
    except ValueError as e:
        raise ValueError(f"parameter {name}: {e}") from None


_AT_LEAST_ONE = frozenset({"groups", "sessions", "turns", "max_tokens", "adapters", "prompts"})


def parse_params(items: Sequence[str]) -> dict[str, str]:
    """`-p KEY=VALUE` flags (`urc bench`, `urc replay`) as a workload's parameters."""
    params: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r}: expected KEY=VALUE")
        params[key.strip()] = value
    return params


def parse_models(items: Sequence[str]) -> list[str]:
    """`--model` flags, each one name or several comma-separated."""
    return [m.strip() for item in items for m in item.split(",") if m.strip()]


def make_workload(name: str, **params: Any) -> Workload:
    """The workload `name` with `params` (strings are converted to each default's type)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    known = defaults(WORKLOADS[name])
    unknown = set(params) - set(known)
    if unknown:
        raise ValueError(f"{name}: unknown parameter(s) {sorted(unknown)}; known: {list(known)}")
    workload = WORKLOADS[name](**{k: _coerce(v, known[k], k) for k, v in params.items()})
    kind = getattr(workload, "kind", "chat")
    if kind not in ("chat", "completion"):
        raise ValueError(f"{name}: kind must be 'chat' or 'completion', not {kind!r}")
    for f in dataclasses.fields(workload):
        value = getattr(workload, f.name)
        least = 1 if f.name in _AT_LEAST_ONE else 0
        if isinstance(value, int) and value < least:
            raise ValueError(f"{name}: {f.name} must be >= {least}, got {value}")
        if isinstance(value, tuple) and not value:
            raise ValueError(f"{name}: {f.name} must not be empty")
    return workload


def iter_requests(
    name: str,
    seed: int = 0,
    models: Sequence[str] = DEFAULT_MODELS,
    n: int | None = None,
    **params: Any,
) -> Iterator[RequestSpec]:
    """The workload's specs: endless, or the first `n`."""
    if not models:
        raise ValueError("at least one model name is needed")
    stream = make_workload(name, **params).requests(seed, list(models))
    return stream if n is None else islice(stream, n)


def with_poisson_arrivals(
    specs: Iterable[RequestSpec], rate: float, seed: int = 0
) -> Iterator[RequestSpec]:
    """Open-loop arrivals: the first at 0, then exponential gaps of mean 1/rate (seeded)."""
    assert rate > 0, rate
    rng = random.Random(f"urc-loadgen/arrivals/{seed}")
    t = 0.0
    for spec in specs:
        yield dataclasses.replace(spec, arrival_s=t)
        t += rng.expovariate(rate)
