"""OpenAI's `/v1/responses` over an engine (docs/workers.md): `instructions` and `input` rendered
with the chat template as chat messages are (core/responses_input.py), one assistant message
out, usage with cached tokens; streamed as the Responses API's typed SSE events. Nothing is
stored: `previous_response_id` is refused, `store` ignored."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from backends.http.generation import Generation, ServedModel, TextStream, decode, pick_model
from backends.http.openai_api import (
    bool_param,
    int_param,
    priority_param,
    public_param,
    read_json,
    respond,
    salt_param,
    sampling,
)
from backends.http.runner import EngineRunner
from core.errors import APIError
from core.responses_input import InputError, chat_messages


def _prompt(model: ServedModel, body: dict[str, Any]) -> list[int]:
    try:
        ids = model.tokenizer.encode_chat(chat_messages(body))
    except InputError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from exc
    if not ids:
        raise APIError(400, "'input' rendered to no tokens", param="input")
    return ids


def usage(gen: Generation) -> dict[str, Any]:
    """The Responses API's usage: input and output tokens, the cached part of the input."""
    chat = gen.usage()
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": gen.cached_tokens},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


class _Answer:
    """One response's objects: whole, or as the events of a stream."""

    def __init__(self, model: ServedModel, body: dict[str, Any], gen: Generation) -> None:
        self.gen = gen
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.head: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model.name,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": gen.sampling.temperature,
            "top_p": gen.sampling.top_p,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "text": {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {},
            "previous_response_id": None,
            "store": False,
            "error": None,
        }
        self.text = TextStream(model.tokenizer)
        self.sent = ""  # the text streamed so far
        self.sequence = 0
        self.started = False

    def status(self) -> str:
        return "incomplete" if self.gen.finish_reason == "length" else "completed"

    def item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content if status != "in_progress" else [],
        }

    def response(self, text: str | None) -> dict[str, Any]:
        """The response object; `text` None: in progress, no output yet."""
        if text is None:
            return {**self.head, "status": "in_progress", "output": [], "usage": None}
        status = self.status()
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            **self.head,
            "status": status,
            "incomplete_details": incomplete,
            "output": [self.item(text, status)],
            "usage": usage(self.gen),
        }

    def whole(self) -> dict[str, Any]:
        return self.response(decode(self.gen.model.tokenizer, self.gen.output))

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"

    def chunk(self, n: int, final: bool) -> bytes:
        """The events for an output of `n` tokens: the opening ones ride on the first token
        (a gateway takes the first body byte for it), the closing ones on the end."""
        piece = self.text.piece(self.gen.output[:n], final=final)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        out = []
        if not self.started:
            self.started = True
            out.append(self.event("response.created", response=self.response(None)))
            out.append(self.event("response.in_progress", response=self.response(None)))
            item = self.item("", "in_progress")
            out.append(self.event("response.output_item.added", output_index=0, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", **where, part=part))
        if piece:
            self.sent += piece
            out.append(self.event("response.output_text.delta", **where, delta=piece, logprobs=[]))
        if final:
            text = self.sent
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", **where, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, part=part))
            item = self.item(text, self.status())
            out.append(self.event("response.output_item.done", output_index=0, item=item))
            # as vLLM: response.completed even when incomplete (its status says so), the event
            # the openai client's stream helper waits for
            out.append(self.event("response.completed", response=self.response(text)))
        return b"".join(out)


class ResponsesApi:
    def __init__(self, backend: EngineRunner, models: dict[str, ServedModel]) -> None:
        self.backend = backend
        self.models = models

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.serve)

    async def serve(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        model = pick_model(self.models, body.get("model"))
        if body.get("previous_response_id") is not None:
            message = "'previous_response_id' is not supported: send the whole conversation"
            raise APIError(400, message, param="previous_response_id")
        prompt = _prompt(model, body)
        requested = int_param(body, "max_output_tokens", 1)
        max_tokens = model.max_tokens(len(prompt), requested, "input")
        params = sampling(body, max_tokens, requested is not None)
        salt = salt_param(body)
        gen = Generation(model, prompt, params, salt, chat=True)
        gen.public_tokens = public_param(body) if salt else 0
        gen.priority = priority_param(body)
        stream = bool_param(body, "stream")
        answer = _Answer(model, body, gen)
        return await respond(
            request,
            self.backend,
            gen,
            stream,
            answer.whole,
            answer.chunk,
            "context_length_exceeded",
            done=b"",  # the Responses API's streams end with their last event
        )
