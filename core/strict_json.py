"""Strict JSON for request bodies: the one parse both the gateway and our workers run.

A body is accepted only when every engine behind the gateway can take it as it is: a JSON
object, nested at most `MAX_DEPTH` deep, every integer within int64, every string valid UTF-8
(no lone surrogates), every number finite. What passes is a plain `dict`; the gateway forwards
its own re-encoding of it, never the client's bytes, so a field is forwarded under exactly the
name the gateway read it by (`"urc\\u005fpublic_tokens"` is `urc_public_tokens` here too).

The walk looks only at containers and integers: a chat of a few messages is a handful of
steps, a prompt of token ids one type test per token.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

MAX_DEPTH: Final = 64  # objects and arrays inside each other, the body itself counted
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
_SMALL_MIN: Final = -(2**62)  # what a compiled int holds unboxed
_SMALL_MAX: Final = 2**62 - 1

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class BodyError(ValueError):
    """The body is not one the gateway or a worker takes; the message says why."""


def decode_object(raw: bytes, max_depth: int = MAX_DEPTH, checked: str = "") -> dict[str, Any]:
    """`raw` as a JSON object within the limits above; BodyError otherwise. A top-level field
    named `checked` is not walked: the caller checks it itself (the gateway's token ids)."""
    if not raw:
        raise BodyError("the request body is empty")
    try:
        body = _decode(raw)
    except RecursionError:
        raise BodyError(f"the request body is nested deeper than {max_depth} levels") from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    check_limits(body, max_depth, checked)
    return body


def check_limits(root: dict[str, Any], max_depth: int = MAX_DEPTH, checked: str = "") -> None:
    """Nesting depth and integer range of a decoded body (BodyError when over); the top-level
    field `checked` is left out."""
    stack: list[tuple[Any, int]] = []
    for key, child in root.items():
        if key != checked:
            _visit(child, 1, max_depth, stack)
    while stack:
        value, depth = stack.pop()
        for child in value.values() if type(value) is dict else value:
            _visit(child, depth, max_depth, stack)


def _visit(child: Any, depth: int, max_depth: int, stack: list[tuple[Any, int]]) -> None:
    """One value found at `depth`: an integer is checked, a container queued for the walk."""
    if isinstance(child, int):
        number: int = child
        # compiled, small ints compare natively; the int64 bounds are boxed numbers
        if (number > _SMALL_MAX or number < _SMALL_MIN) and not INT64_MIN <= number <= INT64_MAX:
            raise BodyError(f"an integer in the request body is outside int64: {number}")
    elif isinstance(child, dict | list):
        if depth >= max_depth:
            raise BodyError(f"the request body is nested deeper than {max_depth} levels")
        stack.append((child, depth + 1))


def encode(body: Any) -> bytes:
    """The JSON of a body that `decode_object` accepted (and the gateway then added to)."""
    return _encode(body)
