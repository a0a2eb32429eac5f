"""Traces and gateway recordings -> `SimRequest`s (docs/traces.md, "As keys")."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.blocks import chain_keys, namespace, parent_prefix
from loadgen.mooncake import BLOCK_TOKENS, TraceFormatError, TraceRecord, parse_record
from router.policies import RouteRequest
from simulation.requests import KeyedPrompt, SimRequest, cache_salt

_INT32 = range(-(2**31), 2**31)
_NO_PARTIAL = -2  # the first tail "token" of a request whose trace lists no partial block
_OUTPUT = -1  # every later tail "token": output text, the same for every request


@dataclass(slots=True)
class Trace:
    """A parsed trace file. `recorded`: a gateway recording (hash ids are block keys)."""

    records: list[TraceRecord]
    block_size: int
    recorded: bool
    policy: str | None = None  # the policy a recording was made under (its first line's)
    predicted_tokens: int | None = None  # sums over a recording's lines, where given
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def ordered(self, limit: int | None = None) -> list[TraceRecord]:
        """The first `limit` records in timestamp order, as `trace_requests` replays them."""
        return sorted(self.records, key=lambda r: r.timestamp_ms)[:limit]

    def recorded_hit_rate(self) -> float | None:
        """Cached / prompt tokens as the workers reported them while recording."""
        rows = [r for r in self.records if r.cached_tokens is not None]
        prompt = sum(r.input_length for r in rows)
        return sum(r.cached_tokens or 0 for r in rows) / prompt if prompt else None

    def recorded_summary(self) -> dict[str, object]:
        """What the recording says the live gateway achieved (the report's `recorded`)."""
        return {
            "requests": len(self.records),
            "policy": self.policy,
            "hit_rate": self.recorded_hit_rate(),
            "predicted_hit_rate": predicted_hit_rate(self, self.records),
        }


def predicted_hit_rate(trace: Trace, lines: Sequence[TraceRecord]) -> float | None:
    """The recording's predicted / prompt tokens, where its predictions cover every line."""
    prompt = sum(r.input_length for r in lines)
    if len(lines) != len(trace.records) or trace.predicted_tokens is None or not prompt:
        return None
    return trace.predicted_tokens / prompt


def parse_trace(lines: Iterable[str], source: str = "<trace>", skip_bad: bool = False) -> Trace:
    """Every record of a published trace or a recording; TraceFormatError on bad lines (unless
    `skip_bad`), on a trace without records, and on a recording with mixed block sizes."""
    records: list[TraceRecord] = []
    errors: list[tuple[int, str]] = []
    sizes: set[int] = set()
    recorded = False
    policy: str | None = None
    predicted: int | None = None
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            errors.append((n, f"not JSON ({e.msg} at column {e.colno})"))
            continue
        if isinstance(obj, dict) and "urc_record" in obj:
            recorded = True
            if isinstance(obj.get("block_size"), int) and obj["block_size"] > 0:
                sizes.add(obj["block_size"])
            continue
        size = obj.get("block_size") if isinstance(obj, dict) else None
        try:
            record = parse_record(text, n)
            if size is not None and not (type(size) is int and size > 0):  # no bool either
                raise ValueError(f"'block_size' must be a positive integer, got {size!r}")
        except ValueError as e:
            errors.append((n, str(e)))
            continue
        records.append(record)
        if size is not None:
            recorded = True
            sizes.add(size)
        if policy is None and isinstance(obj.get("policy"), str):
            policy = obj["policy"]
        if isinstance(obj.get("predicted_tokens"), int):
            predicted = (predicted or 0) + obj["predicted_tokens"]
    if errors and not skip_bad:
        raise TraceFormatError(source, errors)
    if not records:
        raise TraceFormatError(source, errors or [(0, "no records")])
    if len(sizes) > 1:
        raise TraceFormatError(source, [(0, f"mixed block sizes {sorted(sizes)}")])
    if recorded and not sizes:
        raise TraceFormatError(source, [(0, "a recording without a block_size")])
    block_size = sizes.pop() if sizes else BLOCK_TOKENS
    return Trace(records, block_size, recorded, policy, predicted, errors)


def read_trace(path: str | Path, skip_bad: bool = False) -> Trace:
    with open(path, encoding="utf-8") as f:
        return parse_trace(f, str(path), skip_bad)


def trace_requests(
    trace: Trace,
    *,
    model: str = "emulated",
    time_scale: float = 1.0,
    max_output_tokens: int | None = None,
    limit: int | None = None,
    chat: bool = False,
) -> list[SimRequest]:
    """The first `limit` requests in timestamp order, timed and capped as docs/traces.md says; a
    record's own model and tenant win over `model` and the shared tenant."""
    if time_scale < 0:
        raise ValueError("time_scale must be >= 0")
    ordered = trace.ordered(limit)
    bs = trace.block_size
    one_group = len({r.model or model for r in ordered}) == 1
    remap = _id_remap(ordered) if not trace.recorded else None
    t0 = ordered[0].timestamp_ms if ordered else 0.0
    out: list[SimRequest] = []
    for i, rec in enumerate(ordered):
        group = rec.model or model
        salt = cache_salt(rec.tenant, group, one_group)
        cap = rec.output_length if max_output_tokens is None else max_output_tokens
        max_tokens = max(1, min(rec.output_length, cap))
        full = rec.input_length // bs
        ids = rec.hash_ids if remap is None else [remap[h] for h in rec.hash_ids]
        keys = list(ids[:full]) if trace.recorded else chain_keys(ids[:full], 1, namespace(salt))
        if len(keys) < full:  # more tokens than hash ids: blocks of this line alone
            marker = -3 - rec.line % (2**30)
            keys += chain_keys([marker] * (full - len(keys)), 1, _after(keys, salt))
        n_tail = (rec.input_length + max_tokens - 1) // bs - full
        tail: list[int] = []
        if n_tail > 0:
            first = ids[full] if len(ids) > full and not trace.recorded else _NO_PARTIAL
            tail = chain_keys([first] + [_OUTPUT] * (n_tail - 1), 1, _after(keys, salt))
        out.append(
            SimRequest(
                index=i,
                arrival_s=(rec.timestamp_ms - t0) / 1000.0 * time_scale,
                prompt=KeyedPrompt(rec.input_length),
                max_tokens=max_tokens,
                keys=keys,
                tail_keys=tail,
                route=RouteRequest(keys, rec.input_length, bs, group, group),
                salt=salt,
                chat=chat,
                tenant=rec.tenant,
            )
        )
    link_continuations(out)
    return out


def _after(keys: list[int], salt: str | None) -> bytes:
    return parent_prefix(keys[-1]) if keys else namespace(salt)


def _id_remap(records: list[TraceRecord]) -> dict[int, int] | None:
    """Hash ids as int32 "tokens": dense ids when some do not fit (only equality matters)."""
    if all(h in _INT32 for r in records for h in r.hash_ids):
        return None
    remap: dict[int, int] = {}
    for r in records:
        for h in r.hash_ids:
            remap.setdefault(h, len(remap))
    return remap


def link_continuations(requests: list[SimRequest]) -> None:
    """Key each request's output blocks as the blocks that follow its prompt in the first later
    request extending it (its next turn), where that one is long enough."""
    open_tails: dict[int, SimRequest] = {}  # last prompt key -> a request whose tail is unlinked
    for req in requests:
        keys = req.keys
        if open_tails:
            for j, key in enumerate(keys):
                prior = open_tails.get(key)
                if prior is None:
                    continue
                n = len(prior.tail_keys)
                if len(keys) >= j + 1 + n:
                    prior.tail_keys = keys[j + 1 : j + 1 + n]
                    del open_tails[key]
        if req.tail_keys and keys:
            open_tails[keys[-1]] = req
