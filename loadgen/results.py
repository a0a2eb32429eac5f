"""What one request came back with: `RequestResult`, and the gateway's `x-urc-route` header.

Error kinds (`RequestResult.error`; None = success):
  http_<status>  the endpoint answered with a non-200 status
  connection     refused, reset or closed before the response (aiohttp connection errors)
  timeout        no complete answer within the per-request timeout
  truncated      the stream stopped before `data: [DONE]`
  protocol       a response that is not the OpenAI streaming format (bad JSON, no SSE lines)
  stream_error   an `{"error": ...}` object inside the stream
  client         a bug on our side (the message is in `detail`); never crashes the run
  cancelled      still in flight when the run's duration (plus grace) ran out
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from loadgen.workloads import RequestSpec


@dataclass(slots=True)
class Route:
    """The gateway's routing explanation. Unknown keys stay in `fields`."""

    worker: str | None = None
    matched_tokens: int | None = None  # the gateway's prediction of the cached prefix
    reason: str | None = None
    prompt_tokens: int | None = None  # the gateway's own count
    fields: dict[str, str] = field(default_factory=dict)


_PAIR_SEP = re.compile(r"[;,]")


def parse_int(value: object) -> int | None:
    """An int from a header or JSON field, None when absent or unparseable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str):
        try:
            return int(float(value.strip()))
        except ValueError:
            return None
    return None


def parse_route(header: str | None) -> Route | None:
    """`worker=w1; matched_tokens=2048; reason=cache_hit` (also `,`-separated, `key: value`, or
    a JSON object; the gateway also sends prompt_tokens); keys are case-insensitive, `-` = `_`.
    None when the header is absent."""
    if header is None or not header.strip():
        return None
    pairs: dict[str, str] = {}
    text = header.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
            if isinstance(obj, dict):
                pairs = {str(k): "" if v is None else str(v) for k, v in obj.items()}
        except json.JSONDecodeError:
            pass
    if not pairs:
        for item in _PAIR_SEP.split(text):
            key, sep, value = item.partition("=")
            if not sep:
                key, sep, value = item.partition(":")
            if sep and key.strip():
                pairs[key.strip()] = value.strip().strip('"')
    fields = {k.lower().replace("-", "_"): v for k, v in pairs.items()}
    worker = fields.pop("worker", None) or None
    matched = parse_int(fields.pop("matched_tokens", None))
    reason = fields.pop("reason", None) or None
    prompt = parse_int(fields.pop("prompt_tokens", None))
    return Route(worker, matched, reason, prompt, fields)


@dataclass(slots=True)
class RequestResult:
    index: int  # the spec's index
    model: str
    tenant: str | None
    session_id: str | None
    group_id: str | None
    start_s: float  # when it was sent, seconds after the run started
    error: str | None = None
    detail: str = ""
    status: int | None = None
    ttft_s: float | None = None  # to the first non-empty content chunk
    latency_s: float | None = None  # to the end of the stream
    prompt_tokens: int | None = None  # usage, as the worker reported it
    output_tokens: int = 0  # usage.completion_tokens, else the content chunks counted
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    header_cached_tokens: int | None = None  # x-urc-cached-tokens (the worker's, passed on)
    route: Route | None = None  # x-urc-route

    @classmethod
    def for_spec(cls, spec: RequestSpec, start_s: float) -> RequestResult:
        return cls(spec.index, spec.model, spec.tenant, spec.session_id, spec.group_id, start_s)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def predicted_tokens(self) -> int | None:
        """The gateway's predicted cached prefix: x-urc-route's matched_tokens."""
        return self.route.matched_tokens if self.route is not None else None

    @property
    def actual_cached_tokens(self) -> int | None:
        """What the worker reused: usage's cached_tokens, else the x-urc-cached-tokens header."""
        return self.cached_tokens if self.cached_tokens is not None else self.header_cached_tokens
