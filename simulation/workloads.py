"""Built-in workloads (loadgen.workloads) -> `SimRequest`s with the exact tokens `urc bench
--workload NAME --seed S` sends, turns built from the emulated worker's deterministic replies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backends.emulated.request import output_bytes, tail_keys
from core.blocks import DEFAULT_BLOCK_SIZE, block_keys
from core.tokenizer import ByteTokenizer
from loadgen.sessions import SessionQueue
from loadgen.workloads import iter_requests, with_poisson_arrivals
from router.adapters import adapter_group
from router.policies import RouteRequest
from simulation.requests import SimRequest, cache_salt

DEFAULT_MODELS: tuple[str, ...] = ("emulated",)


def workload_requests(
    name: str,
    n: int,
    *,
    seed: int = 0,
    models: Sequence[str] = DEFAULT_MODELS,
    rate: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    params: dict[str, Any] | None = None,
    isolate_tenants: bool = True,
) -> list[SimRequest]:
    """The first `n` requests of workload `name`, Poisson at `rate` as `urc bench` (None: closed
    loop); `isolate_tenants`: a namespace per tenant, as a gateway with API keys keeps them."""
    specs: Any = iter_requests(name, seed, list(models), n, **(params or {}))
    if rate is not None:
        specs = with_poisson_arrivals(specs, rate, seed)
    specs = list(specs)
    tokenizer = ByteTokenizer()
    one_group = len({s.base or s.model for s in specs}) <= 1  # adapters: their base's
    sessions: dict[str, int] = {}
    queue = SessionQueue()
    out: list[SimRequest] = []
    for spec in specs:
        queue.add(spec)  # the previous turn has completed: the turn is ready at once
        sent = queue.take()
        assert sent is not None and sent.index == spec.index
        reply = output_bytes(0, spec.max_tokens).decode()
        queue.complete(sent, reply)
        if sent.kind == "chat":
            assert sent.messages is not None
            tokens = tokenizer.encode_chat(sent.messages)
        else:
            assert sent.prompt is not None
            tokens = tokenizer.encode(sent.prompt)
        tenant = spec.tenant if isolate_tenants else None
        group, lora = spec.model, None
        if spec.base is not None:  # a LoRA adapter: keyed in its namespace, its own kv_group
            group, lora = adapter_group(spec.base, spec.model), spec.model
        salt = cache_salt(tenant, spec.base or spec.model, one_group)
        keys = block_keys(tokens, block_size, salt, lora=lora)
        session = -1
        if spec.session_id is not None:
            session = sessions.setdefault(spec.session_id, len(sessions))
        out.append(
            SimRequest(
                index=len(out),
                arrival_s=spec.arrival_s,
                prompt=tokens,
                max_tokens=spec.max_tokens,
                keys=keys,
                tail_keys=tail_keys(tokens, keys, spec.max_tokens, block_size, salt, lora),
                route=RouteRequest(keys, len(tokens), block_size, group, spec.model, lora or ""),
                salt=salt,
                chat=spec.kind == "chat",
                session=session,
                tenant=spec.tenant,
            )
        )
    return out
