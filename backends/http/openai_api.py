"""OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models` over an engine, with
the cached-token header and `cache_salt` (docs/workers.md); and the JSON in and out of every
endpoint of the worker: OpenAI-shaped errors (never a 500 for bad input), checked parameters."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from backends.http.generation import (
    Generation,
    SamplingParams,
    ServedModel,
    TextStream,
    decode,
    pick_model,
)
from backends.http.runner import EngineRunner
from core.errors import APIError
from core.logs import REQUEST_ID_HEADER, RequestIds
from core.strict_json import BodyError, decode_object

log = logging.getLogger(__name__)

CACHED_TOKENS_HEADER = "x-urc-cached-tokens"
# the gateway's protect hint: a rank (vLLM's priority) active elsewhere in the request's pool,
# which the engine's step budget protects while the request is here (docs/workers.md)
PROTECT_HEADER = "x-urc-protect"
_DONE = b"data: [DONE]\n\n"
_TOO_LONG = "context_length_exceeded"  # the code of a prompt the engine can never run
_encode = msgspec.json.encode
_request_ids = RequestIds()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def error_response(error: APIError) -> web.Response:
    return web.Response(body=error.body(), status=error.status, content_type="application/json")


_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, "invalid_request")
        return error_response(APIError(exc.status, exc.reason, code=code))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(APIError(500, "internal error", type="server_error"))


def request_id(request: web.Request) -> str:
    """The request's x-request-id (a gateway sends its own), else one made here; answered in
    the response's header and named in this worker's log lines (docs/operability.md)."""
    found = request.get(REQUEST_ID_HEADER)
    if found is None:
        found = request[REQUEST_ID_HEADER] = _request_ids.of(request.headers.get(REQUEST_ID_HEADER))
    return str(found)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REQUEST_ID_HEADER] = request_id(request)


def log_generation(request: web.Request, gen: Generation) -> None:
    """At debug: one line per generation, with the ids that tie it to the gateway's request."""
    fields = {
        "request_id": request_id(request),
        "traceparent": request.headers.get("traceparent"),
        "model": gen.model.name,
        "priority": gen.priority,
        "protect": gen.protect,
        "prompt_tokens": len(gen.prompt),
        "cached_tokens": gen.cached_tokens,
        "output_tokens": len(gen.output),
        "finish": gen.finish_reason or ("aborted" if gen.aborted else None),
    }
    log.debug("%s %s", request.method, request.path, extra={"fields": fields})


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (400 when it is not one, 413 when too large)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, exc.text or "request body too large", code="request_too_large") from exc
    try:
        return decode_object(raw)
    except BodyError as exc:
        raise APIError(400, str(exc), code="invalid_json") from exc


