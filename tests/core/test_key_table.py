"""The C key table (core/_key_table.c) answers as its dict twin does, calls on chains included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.key_table import DictKeyTable, KeyTable, has_native

# small keys collide in the table's slots; 0, negative and big ints and bytes take other paths
KEYS = st.one_of(
    st.integers(0, 40),
    st.integers(2**64 - 3, 2**64 + 2),
    st.integers(-3, -1),
    st.sampled_from([b"a", b"b"]),
)
VALUES = st.integers(0, 2**64 - 1)
CHAINS = st.lists(KEYS, max_size=12)
OPS = st.one_of(
    st.tuples(st.just("claim"), CHAINS, st.integers(-1, 13), VALUES),
    st.tuples(st.just("assign"), CHAINS, VALUES),
    st.tuples(st.just("discard"), CHAINS),
    st.tuples(st.just("add_new"), CHAINS, st.lists(VALUES, min_size=12, max_size=12)),
    st.tuples(st.just("set"), KEYS, VALUES),
    st.tuples(st.just("del"), KEYS),
    st.tuples(st.just("pop"), KEYS),
    st.tuples(st.just("clear")),
)


def _apply(table: object, op: tuple) -> object:
    name, *args = op
    try:
        if name == "add_new":
            return table.add_new(args[0], args[1][: len(args[0])])  # type: ignore[attr-defined]
        if name == "set":
            table[args[0]] = args[1]  # type: ignore[index]
        elif name == "del":
            del table[args[0]]  # type: ignore[attr-defined]
        elif name == "pop":
            return table.pop(args[0], "absent")  # type: ignore[attr-defined]
        else:
            return getattr(table, name)(*args)
    except KeyError as exc:
        return ("KeyError", exc.args)
    return None


@pytest.mark.skipif(not has_native(), reason="the C table is not built")
@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=60), st.lists(KEYS, max_size=20))
def test_the_c_table_answers_as_the_dict_twin(ops: list[tuple], probes: list[object]) -> None:
    table, model = KeyTable(), DictKeyTable()
    for op in ops:
        assert _apply(table, op) == _apply(model, op), op
        assert len(table) == len(model)
    for key in [*model, *probes]:
        assert (key in table) == (key in model)
        assert table.get(key, "absent") == model.get(key, "absent")
        assert table.get(key) == model.get(key)


@pytest.mark.skipif(not has_native(), reason="the C table is not built")
def test_the_c_table_grows_and_shrinks_by_chains() -> None:
    table = KeyTable()
    keys = list(range(1, 100_001))
    assert table.claim(keys, 0, 7) == len(keys)
    assert table.claim([*range(200_000, 200_010), 5], 0, 8) == 10  # stops at the held key
    assert table[5] == 7 and table[200_003] == 8 and len(table) == 100_010
    table.discard(keys[::2])
    assert len(table) == 50_010 and 2 in table and 1 not in table
    assert all(table.get(k) == 7 for k in keys[1::2])
    with pytest.raises(KeyError):
        table.discard([1])
    with pytest.raises(TypeError):
        table.get([1])  # unhashable, as for a dict
    with pytest.raises(OverflowError):
        table[1] = -1  # values are uint64s
