"""OpenAI's `/v1/embeddings` over an engine (docs/workers.md): `input` a string, a list of
strings, a list of token ids or a list of such lists; one unit-norm vector per input, as floats
or base64 (little-endian float32, what the `openai` client asks for by default)."""

from __future__ import annotations

import base64
import struct
from typing import Any

from aiohttp import web

from backends.http.generation import ServedModel, pick_model
from backends.http.openai_api import int_param, json_response, read_json
from backends.http.runner import EngineRunner
from core.errors import APIError

MAX_INPUTS = 2048  # OpenAI's limit per request
_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def prompts(model: ServedModel, value: Any) -> list[list[int]]:
    """Each input's token ids (a text tokenized as a completion prompt is), checked."""
    if isinstance(value, str) or (value and isinstance(value, list) and type(value[0]) is int):
        value = [value]
    if not isinstance(value, list) or not value:
        raise APIError(400, f"'input' must be {_SHAPES}", param="input")
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"'input' holds more than {MAX_INPUTS} inputs", param="input")
    out = []
    for item in value:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "'input' holds an empty string", param="input")
            ids = model.tokenizer.encode(item)
        elif isinstance(item, list):
            ids = model.check_ids(item, "input")
        else:
            raise APIError(400, f"'input' must be {_SHAPES}", param="input")
        if len(ids) > model.max_model_len:
            message = (
                f"This model's maximum context length is {model.max_model_len} tokens, "
                f"an input has {len(ids)}"
            )
            raise APIError(400, message, param="input", code="context_length_exceeded")
        out.append(ids)
    return out


def encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


class EmbeddingsApi:
    def __init__(self, backend: EngineRunner, models: dict[str, ServedModel]) -> None:
        self.backend = backend
        self.models = models

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.serve)

    async def serve(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        if model.base is not None:
            message = "embeddings of a LoRA adapter are not supported: ask its base model"
            raise APIError(400, message, param="model")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            message = "'encoding_format' must be 'float' or 'base64'"
            raise APIError(400, message, param="encoding_format")
        dimensions = int_param(body, "dimensions", 1)
        ids = prompts(model, body.get("input"))
        vectors = await self.backend.embed(model, ids)
        if dimensions is not None and dimensions != len(vectors[0]):
            message = f"'dimensions' must be this model's size, {len(vectors[0])}"
            raise APIError(400, message, param="dimensions")
        data = [
            {"object": "embedding", "index": i, "embedding": encoded(v, encoding)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(p) for p in ids)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return json_response({"object": "list", "data": data, "model": model.name, "usage": usage})
