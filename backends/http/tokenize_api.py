"""vLLM's `/tokenize` and `/detokenize` over a worker's models (docs/workers.md): the request
and response shapes of vLLM's OpenAI server, the ids the worker itself would run."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from backends.http.generation import ServedModel, pick_model
from backends.http.openai_api import bool_param, json_response, read_json
from core.errors import APIError


class TokenizeApi:
    def __init__(self, models: dict[str, ServedModel]) -> None:
        self.models = models

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def tokenize(self, request: web.Request) -> web.Response:
        """`{"model"?, "prompt", "add_special_tokens"=true}` or `{"model"?, "messages",
        "add_generation_prompt"=true, "add_special_tokens"=false, "tools"?,
        "chat_template_kwargs"?}`, both with `return_token_strs`=false -> `{"count",
        "max_model_len", "tokens", "token_strs"}` (token_strs null unless asked)."""
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        ids = _chat_ids(model, body) if "messages" in body else _prompt_ids(model, body)
        strs = model.tokenizer.token_strs(ids) if bool_param(body, "return_token_strs") else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": model.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """`{"model"?, "tokens": [id, ...]}` -> `{"prompt": text}`, special tokens kept; 400
        for an id the tokenizer cannot take (outside the byte vocabulary; over u32 for a Hugging
        Face tokenizer, which drops other unknown ids, as vLLM's does)."""
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in tokens
        ):
            raise APIError(400, "'tokens' must be a list of integers >= 0", param="tokens")
        try:
            text = model.tokenizer.decode(tokens)
        except (ValueError, OverflowError) as exc:  # tokenizers: an id over u32 overflows
            raise APIError(400, str(exc), param="tokens") from exc
        return json_response({"prompt": text})


def _flag(body: dict[str, Any], name: str, *, default: bool) -> bool:
    """A boolean field of vLLM's request; absent or null: its default."""
    return default if body.get(name) is None else bool_param(body, name)


def _prompt_ids(model: ServedModel, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
    tokenizer = model.tokenizer
    if _flag(body, "add_special_tokens", default=True):
        return tokenizer.encode(prompt)
    return tokenizer.encode_plain(prompt)


def _chat_ids(model: ServedModel, body: dict[str, Any]) -> list[int]:
    if bool_param(body, "continue_final_message"):
        raise APIError(400, "'continue_final_message' is not supported", param="messages")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        msg = "'chat_template_kwargs' must be an object"
        raise APIError(400, msg, param="chat_template_kwargs")
    generation = _flag(body, "add_generation_prompt", default=True)
    tokenizer = model.tokenizer
    try:
        text = tokenizer.render_chat(body["messages"], body.get("tools"), kwargs, generation)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    if _flag(body, "add_special_tokens", default=False):
        return tokenizer.encode(text)
    return tokenizer.encode_plain(text)
