"""SGLang's native endpoints, so sglang-router and SGLang clients can use the emulated worker.

- `/health` (alive), `/health_generate` (a one-token generation went through the engine)
- `/get_model_info` and `/model_info`, `/get_server_info` and `/server_info` (sglang-router
  0.3.x probes both spellings), `/get_load`
- `/generate`: `{"text" | "input_ids", "sampling_params": {"max_new_tokens", ...}, "stream",
  "rid"}` -> `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency", ...}}`; streamed as SSE events that
  each carry the whole output so far (SGLang's default, non-incremental), then `[DONE]`.
  `cache_salt` (top level) partitions the cache as on the OpenAI endpoints.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

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
from backends.emulated.openai_api import CACHED_TOKENS_HEADER, sse, stream_headers
from backends.emulated.runner import EngineRunner, Generation

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_TIMEOUT_S = 20.0


class SGLangApi:
    def __init__(
        self,
        runner: EngineRunner,
        model: ServedModel,
        server_args: Callable[[], dict[str, Any]],
        version: str,
    ) -> None:
        self.runner = runner
        self.model = model
        self.server_args = server_args  # the worker's settings, SGLang's names
        self.version = version

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_get("/get_load", self.get_load)
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        gen = self.runner.submit([0], 1, None)
        try:
            await asyncio.wait_for(self.runner.finished(gen), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503)
        finally:
            self.runner.abort(gen)
        return web.Response(status=200 if gen.req.state is State.FINISHED else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "model_path": self.model.name,
                "tokenizer_path": "byte",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "emulated",
                "architectures": ["EmulatedForCausalLM"],
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        load = self.runner.engine.load()
        stats = self.runner.engine.cache.stats()
        internal = {
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "token_usage": (stats.capacity_tokens - stats.free_tokens) / stats.capacity_tokens,
        }
        return json_response(
            {**self.server_args(), "internal_states": [internal], "version": self.version}
        )

    async def get_load(self, request: web.Request) -> web.Response:
        load = self.runner.engine.load()
        stats = self.runner.engine.cache.stats()
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": stats.capacity_tokens - stats.free_tokens,
                }
            ]
        )

    # -- /generate ---------------------------------------------------------------------------

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ApiError(400, "give exactly one of 'text' and 'input_ids'", param="text")
        if isinstance(text, str):
            if not text:
                raise ApiError(400, "'text' must not be empty", param="text")
            return self.model.tokenizer.encode(text)
        if isinstance(ids, list) and not any(isinstance(i, list) for i in ids):
            return self.model.check_ids(ids, "input_ids")
        raise ApiError(400, "one prompt per request: a string or a list of token ids")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        prompt = self._prompt(body)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ApiError(400, "'sampling_params' must be an object", param="sampling_params")
        requested = int_param(params, "max_new_tokens", 1)
        max_tokens = self.model.max_tokens(
            len(prompt), DEFAULT_MAX_NEW_TOKENS if requested is None else requested, "text"
        )
        salt = salt_param(body)
        stream = bool_param(body, "stream")
        rid = body.get("rid")
        rid = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
        try:
            gen = self.runner.submit(prompt, max_tokens, salt)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        start = time.monotonic()
        try:
            if stream:
                return await self._stream(request, gen, rid, start)
            await self.runner.finished(gen)
            if gen.req.state is not State.FINISHED:
                raise ApiError(503, "the request was aborted", type_="server_error")
            headers = {CACHED_TOKENS_HEADER: str(gen.req.cached_tokens)}
            return json_response(self._output(gen, rid, start), headers=headers)
        finally:
            self.runner.abort(gen)

    def _output(self, gen: Generation, rid: str, start: float) -> dict[str, Any]:
        req = gen.req
        n = self.runner.tokens(gen)
        done = req.state is State.FINISHED
        out = output_bytes(0, n)
        return {
            "text": out.decode(),
            "output_ids": list(out),
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "length", "length": n} if done else None,
                "prompt_tokens": len(req.prompt),
                "completion_tokens": n,
                "cached_tokens": req.cached_tokens,
                "e2e_latency": time.monotonic() - start,
                "weight_version": "default",
            },
        }

    async def _stream(
        self, request: web.Request, gen: Generation, rid: str, start: float
    ) -> web.StreamResponse:
        await self.runner.admitted(gen)
        resp = web.StreamResponse(headers=stream_headers(gen))
        await resp.prepare(request)
        async for _ in self.runner.progress(gen):
            await resp.write(sse(self._output(gen, rid, start)))
        if gen.req.state is not State.FINISHED:
            return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
