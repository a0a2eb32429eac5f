"""OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models` over any Backend.

Responses and SSE chunks have OpenAI's shapes (streams end with `data: [DONE]`); usage carries
`prompt_tokens_details.cached_tokens`, and every response the header `x-urc-cached-tokens`
(sent with the headers of a stream, once the request is admitted), so a gateway learns what
was reused even from a stream without usage. `cache_salt` (vLLM's field) partitions the cache.
Sampling: `temperature`, `top_p`, `seed`, and vLLM's `top_k` and `ignore_eos`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from backends.http.errors import (
    ApiError,
    bool_param,
    int_param,
    json_response,
    public_param,
    read_json,
    salt_param,
)
from backends.http.generation import Backend, Generation, Sampling, TextStream, decode
from backends.http.served_model import ServedModel, pick_model

CACHED_TOKENS_HEADER = "x-urc-cached-tokens"
_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


def sse(chunk: Any) -> bytes:
    return b"data: " + _encode(chunk) + b"\n\n"


def stream_headers(gen: Generation) -> dict[str, str]:
    return {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        CACHED_TOKENS_HEADER: str(gen.cached_tokens),
    }


def float_param(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a number in [{low}, {high}]", param=name)
    return float(value)


def sampling(
    body: dict[str, Any], max_tokens: int, limit_set: bool, seed_field: str = "seed"
) -> Sampling:
    """The sampling fields OpenAI and vLLM accept (SGLang's too: its seed is `sampling_seed`),
    checked. top_k -1 or 0 means no limit."""
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise ApiError(400, "'top_k' must be an integer", param="top_k")
    seed = body.get(seed_field)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'{seed_field}' must be an integer", param=seed_field)
    top_p = float_param(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must be in (0, 1]", param="top_p")
    return Sampling(
        max_tokens=max_tokens,
        limit_set=limit_set,
        temperature=float_param(body, "temperature", 0.0, 2.0, 1.0),
        top_p=top_p,
        top_k=max(0, top_k or 0),
        seed=seed,
        ignore_eos=bool_param(body, "ignore_eos"),
    )


class _Call:
    """One parsed request: its prompt, sampling and stream options."""

    __slots__ = ("model", "prompt", "sampling", "salt", "public", "stream", "include_usage", "chat")

    def __init__(self, model: ServedModel, body: dict[str, Any], prompt: list[int], chat: bool):
        param = "messages" if chat else "prompt"
        requested = int_param(body, "max_tokens", 1)
        if chat and requested is None:
            requested = int_param(body, "max_completion_tokens", 1)
        if int_param(body, "n", 1) not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n")
        self.model = model
        self.prompt = prompt
        self.chat = chat
        max_tokens = model.max_tokens(len(prompt), requested, param)
        self.sampling = sampling(body, max_tokens, requested is not None)
        self.salt = salt_param(body)
        self.public = public_param(body) if self.salt else 0
        self.stream = bool_param(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        if options is not None and not self.stream:
            raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
        self.include_usage = bool_param(options or {}, "include_usage")


class OpenAIApi:
    def __init__(self, backend: Backend, models: dict[str, ServedModel], created: int) -> None:
        self.backend = backend
        self.models = models
        self.created = created

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.list_models)

    async def list_models(self, request: web.Request) -> web.Response:
        cards = [
            {
                "id": m.name,
                "object": "model",
                "created": self.created,
                "owned_by": "urc",
                "root": m.name,
                "max_model_len": m.max_model_len,
            }
            for m in self.models.values()
        ]
        return json_response({"object": "list", "data": cards})

    # -- parsing -----------------------------------------------------------------------------

    @staticmethod
    def _prompt(model: ServedModel, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' must not be empty", param="prompt")
            ids = model.tokenizer.encode(prompt)
            if not ids:
                raise ApiError(400, "'prompt' encoded to no tokens", param="prompt")
            return ids
        if isinstance(prompt, list):
            if any(isinstance(p, str | list) for p in prompt):
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            return model.check_ids(prompt, "prompt")
        raise ApiError(
            400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
        )

    @staticmethod
    def _messages(model: ServedModel, body: dict[str, Any]) -> list[int]:
        try:
            ids = model.tokenizer.encode_chat(body.get("messages"))  # type: ignore[arg-type]
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        if not ids:
            raise ApiError(400, "'messages' rendered to no tokens", param="messages")
        return ids

    def _submit(self, call: _Call) -> Generation:
        gen = Generation(call.model, call.prompt, call.sampling, call.salt, chat=call.chat)
        gen.public_tokens = call.public
        try:
            self.backend.submit(gen)
        except ValueError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded") from exc
        return gen

    # -- handlers ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        call = _Call(model, body, self._prompt(model, body), chat=False)
        return await self._serve(request, call)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        call = _Call(model, body, self._messages(model, body), chat=True)
        return await self._serve(request, call)

    async def _serve(self, request: web.Request, call: _Call) -> web.StreamResponse:
        gen = self._submit(call)
        chat = call.chat
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if call.stream:
                return await self._stream(request, gen, call, rid)
            await gen.wait_done()
            if not gen.finished:
                raise ApiError(503, "the request was aborted", type_="server_error")
            text = decode(call.model.tokenizer, gen.output)
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": gen.finish_reason,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": gen.finish_reason,
                }
            out = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": call.model.name,
                "choices": [choice],
                "usage": gen.usage(),
            }
            headers = {CACHED_TOKENS_HEADER: str(gen.cached_tokens)}
            return json_response(out, headers=headers)
        finally:
            self.backend.abort(gen)  # a no-op once finished; frees the engine if the client left

    async def _stream(
        self, request: web.Request, gen: Generation, call: _Call, rid: str
    ) -> web.StreamResponse:
        chat = call.chat
        await gen.wait_admitted()
        resp = web.StreamResponse(headers=stream_headers(gen))
        await resp.prepare(request)
        base: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": call.model.name,
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

        # the role rides on the first token, as vLLM sends it: a gateway takes the first body
        # byte for the first token (headers, with the cached-token count, leave on admission)
        first = chat
        text = TextStream(call.model.tokenizer)
        closed = False  # a completion's last text chunk carries its finish_reason
        async for n in gen.progress():
            last = gen.finished and n == len(gen.output)
            piece = text.piece(gen.output[:n], final=last)
            if last and not chat:
                await resp.write(chunk(piece, gen.finish_reason))
                closed = True
            elif piece or first:
                await resp.write(chunk(piece, None, first=first))
                first = False
        if not gen.finished:
            return resp  # aborted (shutting down): the stream just ends
        rest = text.piece(gen.output, final=True)
        if chat:
            if rest or first:
                await resp.write(chunk(rest, None, first=first))
            await resp.write(chunk("", gen.finish_reason))
        elif not closed:
            await resp.write(chunk(rest, gen.finish_reason))
        if call.include_usage:
            await resp.write(sse({**base, "choices": [], "usage": gen.usage()}))
        await resp.write(_DONE)
        await resp.write_eof()
        return resp
