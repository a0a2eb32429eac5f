"""Block keys (docs/block-keys.md): token ids -> full blocks -> chained xxh3_64 keys, in the
namespace of a cache salt (and of a LoRA adapter), after a parent key, or salted after a shared
public prefix."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Final

import msgspec
import xxhash

try:  # the C twin (core/_blockkeys.c): same keys, ~20x faster
    from core._blockkeys import chain_keys as _native_chain_keys
    from core._blockkeys import chain_keys_msgpack as _native_chain_keys_msgpack
    from core._blockkeys import chain_keys_packed as _native_chain_keys_packed
    from core._blockkeys import msgpack_len as _native_msgpack_len
except ImportError:  # pragma: no cover - only without a compiler
    _native_chain_keys = _native_chain_keys_msgpack = _native_msgpack_len = None
    _native_chain_keys_packed = None

SHARED_NAMESPACE = b"\x00\x00\x00\x00"
# before an adapter's name: never a salt's length, so no salt namespace starts like an adapter's
_ADAPTER_MARK = b"\xff\xff\xff\xff"
# tokens per KV block where nothing says otherwise: vLLM's default (urc sets SGLang's page size)
DEFAULT_BLOCK_SIZE: Final = 16
_LE64 = struct.Struct("<Q")
_xxh3 = xxhash.xxh3_64_intdigest


@lru_cache(maxsize=4096)
def namespace(salt: str | bytes | None, lora: str | None = None) -> bytes:
    """The length-prefixed namespace bytes of a cache salt (None or empty: shared); with `lora`,
    a LoRA adapter's name before them, so an adapter's blocks never share a key with the base
    model's or another adapter's (vLLM hashes the LoRA name into every block)."""
    if not salt:
        ns = SHARED_NAMESPACE
    else:
        raw = salt.encode() if isinstance(salt, str) else bytes(salt)
        ns = struct.pack("<I", len(raw)) + raw
    if not lora:
        return ns
    name = lora.encode()
    return _ADAPTER_MARK + struct.pack("<I", len(name)) + name + ns


def parent_prefix(parent_key: int) -> bytes:
    """What stands before the first block of a chain that continues from `parent_key`."""
    return _LE64.pack(parent_key)


def _python_chain_keys(tokens: Sequence[int], block_size: int, first: bytes) -> list[int]:
    pack = struct.Struct(f"<{block_size}i").pack
    keys: list[int] = []
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        keys.append(_xxh3(first + pack(*tokens[i : i + block_size])))
        first = _LE64.pack(keys[-1])
    return keys


def chain_keys(
    tokens: Sequence[int], block_size: int, first: bytes = SHARED_NAMESPACE
) -> list[int]:
    """Keys of every full block of `tokens`; `first` is `namespace(salt)` or `parent_prefix(k)`."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if _native_chain_keys is not None:
        return _native_chain_keys(tokens, block_size, first)
    return _python_chain_keys(tokens, block_size, first)


def msgpack_len(raw: bytes | memoryview | msgspec.Raw) -> int:
    """The length of the msgpack array `raw` (a KV event's token ids as they came); -1 when it is
    not an array."""
    if _native_msgpack_len is not None:
        return int(_native_msgpack_len(raw))
    value = msgspec.msgpack.decode(raw)
    return len(value) if isinstance(value, list) else -1


def _python_chain_keys_msgpack(
    raw: bytes | memoryview | msgspec.Raw, block_size: int, first: bytes, limit: int = -1
) -> list[int]:
    try:
        tokens = msgspec.msgpack.decode(raw, type=list[int])
        return chain_keys(tokens[: limit * block_size] if limit >= 0 else tokens, block_size, first)
    except (msgspec.DecodeError, OverflowError) as exc:  # ValidationError included
        raise ValueError(str(exc)) from exc


def chain_keys_msgpack(
    raw: bytes | memoryview | msgspec.Raw, block_size: int, first: bytes, limit: int = -1
) -> list[int]:
    """`chain_keys` of the first `limit` (-1: all) full blocks of the msgpack array of token
    ids `raw`, read where it lies (no int per token). ValueError: not an array of int32s."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if _native_chain_keys_msgpack is not None:
        return _native_chain_keys_msgpack(raw, block_size, first, limit)  # type: ignore[no-any-return]
    return _python_chain_keys_msgpack(raw, block_size, first, limit)


def chain_keys_packed(packed: bytes, block_size: int, first: bytes, limit: int = -1) -> list[int]:
    """`chain_keys` of the first `limit` (-1: all) full blocks of token ids packed as
    little-endian int32s (core/_kv_decode.c's BlockStoredPacked)."""
    if block_size <= 0 or len(packed) % 4:
        raise ValueError("not packed int32s, or block_size <= 0")
    if _native_chain_keys_packed is not None:
        return _native_chain_keys_packed(packed, block_size, first, limit)  # type: ignore[no-any-return]
    tokens = list(struct.unpack(f"<{len(packed) // 4}i", packed))
    return chain_keys(tokens[: limit * block_size] if limit >= 0 else tokens, block_size, first)


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    salt: str | bytes | None = None,
    public_blocks: int = 0,
    lora: str | None = None,
) -> list[int]:
    """Keys of a prompt's full blocks in the namespace of `salt` (None: shared); the first
    `public_blocks` blocks in the shared namespace, the salt mixed in after them. `lora`: the
    LoRA adapter the request names (None: the base model), in the namespace of both parts."""
    if not public_blocks or not salt:
        return chain_keys(tokens, block_size, namespace(salt, lora))
    public = chain_keys(tokens[: public_blocks * block_size], block_size, namespace(None, lora))
    if len(public) < public_blocks:  # callers cap public_blocks at the prompt's full blocks
        return public
    private = tokens[public_blocks * block_size :]
    return public + chain_keys(private, block_size, salted_after(public[-1], salt))


def salted_after(parent_key: int, salt: str | bytes | None) -> bytes:
    """What stands before the first private block after a public prefix ending at `parent_key`."""
    return parent_prefix(parent_key) + namespace(salt)


def continue_after(
    keys: Sequence[int], salt: str | bytes | None, public_blocks: int = 0, lora: str | None = None
) -> bytes:
    """What stands before the block after `keys` (a chain keyed by `block_keys` with these
    arguments): the namespace, the parent, or the parent and the salt at the public edge."""
    if not keys:
        return namespace(None if public_blocks else salt, lora)
    if public_blocks and salt and len(keys) == public_blocks:
        return salted_after(keys[-1], salt)
    return parent_prefix(keys[-1])


def salt_scope(salt: str | None = None, salt_prefix: str | None = None) -> Callable[[str], bool]:
    """A test on the salts of namespaces: exactly `salt`, or `salt_prefix` and every salt below
    it (`T` covers `T.u.…` and `T.s.…`, router/gateway/isolation.py): scoped invalidation."""
    if salt is not None:
        return lambda s: s == salt
    if salt_prefix is None:
        raise ValueError("a scope needs a salt or a salt prefix")
    below = salt_prefix + "."
    return lambda s: s == salt_prefix or s.startswith(below)


def has_native() -> bool:
    return _native_chain_keys is not None
