"""The strict parse of request bodies (core/strict_json.py) against what it must refuse."""

from __future__ import annotations

import pytest

from core.strict_json import MAX_DEPTH, BodyError, decode_object


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b'"a"',
        b"{",
        b'{"a":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",
        b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"a":9223372036854775808}',
        b'{"a":[1,-9223372036854775809]}',
        b'{"a":1e999}',
        b'{"a":"\\ud800"}',
        b'{"a":NaN}',
    ],
)
def test_refused(raw: bytes) -> None:
    with pytest.raises(BodyError):
        decode_object(raw)


def test_accepted_at_the_limits() -> None:
    depth = MAX_DEPTH - 1  # the body itself is a level
    raw = (
        b'{"a":' + b"[" * depth + b"]" * depth + b',"b":[9223372036854775807,-9223372036854775808]}'
    )
    assert decode_object(raw)["b"] == [2**63 - 1, -(2**63)]
    assert decode_object(b'{"urc\\u005fx":1}') == {"urc_x": 1}  # names are compared decoded


def test_a_checked_field_is_left_to_the_caller() -> None:
    deep = b'{"prompt":' + b"[" * 100 + b"]" * 100 + b"}"
    assert decode_object(deep, checked="prompt")
    with pytest.raises(BodyError):
        decode_object(deep)
