"""A request body as routing reads it (docs/dispatch.md, 1): parsed strictly once
(core/strict_json.py), its routing fields checked in OpenAI's wording (400 otherwise), a
Responses request as the chat it renders as, an embeddings request's inputs; and the body the
worker gets (docs/isolation.md: the gateway's salt, no reserved field of the client's)."""

from __future__ import annotations

from typing import Any, Final

from core.errors import APIError
from core.responses_input import InputError, chat_messages
from core.strict_json import BodyError, decode_object, encode

SALT_FIELD: Final = "cache_salt"
PUBLIC_FIELD: Final = "urc_public_tokens"
RESERVED_PREFIX: Final = "urc_"
TOKEN_ID_MAX: Final = 2**31 - 1  # block keys hash token ids as int32
EMBEDDING_INPUTS_MAX: Final = 2048  # OpenAI's limit of inputs per embeddings request


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def parse_body(raw: bytes, checked: str = "") -> dict[str, Any]:
    """A JSON object body, strictly parsed (400 otherwise)."""
    try:
        return decode_object(raw, checked=checked)
    except BodyError as exc:
        raise bad_request(str(exc)) from None


def parse_request(raw: bytes, chat: bool) -> dict[str, Any]:
    """An inference request's body, its routing fields checked (a prompt once, by `validate`:
    token ids in int32 are within the parse's limits too)."""
    body = parse_body(raw, "" if chat else "prompt")
    validate(body, chat)
    return body


def _check_int(body: dict[str, Any], field: str, low: int = 0) -> None:
    value = body.get(field)
    if value is not None and (type(value) is not int or value < low):
        raise bad_request(f"'{field}' must be an integer >= {low}", field)


def _token_ids(prompt: list[Any]) -> bool:
    if not prompt:
        return False
    for token in prompt:
        if not isinstance(token, int) or isinstance(token, bool):
            return False
        value: int = token  # compiled: compared as a native int
        if value < 0 or value > TOKEN_ID_MAX:
            return False
    return True


def validate(body: dict[str, Any], chat: bool) -> None:
    """The fields routing needs, in OpenAI's wording; the rest is the worker's to check."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and _token_ids(prompt))):
            message = f"'prompt' must be a string or an array of token ids in [0, {TOKEN_ID_MAX}]"
            raise bad_request(message, "prompt")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be a boolean", "stream")
    _check_int(body, "max_tokens")
    _check_int(body, "max_completion_tokens")
    _check_int(body, "n", 1)


def parse_responses(raw: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Responses request's body, and the chat request it is routed as: its model and tools,
    its `instructions` and `input` as messages (core/responses_input.py)."""
    body = parse_body(raw)
    if body.get("previous_response_id") is not None:
        message = (
            "'previous_response_id' is not supported: the gateway keeps no responses, "
            "send the whole conversation as 'input'"
        )
        raise bad_request(message, "previous_response_id")
    try:
        messages = chat_messages(body)
    except InputError as exc:
        raise bad_request(str(exc), exc.param) from None
    routed: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("tools") is not None:
        routed["tools"] = body["tools"]
    validate(routed, True)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be a boolean", "stream")
    _check_int(body, "max_output_tokens", 1)
    return body, routed


def parse_inference(path: str, raw: bytes) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """A chat, completions or Responses body (by `path`): the body as sent, the request it is
    routed as (a Responses request: the chat its input renders as), and whether that is a chat."""
    if path == "/v1/responses":
        body, routed = parse_responses(raw)
        return body, routed, True
    chat = path != "/v1/completions"
    body = parse_request(raw, chat)
    return body, body, chat


def parse_embeddings(raw: bytes) -> tuple[dict[str, Any], list[Any]]:
    """An embeddings request's body and its inputs, each a string or a list of token ids
    (OpenAI's four shapes of `input`, checked here: the strict parse skips it)."""
    body = parse_body(raw, "input")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    value = body.get("input")
    items: list[Any] = []
    if isinstance(value, str) or (isinstance(value, list) and _token_ids(value)):
        items = [value]
    elif isinstance(value, list):
        items = value
    if not items or len(items) > EMBEDDING_INPUTS_MAX:
        message = f"'input' must hold 1 to {EMBEDDING_INPUTS_MAX} inputs"
        raise bad_request(message, "input")
    for item in items:
        if not ((isinstance(item, str) and item) or (isinstance(item, list) and _token_ids(item))):
            message = (
                "'input' must be a non-empty string, an array of non-empty strings, an array "
                f"of token ids in [0, {TOKEN_ID_MAX}] or an array of such arrays"
            )
            raise bad_request(message, "input")
    return body, items


def forwarded(body: dict[str, Any], salt: str | None, public_tokens: int) -> bytes:
    """The worker's body: the gateway's fields first, then the client's, none reserved."""
    out: dict[str, Any] = {}
    if salt is not None:
        out[SALT_FIELD] = salt
        if public_tokens:
            out[PUBLIC_FIELD] = public_tokens
    for key, value in body.items():
        if key != SALT_FIELD and not key.startswith(RESERVED_PREFIX):
            out[key] = value
    return encode(out)
