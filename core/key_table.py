"""A map of block keys to ints with calls that take a whole chain: the index's key -> run map and
the KV mirror's engine-hash -> key map (docs/compiled.md). `KeyTable` is the C twin
(core/_key_table.c: open addressing over uint64 keys, one probe per key, no Python between keys)
where it is built, else `DictKeyTable`: the same answers, from a dict."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol


class KeyMap(Protocol):
    """What both tables answer. Values are ints in [0, 2**64); keys are ints (block keys,
    engine hashes) or any hashable (bytes hashes), as a dict's."""

    def get(self, key: object, default: object = None, /) -> object: ...
    def pop(self, key: object, default: object = None, /) -> object: ...
    def clear(self) -> None: ...
    def __getitem__(self, key: object, /) -> object: ...
    def __setitem__(self, key: object, value: object, /) -> None: ...
    def __delitem__(self, key: object, /) -> None: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...

    def claim(self, keys: Sequence[object], start: int, value: object, /) -> int:
        """Map keys[start:] to `value` up to the first key held already; returns where it
        stopped (a key met twice stops it the second time)."""
        ...

    def assign(self, keys: Sequence[object], value: object, /) -> None:
        """Map every key to `value`."""
        ...

    def discard(self, keys: Sequence[object], /) -> None:
        """Remove every key; KeyError at the first not held (those before it are gone)."""
        ...

    def add_new(self, keys: Sequence[object], values: Sequence[object], /) -> bool:
        """Map keys[i] to values[i] when none of the keys is held (True); else change nothing
        (False)."""
        ...


class DictKeyTable(dict[object, object]):
    """The table from a dict: where the C twin is not built, and the model it is tested against."""

    def claim(self, keys: Sequence[object], start: int, value: object, /) -> int:
        i, n = max(start, 0), len(keys)
        size = len(self)
        while i < n:
            self.setdefault(keys[i], value)
            if len(self) == size:
                break
            size += 1
            i += 1
        return i

    def assign(self, keys: Sequence[object], value: object, /) -> None:
        self.update(dict.fromkeys(keys, value))

    def discard(self, keys: Sequence[object], /) -> None:
        for key in keys:
            del self[key]

    def add_new(self, keys: Sequence[object], values: Sequence[object], /) -> bool:
        if len(keys) != len(values):
            raise ValueError("keys and values differ in length")
        if not self.keys().isdisjoint(keys):
            return False
        self.update(zip(keys, values, strict=True))
        return True


KeyTable: Callable[[], KeyMap]
try:
    from core._key_table import KeyTable
except ImportError:  # pragma: no cover - only without a compiler
    KeyTable = DictKeyTable


def has_native() -> bool:
    """Whether the C table is the one in use."""
    return KeyTable is not DictKeyTable
