"""What the simulator replays: each request reduced once, shared by every policy's run and never
changed. Keys are namespaced as the live system's (`cache_salt`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from router.adapters import base_group
from router.policies import RouteRequest


class KeyedPrompt(Sequence[int]):
    """A prompt known by its length and block keys only (a trace's): never read as tokens."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        raise TypeError("a trace prompt has block keys, not token ids")

    def __iter__(self) -> Iterator[int]:
        raise TypeError("a trace prompt has block keys, not token ids")


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request of a replay; `arrival_s` None: a closed loop sends it when a slot frees."""

    index: int
    arrival_s: float | None
    prompt: Sequence[int]  # token ids, or a KeyedPrompt
    max_tokens: int
    keys: list[int]  # chained keys of the prompt's full blocks
    tail_keys: list[int]  # keys of the full blocks of prompt + output past `keys`
    route: RouteRequest  # what the policies see
    salt: str | None  # forwarded to the worker as cache_salt
    chat: bool = False  # a chat request (its role chunk rides on the first token)
    session: int = -1  # a session's turns share it; each waits for the previous one
    tenant: str | None = None  # who sent it (flow control's flow; None: the shared tenant)

    @property
    def kv_group(self) -> str:
        """The kv_group of the workers that serve it: an adapter's base's."""
        route = self.route
        return base_group(route.kv_group) if route.adapter else route.kv_group


def cache_salt(tenant: str | None, kv_group: str, one_group: bool) -> str | None:
    """The namespace of a request's keys: the tenant's salt (None: shared), plus the kv_group
    when the fleet serves several, so that equal text in two models never shares a key."""
    if one_group:
        return f"urc-sim/{tenant}" if tenant else None
    return f"urc-sim/{kv_group}/{tenant or ''}"
