"""Mooncake traces -> `RequestSpec`s with real text (docs/traces.md); pure but for the reading."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.text import filler
from loadgen.workloads import Kind, RequestSpec, request_text

BLOCK_TOKENS = 512


@dataclass(slots=True)
class TraceRecord:
    line: int  # 1-based line number in the file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    model: str | None = None
    tenant: str | None = None
    worker: str | None = None
    cached_tokens: int | None = None


class TraceFormatError(ValueError):
    """Bad lines in a trace: `errors` lists (line number, what is wrong)."""

    def __init__(self, path: str, errors: list[tuple[int, str]]) -> None:
        self.errors = errors
        shown = "\n".join(f"  line {n}: {msg}" for n, msg in errors[:10])
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        super().__init__(f"{path}: {len(errors)} bad line(s)\n{shown}{more}")


def _int(obj: dict[str, Any], key: str, minimum: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {value}")
    return value


def _optional(obj: dict[str, Any], key: str, kind: type) -> Any:
    value = obj.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ValueError(f"{key!r} must be a {kind.__name__} or null, got {value!r}")
    return value


def parse_record(text: str, line: int) -> TraceRecord:
    """One JSONL line -> a record; ValueError saying what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be a number of milliseconds >= 0, got {ts!r}")
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise ValueError("'hash_ids' must be a list of integers")
    return TraceRecord(
        line=line,
        timestamp_ms=float(ts),
        input_length=_int(obj, "input_length", 1),
        output_length=_int(obj, "output_length", 0),
        hash_ids=hash_ids,
        model=_optional(obj, "model", str),
        tenant=_optional(obj, "tenant", str),
        worker=_optional(obj, "worker", str),
        cached_tokens=_optional(obj, "cached_tokens", int),
    )


def parse_trace(
    lines: Iterable[str], source: str = "<trace>", skip_bad: bool = False
) -> tuple[list[TraceRecord], list[tuple[int, str]]]:
    """Records and bad lines; TraceFormatError on a bad line (unless `skip_bad`) or no record."""
    records: list[TraceRecord] = []
    errors: list[tuple[int, str]] = []
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            records.append(parse_record(text, n))
        except ValueError as e:
            errors.append((n, str(e)))
    if errors and not skip_bad:
        raise TraceFormatError(source, errors)
    if not records:
        raise TraceFormatError(source, errors or [(0, "no records")])
    return records, errors


def read_trace(
    path: str | Path, skip_bad: bool = False
) -> tuple[list[TraceRecord], list[tuple[int, str]]]:
    with open(path, encoding="utf-8") as f:
        return parse_trace(f, str(path), skip_bad)


def block_text(hash_id: int, block_tokens: int = BLOCK_TOKENS, seed: int = 0) -> str:
    """The fixed text of one hash id: exactly `block_tokens` tokens."""
    return filler(block_tokens, f"mooncake/{seed}/{block_tokens}/{hash_id}")


def record_prompt(rec: TraceRecord, block_tokens: int = BLOCK_TOKENS, seed: int = 0) -> str:
    """The record's prompt: its blocks' text cut to exactly `input_length` tokens."""
    needed = -(-rec.input_length // block_tokens)
    text = "".join(block_text(h, block_tokens, seed) for h in rec.hash_ids[:needed])
    if len(text) < rec.input_length:  # more tokens than hash ids: a tail of its own
        text += filler(rec.input_length - len(text), f"mooncake/{seed}/tail/line{rec.line}")
    return text[: rec.input_length]


def trace_requests(
    records: list[TraceRecord],
    model: str,
    kind: Kind = "completion",
    block_tokens: int = BLOCK_TOKENS,
    time_scale: float = 1.0,
    max_output_tokens: int | None = None,
    seed: int = 0,
) -> Iterator[RequestSpec]:
    """Specs in timestamp order, lazily (prompts are large), as docs/traces.md says."""
    assert time_scale >= 0 and block_tokens >= 1
    ordered = sorted(records, key=lambda r: r.timestamp_ms)
    t0 = ordered[0].timestamp_ms if ordered else 0.0
    for i, rec in enumerate(ordered):
        max_tokens = rec.output_length
        if max_output_tokens is not None:
            max_tokens = min(max_tokens, max_output_tokens)
        yield RequestSpec(
            i,
            kind,
            rec.model or model,
            max(1, max_tokens),
            arrival_s=(rec.timestamp_ms - t0) / 1000.0 * time_scale,
            tenant=rec.tenant,
            group_id=f"h{rec.hash_ids[0]}" if rec.hash_ids else None,
            **request_text(kind, record_prompt(rec, block_tokens, seed)),
        )
