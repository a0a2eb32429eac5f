"""Block keys follow docs/block-keys.md exactly, in both the C and the pure-Python path."""

from __future__ import annotations

import struct

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from core import blocks
from core.blocks import (
    _python_chain_keys,
    _python_chain_keys_msgpack,
    block_keys,
    chain_keys,
    chain_keys_msgpack,
    msgpack_len,
    namespace,
    parent_prefix,
)


def reference_keys(tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """The contract spelled out with nothing shared with the implementation."""
    raw = (salt or "").encode()
    prev = struct.pack("<I", len(raw)) + raw
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(struct.pack("<i", t) for t in tokens[start : start + block_size])
        key = xxhash.xxh3_64(prev + block).intdigest()
        keys.append(key)
        prev = struct.pack("<Q", key)
    return keys


tokens_st = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300)


@settings(max_examples=300, deadline=None)
@given(tokens_st, st.sampled_from([1, 3, 16, 32, 64]), st.sampled_from([None, "a", "tenant-42"]))
def test_keys_match_the_contract(tokens, block_size, salt):
    expected = reference_keys(tokens, block_size, salt)
    assert block_keys(tokens, block_size, salt) == expected
    assert _python_chain_keys(tokens, block_size, namespace(salt)) == expected


@settings(max_examples=100, deadline=None)
@given(tokens_st, st.integers(1, 5))
def test_a_chain_continues_from_its_parent_key(tokens, split):
    keys = block_keys(tokens, 8)
    if len(keys) <= split:
        return
    tail = chain_keys(tokens[split * 8 :], 8, parent_prefix(keys[split - 1]))
    assert tail == keys[split:]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([1, 3, 16, 64]), st.sampled_from([None, "t"]))
def test_bytes_are_keyed_as_their_byte_values(raw, block_size, salt):
    """The byte tokenizer hands the gateway a prompt's UTF-8 bytes as its ids."""
    expected = reference_keys(list(raw), block_size, salt)
    assert block_keys(raw, block_size, salt) == expected
    assert _python_chain_keys(raw, block_size, namespace(salt)) == expected
    assert block_keys(raw, block_size, salt, public_blocks=1) == block_keys(
        list(raw), block_size, salt, public_blocks=1
    )


@settings(max_examples=300, deadline=None)
@given(tokens_st, st.sampled_from([1, 3, 16]), st.integers(-1, 8))
def test_msgpack_token_ids_are_keyed_where_they_lie(tokens, block_size, limit):
    """A KV event's token ids as msgpack (every int format) give the keys of the list."""
    raw = msgspec.msgpack.encode(tokens)
    expected = chain_keys(tokens, block_size, namespace("s"))
    if limit >= 0:
        expected = expected[:limit]
    assert chain_keys_msgpack(raw, block_size, namespace("s"), limit) == expected
    assert _python_chain_keys_msgpack(raw, block_size, namespace("s"), limit) == expected
    assert msgpack_len(raw) == len(tokens)


@pytest.mark.parametrize(
    "raw",
    [
        msgspec.msgpack.encode([2**31] * 16),
        msgspec.msgpack.encode([-(2**31) - 1] * 16),
        msgspec.msgpack.encode(["a"] * 16),
        msgspec.msgpack.encode([1] * 16)[:-1],  # cut short
        msgspec.msgpack.encode({"a": 1}),
    ],
)
def test_msgpack_token_ids_that_are_not_int32s_are_rejected(raw):
    for keys in (chain_keys_msgpack, _python_chain_keys_msgpack):
        with pytest.raises(ValueError):
            keys(raw, 16, namespace(None))
    assert msgpack_len(msgspec.msgpack.encode(None)) == -1


def test_only_full_blocks_get_keys_and_namespaces_are_length_prefixed():
    assert block_keys(list(range(31)), 16) == block_keys(list(range(16)), 16)
    assert namespace(None) == namespace("") == b"\0\0\0\0"
    assert namespace("ab") == b"\x02\0\0\0ab"
    # "a" + tokens must not collide with "" + ("a" as bytes) + tokens: the length prefix sees to it
    assert block_keys([1] * 16, 16, "a") != block_keys([1] * 16, 16, None)


def test_the_native_path_is_built():
    assert blocks.has_native(), "core/_blockkeys.c did not build: `pip install -e .` needs gcc"


def test_bad_input_is_rejected():
    with pytest.raises(ValueError):
        block_keys([1, 2], 0)
    with pytest.raises(OverflowError):
        block_keys([2**40] * 16, 16)
    with pytest.raises(TypeError):
        block_keys(["x"] * 16, 16)
