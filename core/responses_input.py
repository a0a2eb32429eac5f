"""The Responses API's `instructions` and `input` as the chat messages vLLM renders with its chat
template (docs/dispatch.md, "Other endpoints"): one conversion for the gateway and our workers,
so a Responses request and a chat request with the same messages have the same prompt tokens and
the same block keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text"})  # output_text: an assistant turn replayed


class InputError(ValueError):
    """A Responses body the conversion refuses; `param` names the field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`instructions` as a leading system message, then `input`: a string is one user message,
    a list holds message items `{role, content}` (`type` "message" or absent), content a string
    or a list of `input_text`/`output_text` parts. InputError on anything else."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InputError("'instructions' must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise InputError("'input' must not be empty", "input")
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list) or not items:
        message = "'input' must be a non-empty string or a non-empty array of message items"
        raise InputError(message, "input")
    for i, item in enumerate(items):
        messages.append(_message(item, f"input[{i}]"))
    return messages


def _message(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InputError(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    if kind != "message":
        message = f"'{where}.type' {kind!r} is not supported: only message items (text)"
        raise InputError(message, f"{where}.type")
    role = item.get("role")
    if role not in ROLES:
        message = f"'{where}.role' must be one of {', '.join(sorted(ROLES))}"
        raise InputError(message, f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        message = f"'{where}.content' must be a string or an array of text parts"
        raise InputError(message, f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            message = f"'{at}': content part {kind!r} is not supported: input_text or output_text"
            raise InputError(message, f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise InputError(f"'{at}.text' must be a string", f"{at}.text")
        parts.append({"type": "text", "text": part["text"]})  # a chat text part, as vLLM reads it
    return {"role": role, "content": parts}