def int_param(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise APIError(400, f"'{name}' must be an integer >= {minimum}", param=name)
    return value


def bool_param(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean", param=name)
    return value


def public_param(body: dict[str, Any]) -> int:
    """Our `urc_public_tokens` (the gateway's, for a tenant in shared isolation): how many
    leading prompt tokens are keyed in the shared namespace before the salt (needs one)."""
    value = body.get("urc_public_tokens", 0)
    if type(value) is not int or value < 0:
        raise APIError(
            400, "'urc_public_tokens' must be an integer >= 0", param="urc_public_tokens"
        )
    return value


def priority_param(body: dict[str, Any]) -> int:
    """vLLM's `priority`: an integer in int64's range, lower scheduled earlier (default 0).
    Our engines always schedule by it; vLLM only under `--scheduling-policy priority`."""
    value = body.get("priority")
    if value is None:
        return 0
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise APIError(400, "'priority' must be a 64-bit integer", param="priority")
    return value


def protect_header(value: str) -> int:
    """`x-urc-protect`'s rank: an integer in int64's range, as `priority`."""
    try:
        rank = int(value)
    except ValueError:
        rank = 2**63
    if not -(2**63) <= rank < 2**63:
        raise APIError(400, f"'{PROTECT_HEADER}' must be a 64-bit integer", param=PROTECT_HEADER)
    return rank


def salt_param(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt`: a non-empty string, or absent."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise APIError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
    return salt


def sse(chunk: Any) -> bytes:
    return b"data: " + _encode(chunk) + b"\n\n"


async def respond(
    request: web.Request,
    backend: EngineRunner,
    gen: Generation,
    stream: bool,
    whole: Callable[[], Any],
    chunk: Callable[[int, bool], bytes],
    submit_code: str | None = None,
    done: bytes = _DONE,
) -> web.StreamResponse:
    """Run `gen` and answer `whole()` once it finished, or stream `chunk(n, final)` for each
    output length n (final: the finished end, sent once) then `done` (`[DONE]`), the
    cached-token header leaving on admission. A submit's ValueError is a 400, an abort a 503 (a
    stream just ends)."""
    hint = request.headers.get(PROTECT_HEADER)
    if hint is not None:
        gen.protect = protect_header(hint)
    try:
        backend.submit(gen)
    except ValueError as exc:
        raise APIError(400, str(exc), code=submit_code) from exc
    try:
        if not stream:
            await gen.wait()
            if not gen.finished:
                raise APIError(503, "the request was aborted", type="server_error")
            return json_response(whole(), headers={CACHED_TOKENS_HEADER: str(gen.cached_tokens)})
        await gen.wait(admitted=True)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                CACHED_TOKENS_HEADER: str(gen.cached_tokens),
            }
        )
        await resp.prepare(request)
        final = False
        async for n in gen.progress():
            final = gen.finished and n == len(gen.output)
            await resp.write(chunk(n, final))
        if gen.finished:  # else aborted (shutting down): the stream just ends
            await resp.write((b"" if final else chunk(len(gen.output), True)) + done)
            await resp.write_eof()
        return resp
    finally:
        backend.abort(gen)  # a no-op once finished; frees the engine if the client left
        if log.isEnabledFor(logging.DEBUG):
            log_generation(request, gen)


def float_param(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise APIError(400, f"'{name}' must be a number in [{low}, {high}]", param=name)
    return float(value)


def sampling(
    body: dict[str, Any], max_tokens: int, limit_set: bool, seed_field: str = "seed"
) -> SamplingParams:
    """The sampling fields OpenAI and vLLM accept (SGLang's too: its seed is `sampling_seed`),
    checked. top_k -1 or 0 means no limit."""
    for name in ("top_k", seed_field):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise APIError(400, f"'{name}' must be an integer", param=name)
    top_p = float_param(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise APIError(400, "'top_p' must be in (0, 1]", param="top_p")
    return SamplingParams(
        max_tokens=max_tokens,
        limit_set=limit_set,
        temperature=float_param(body, "temperature", 0.0, 2.0, 1.0),
        top_p=top_p,
        top_k=max(0, body.get("top_k") or 0),
        seed=body.get(seed_field),
        ignore_eos=bool_param(body, "ignore_eos"),
    )


class _Call:
    """One parsed request: its generation and stream options."""

    __slots__ = ("gen", "chat", "stream", "include_usage")

    def __init__(self, model: ServedModel, body: dict[str, Any], chat: bool) -> None:
        prompt = _messages(model, body) if chat else _prompt(model, body)
        requested = int_param(body, "max_tokens", 1)
        if chat and requested is None:
            requested = int_param(body, "max_completion_tokens", 1)
        if int_param(body, "n", 1) not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        max_tokens = model.max_tokens(len(prompt), requested, "messages" if chat else "prompt")
        params = sampling(body, max_tokens, requested is not None)
        salt = salt_param(body)
        self.gen = Generation(model, prompt, params, salt, chat)
        self.gen.public_tokens = public_param(body) if salt else 0
        self.gen.priority = priority_param(body)
        self.chat = chat
        self.stream = bool_param(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        if options is not None and not self.stream:
            raise APIError(400, "'stream_options' needs 'stream': true", param="stream_options")
        self.include_usage = bool_param(options or {}, "include_usage")


def _prompt(model: ServedModel, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        ids = model.tokenizer.encode(prompt)
        if not ids:
            raise APIError(400, "'prompt' encoded to no tokens", param="prompt")
        return ids
    if isinstance(prompt, list):
        if any(isinstance(p, str | list) for p in prompt):
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        return model.check_ids(prompt, "prompt")
    raise APIError(
        400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
    )


def _messages(model: ServedModel, body: dict[str, Any]) -> list[int]:
    try:
        ids = model.tokenizer.encode_chat(body.get("messages"))  # type: ignore[arg-type]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    if not ids:
        raise APIError(400, "'messages' rendered to no tokens", param="messages")
    return ids


class OpenAIApi:
    def __init__(self, backend: EngineRunner, models: dict[str, ServedModel], created: int) -> None:
        self.backend = backend
        self.models = models
        self.created = created

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", partial(self._serve, chat=False))
        app.router.add_post("/v1/chat/completions", partial(self._serve, chat=True))
        app.router.add_get("/v1/models", self.list_models)

    async def list_models(self, request: web.Request) -> web.Response:
        cards = [  # vLLM's: an adapter's root is its path, its parent the base model
            {
                "id": m.name,
                "object": "model",
                "created": self.created,
                "owned_by": "urc",
                "root": m.name if m.base is None else m.lora_path,
                "parent": None if m.base is None else m.base.name,
                "max_model_len": m.max_model_len,
            }
            for m in self.models.values()
        ]
        return json_response({"object": "list", "data": cards})

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        call = _Call(model, body, chat)
        gen = call.gen
        head: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model.name,
        }

        def whole() -> dict[str, Any]:
            text = decode(model.tokenizer, gen.output)
            part = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return {**head, "choices": [_choice(part, gen.finish_reason)], "usage": gen.usage()}

        return await respond(
            request, self.backend, gen, call.stream, whole, _chunks(call, gen, head), _TOO_LONG
        )


def _choice(part: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"index": 0, **part, "logprobs": None, "finish_reason": finish}


def _chunks(call: _Call, gen: Generation, head: dict[str, Any]) -> Callable[[int, bool], bytes]:
    """The SSE chunks of a stream. The role rides on the first token, as vLLM sends it: a
    gateway takes the first body byte for the first token."""
    chat = call.chat
    base = {**head, "object": "chat.completion.chunk"} if chat else dict(head)
    if call.include_usage:
        base["usage"] = None  # OpenAI: null on every chunk but the last
    text = TextStream(gen.model.tokenizer)
    first = chat

    def chunk(n: int, final: bool) -> bytes:
        nonlocal first
        piece = text.piece(gen.output[:n], final=final)
        parts: list[tuple[dict[str, Any], str | None]] = []
        if not chat and (piece or final):  # a completion's last text carries the finish
            parts.append(({"text": piece}, gen.finish_reason if final else None))
        if chat and (piece or first):
            delta = {"role": "assistant", "content": piece} if first else {"content": piece}
            parts.append(({"delta": delta}, None))
            first = False
        if chat and final:
            parts.append(({"delta": {}}, gen.finish_reason))
        out = b"".join(sse({**base, "choices": [_choice(p, f)]}) for p, f in parts)
        if final and call.include_usage:
            out += sse({**base, "choices": [], "usage": gen.usage()})
        return out

    return chunk
