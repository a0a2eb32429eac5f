"""SGLang's native endpoints (`/generate`, `/get_server_info`, ...), so sglang-router and SGLang
clients can use our workers (docs/workers.md)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from backends.http.generation import Generation, SamplingParams, ServedModel, decode, pick_model
from backends.http.openai_api import (
    bool_param,
    int_param,
    json_response,
    read_json,
    respond,
    salt_param,
    sampling,
    sse,
)
from core.errors import APIError

if TYPE_CHECKING:
    from backends.http.worker import Worker

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_TIMEOUT_S = 20.0


class SGLangApi:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.backend = worker.runner
        self.engine = worker.engine
        self.models = worker.engine.models

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
        model = next(iter(self.models.values()))
        gen = Generation(model, [0], SamplingParams(1), None)
        self.backend.submit(gen)
        try:
            await asyncio.wait_for(gen.wait(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503)
        finally:
            self.backend.abort(gen)
        return web.Response(status=200 if gen.finished else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        model = pick_model(self.models, request.query.get("model"))
        return json_response(
            {
                "model_path": model.name,
                "tokenizer_path": model.tokenizer_spec,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                **self.engine.model_info,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        load = self.backend.load()
        internal = {
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "token_usage": load.used_tokens / max(1, load.capacity_tokens),
        }
        return json_response(
            {**self.server_args(), "internal_states": [internal], "version": self.engine.version}
        )

    def server_args(self) -> dict[str, Any]:
        """The worker's settings under SGLang's names (for /get_server_info)."""
        first = next(iter(self.models.values()))
        return {
            "model_path": first.name,
            "served_model_name": first.name,
            "tokenizer_path": first.tokenizer_spec,
            "host": self.worker.flags.host,
            "port": self.worker.port,
            "context_length": first.max_model_len,
            "max_req_input_len": first.max_model_len - 1,
            "tp_size": 1,
            "dp_size": 1,
            "disaggregation_mode": "null",
            "page_size": self.engine.block_size,
            "max_total_num_tokens": self.backend.load().capacity_tokens,
            **self.engine.settings(),
            "kv_group": first.kv_group,
            "incarnation": self.worker.incarnation,
        }

    async def get_load(self, request: web.Request) -> web.Response:
        load = self.backend.load()
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": load.used_tokens,
                }
            ]
        )

    # -- /generate ---------------------------------------------------------------------------

    @staticmethod
    def _prompt(model: ServedModel, body: dict[str, Any]) -> list[int]:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise APIError(400, "give exactly one of 'text' and 'input_ids'", param="text")
        if isinstance(text, str):
            if not text:
                raise APIError(400, "'text' must not be empty", param="text")
            return model.tokenizer.encode(text)
        if isinstance(ids, list) and not any(isinstance(i, list) for i in ids):
            return model.check_ids(ids, "input_ids")
        raise APIError(400, "one prompt per request: a string or a list of token ids")

    @staticmethod
    def _sampling(model: ServedModel, body: dict[str, Any], prompt_len: int) -> SamplingParams:
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise APIError(400, "'sampling_params' must be an object", param="sampling_params")
        requested = int_param(params, "max_new_tokens", 1)
        max_tokens = model.max_tokens(
            prompt_len, DEFAULT_MAX_NEW_TOKENS if requested is None else requested, "text"
        )
        # SGLang always has a limit: 128 unless told
        return sampling(params, max_tokens, limit_set=True, seed_field="sampling_seed")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        prompt = self._prompt(model, body)
        gen = Generation(model, prompt, self._sampling(model, body, len(prompt)), salt_param(body))
        stream = bool_param(body, "stream")
        rid = body.get("rid")
        rid = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
        start = time.monotonic()

        def output(n: int, final: bool) -> dict[str, Any]:
            ids = gen.output[:n]
            finish: dict[str, Any] | None = None
            if final:
                finish = {"type": "length", "length": n}
                if gen.finish_reason == "stop":
                    finish = {"type": "stop", "matched": ids[-1] if ids else None}
            return {
                "text": decode(model.tokenizer, ids),
                "output_ids": ids,
                "meta_info": {
                    "id": rid,
                    "finish_reason": finish,
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n,
                    "cached_tokens": gen.cached_tokens,
                    "e2e_latency": time.monotonic() - start,
                    "weight_version": "default",
                },
            }

        whole, event = (lambda: output(len(gen.output), True)), (lambda n, f: sse(output(n, f)))
        return await respond(request, self.backend, gen, stream, whole, event)
