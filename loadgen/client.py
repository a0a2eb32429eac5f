"""One streamed OpenAI-compatible request -> a `RequestResult` and the reply text (docs/loadgen.md).
Nothing here raises but cancellation: failures are error kinds (`RequestResult.error`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadgen.workloads import RequestSpec


@dataclass(slots=True)
class Route:
    """The gateway's routing explanation. Unknown keys stay in `fields`."""

    worker: str | None = None
    matched_tokens: int | None = None  # the gateway's prediction of the cached prefix
    reason: str | None = None
    prompt_tokens: int | None = None  # the gateway's own count
    fields: dict[str, str] = field(default_factory=dict)


def parse_int(value: object) -> int | None:
    """An int from a header or JSON field, None when absent or unparseable."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return value if isinstance(value, int) else int(float(value))
    except (ValueError, OverflowError):  # text that is no number, NaN, infinity
        return None


def parse_route(header: str | None) -> Route | None:
    """x-urc-route, `worker=w1; matched_tokens=2048; reason=cache_hit` or another spelling
    (docs/loadgen.md); None when the header is absent."""
    if header is None or not header.strip():
        return None
    pairs: dict[str, str] = {}
    text = header.strip()
    if text.startswith("{"):
        with contextlib.suppress(json.JSONDecodeError):
            obj = json.loads(text)
            if isinstance(obj, dict):
                pairs = {str(k): "" if v is None else str(v) for k, v in obj.items()}
    if not pairs:
        for item in re.split(r"[;,]", text):
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
    retry_after: int | None = None  # a refusal's Retry-After (seconds)

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


class _BadResponse(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def base_url(target: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/` -> `http://host:port/v1`."""
    url = target.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


def request_body(spec: RequestSpec) -> dict[str, Any]:
    text = {"messages": spec.messages} if spec.kind == "chat" else {"prompt": spec.prompt}
    return {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **text,
    }


def _content(choice: Any) -> str:
    """A chunk's new text: chat `delta.content`, completion `text` (or a whole `message`)."""
    if not isinstance(choice, dict):
        return ""
    for holder in (choice.get("delta"), choice.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("content"), str):
            return holder["content"]
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _read_chunk(result: RequestResult, chunk: Any, parts: list[str], sent_at: float) -> None:
    """Fold one JSON chunk into the result: content (TTFT on the first piece) and usage."""
    if not isinstance(chunk, dict):
        raise _BadResponse("protocol", f"chunk is not a JSON object: {str(chunk)[:80]}")
    if chunk.get("error") is not None:
        raise _BadResponse("stream_error", json.dumps(chunk["error"])[:200])
    for choice in chunk.get("choices") or []:
        if text := _content(choice):
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - sent_at
            parts.append(text)
            result.output_tokens += 1  # a content chunk; usage.completion_tokens overrides
    if isinstance(usage := chunk.get("usage"), dict):
        result.prompt_tokens = parse_int(usage.get("prompt_tokens"))
        completion = parse_int(usage.get("completion_tokens"))
        if completion is not None:
            result.output_tokens = completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            result.cached_tokens = parse_int(details.get("cached_tokens"))


async def _read_stream(
    resp: aiohttp.ClientResponse, result: RequestResult, parts: list[str], sent_at: float
) -> None:
    data_lines = 0
    async for raw in resp.content:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:`/`id:` fields
        data = line[5:].strip()
        data_lines += 1
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise _BadResponse("protocol", f"malformed JSON in stream: {data[:80]!r}") from None
        _read_chunk(result, chunk, parts, sent_at)
    if data_lines == 0:
        raise _BadResponse("protocol", "no server-sent-event data lines in the response")
    raise _BadResponse("truncated", "the stream ended without data: [DONE]")


async def stream_request(
    http: aiohttp.ClientSession,
    url_v1: str,
    spec: RequestSpec,
    result: RequestResult,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> str | None:
    """Send `spec`, fill `result`; return the reply text, or None when it failed."""
    path = "/chat/completions" if spec.kind == "chat" else "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parts: list[str] = []
    sent_at = time.perf_counter()
    try:
        async with (
            asyncio.timeout(timeout_s),
            http.post(url_v1 + path, json=request_body(spec), headers=headers) as resp,
        ):
            result.status = resp.status
            result.route = parse_route(resp.headers.get("x-urc-route"))
            result.header_cached_tokens = parse_int(resp.headers.get("x-urc-cached-tokens"))
            if resp.status != 200:
                result.retry_after = parse_int(resp.headers.get("Retry-After"))
                body = await resp.text(errors="replace")
                raise _BadResponse(f"http_{resp.status}", body[:200])
            if resp.content_type == "application/json":  # the endpoint ignored `stream`
                _read_chunk(result, await resp.json(content_type=None), parts, sent_at)
                if result.ttft_s is None:
                    raise _BadResponse("protocol", "a JSON answer with no content")
            else:
                await _read_stream(resp, result, parts, sent_at)
        result.latency_s = time.perf_counter() - sent_at
        return "".join(parts)
    except _BadResponse as e:
        result.error, result.detail = e.kind, str(e)
    except TimeoutError:
        result.error, result.detail = "timeout", f"no complete answer within {timeout_s:g}s"
    except aiohttp.ClientPayloadError as e:
        result.error, result.detail = "truncated", str(e)[:200]
    except aiohttp.ClientResponseError as e:
        result.error, result.detail = "protocol", str(e)[:200]
    except (aiohttp.ClientError, OSError) as e:
        result.error, result.detail = "connection", f"{type(e).__name__}: {e}"[:200]
    except (ValueError, UnicodeError) as e:  # unreadable bodies, over-long lines
        result.error, result.detail = "protocol", f"{type(e).__name__}: {e}"[:200]
    except asyncio.CancelledError:
        result.error, result.detail = "cancelled", "still in flight when the run ended"
        raise
    except Exception as e:  # a bug here must not end the run
        result.error, result.detail = "client", f"{type(e).__name__}: {e}"[:200]
    return None


async def list_models(
    http: aiohttp.ClientSession, url_v1: str, api_key: str | None = None
) -> list[str]:
    """The ids of GET /v1/models, in the endpoint's order."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with http.get(url_v1 + "/models", headers=headers) as resp:
        resp.raise_for_status()
        data = await resp.json(content_type=None)
    return [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
