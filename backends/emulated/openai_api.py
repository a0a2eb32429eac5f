"""OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models` on the emulated engine.

Responses and SSE chunks have OpenAI's shapes (streams end with `data: [DONE]`); usage carries
`prompt_tokens_details.cached_tokens`, and every response the header `x-urc-cached-tokens`
(sent with the headers of a stream, once the request is admitted), so a gateway learns what
was reused even from a stream without usage. `cache_salt` (vLLM's field) partitions the cache.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from backends.emulated.api_errors import (
    ApiError,
    bool_param,
    int_param,
    json_response,
    read_json,
    salt_param,
)
from backends.emulated.engine import State, output_bytes
from backends.emulated.model import ServedModel
from backends.emulated.runner import EngineRunner, Generation

CACHED_TOKENS_HEADER = "x-urc-cached-tokens"
_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


def sse(chunk: Any) -> bytes:
    return b"data: " + _encode(chunk) + b"\n\n"


def usage(gen: Generation) -> dict[str, Any]:
    req = gen.req
    completion = req.generated if req.state is State.FINISHED else 0
    return {
        "prompt_tokens": len(req.prompt),
        "completion_tokens": completion,
        "total_tokens": len(req.prompt) + completion,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def stream_headers(gen: Generation) -> dict[str, str]:
    return {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        CACHED_TOKENS_HEADER: str(gen.req.cached_tokens),
    }


class _Call:
    """One parsed request: its prompt and sampling parameters."""

    __slots__ = ("prompt", "max_tokens", "finish_reason", "salt", "stream", "include_usage")

    def __init__(self, model: ServedModel, body: dict[str, Any], prompt: list[int], chat: bool):
        param = "messages" if chat else "prompt"
        requested = int_param(body, "max_tokens", 1)
        if chat and requested is None:
            requested = int_param(body, "max_completion_tokens", 1)
        if int_param(body, "n", 1) not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n")
        self.prompt = prompt
        self.max_tokens = model.max_tokens(len(prompt), requested, param)
        # a limit the client set is hit ("length"); without one the answer just ends ("stop")
        self.finish_reason = "stop" if requested is None and chat else "length"
        self.salt = salt_param(body)
        self.stream = bool_param(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        if options is not None and not self.stream:
            raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
        self.include_usage = bool_param(options or {}, "include_usage")


class OpenAIApi:
    def __init__(self, runner: EngineRunner, model: ServedModel, created: int) -> None:
        self.runner = runner
        self.model = model
        self.created = created

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "urc",
            "root": self.model.name,
            "max_model_len": self.model.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    # -- parsing -----------------------------------------------------------------------------

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' must not be empty", param="prompt")
            return self.model.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            if any(isinstance(p, str | list) for p in prompt):
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            return self.model.check_ids(prompt, "prompt")
        raise ApiError(
            400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
        )

    def _messages(self, body: dict[str, Any]) -> list[int]:
        try:
            ids = self.model.tokenizer.encode_chat(body.get("messages"))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        if not ids:
            raise ApiError(400, "'messages' rendered to no tokens", param="messages")
        return ids

    def _submit(self, call: _Call) -> Generation:
        try:
            return self.runner.submit(call.prompt, call.max_tokens, call.salt)
        except ValueError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded") from exc

    # -- handlers ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self.model.check_model(body.get("model"))
        call = _Call(self.model, body, self._prompt(body), chat=False)
        return await self._serve(request, call, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self.model.check_model(body.get("model"))
        call = _Call(self.model, body, self._messages(body), chat=True)
        return await self._serve(request, call, chat=True)

    async def _serve(self, request: web.Request, call: _Call, chat: bool) -> web.StreamResponse:
        gen = self._submit(call)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if call.stream:
                return await self._stream(request, gen, call, rid, chat)
            await self.runner.finished(gen)
            if gen.req.state is not State.FINISHED:
                raise ApiError(503, "the request was aborted", type_="server_error")
            text = output_bytes(0, gen.req.generated).decode()
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": call.finish_reason,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": call.finish_reason,
                }
            out = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model.name,
                "choices": [choice],
                "usage": usage(gen),
            }
            headers = {CACHED_TOKENS_HEADER: str(gen.req.cached_tokens)}
            return json_response(out, headers=headers)
        finally:
            self.runner.abort(gen)  # a no-op once finished; frees the engine if the client left

    async def _stream(
        self, request: web.Request, gen: Generation, call: _Call, rid: str, chat: bool
    ) -> web.StreamResponse:
        await self.runner.admitted(gen)
        resp = web.StreamResponse(headers=stream_headers(gen))
        await resp.prepare(request)
        base: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model.name,
        }
        if call.include_usage:
            base["usage"] = None  # OpenAI: null on every chunk but the last

        def chunk(piece: str, finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if piece:
                    delta["content"] = piece
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": piece}
            choice["logprobs"] = None
            choice["finish_reason"] = finish
            return sse({**base, "choices": [choice]})

        if chat:
            await resp.write(chunk("", None, first=True))
        sent = 0
        async for n in self.runner.progress(gen):
            piece = output_bytes(sent, n).decode()
            sent = n
            last = gen.req.state is State.FINISHED and not chat
            await resp.write(chunk(piece, call.finish_reason if last else None))
        if gen.req.state is not State.FINISHED:
            return resp  # aborted (shutting down): the stream just ends
        if chat:
            await resp.write(chunk("", call.finish_reason))
        if call.include_usage:
            await resp.write(sse({**base, "choices": [], "usage": usage(gen)}))
        await resp.write(_DONE)
        await resp.write_eof()
        return resp
