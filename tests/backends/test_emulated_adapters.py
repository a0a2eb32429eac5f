"""LoRA adapters in the emulated engine, in virtual time: each adapter's blocks keyed and cached
apart from the base's and each other's, at most max_loras active, the least recently used idle
one evicted, a request waiting for a slot, an activation's modelled time inside the step that
carries its first chunk (so in TTFT), loads and evictions counted, an unload dropping the
adapter's blocks; the integrity check after every step."""

from __future__ import annotations

import pytest

from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request
from core.blocks import block_keys
from core.kv_events import BlockRemoved, BlockStored
from tests.backends.test_emulated_engine import BS, config, drive, prompt

MB = 1_000_000
GBPS = 1.0  # 1 GB/s: a 10 MB adapter takes 10 ms to activate


def engine(**kw: object) -> EmulatedEngine:
    return EmulatedEngine(config(lora_load_gbps=GBPS, max_loras=2, **kw))


def test_an_adapters_blocks_are_its_own_and_carry_its_name() -> None:
    eng = engine()
    eng.adapters.load("a1", size_bytes=10 * MB)
    ids = prompt(64, 1)
    reqs = [
        Request("base", ids, 1),
        Request("a1", ids, 1, arrival=1.0, lora_name="a1"),
        Request("a1-again", ids, 1, arrival=2.0, lora_name="a1"),
    ]
    stored: list[BlockStored] = []
    drive(
        eng, reqs, on_step=lambda t, r: stored.extend(e for e in r.events if type(e) is BlockStored)
    )
    base, first, again = reqs
    assert (base.cached_tokens, first.cached_tokens, again.cached_tokens) == (0, 0, 48)
    assert eng.cache.keys("") == set(block_keys(ids, BS))
    assert eng.cache.keys("a1") == set(block_keys(ids, BS, lora="a1"))
    assert not eng.cache.keys("") & eng.cache.keys("a1")
    lora = [e for e in stored if e.lora_name == "a1"]
    assert [e.lora_id for e in lora] == [1] and lora[0].extra_keys == [["a1"]] * 4
    assert all(e.lora_name is None and e.extra_keys is None for e in stored if e not in lora)


def test_activation_time_is_in_the_first_chunks_step() -> None:
    eng = engine()
    eng.adapters.load("a1", size_bytes=10 * MB)
    ids = prompt(64, 2)
    plain, lora = Request("base", ids, 1), Request("a1", ids, 1, arrival=1.0, lora_name="a1")
    drive(eng, [plain, lora])
    again = Request("again", prompt(64, 3), 1, arrival=2.0, lora_name="a1")
    drive(eng, [again])
    ttft = [r.first_token_time - r.arrival for r in (plain, lora, again)]  # type: ignore[operator]
    assert ttft[1] == pytest.approx(ttft[0] + 0.010)  # 10 MB at 1 GB/s, once
    assert ttft[2] == pytest.approx(ttft[0])  # resident: no copy
    assert (eng.adapters.slots.loads, eng.adapters.slots.evictions) == (1, 0)


def test_lru_idle_adapter_evicted_and_a_request_waits_for_a_slot() -> None:
    eng = engine()
    for name in ("a", "b", "c"):
        eng.adapters.load(name, size_bytes=0)
    long_a = Request("long-a", prompt(32, 4), 50, lora_name="a")
    short_b = Request("short-b", prompt(32, 5), 2, arrival=0.001, lora_name="b")
    # both slots busy or b idle: c takes b's slot (a runs), never a's
    c = Request("c", prompt(32, 6), 2, arrival=0.1, lora_name="c")
    drive(eng, [long_a, short_b, c])
    slots = eng.adapters.slots
    assert (slots.loads, slots.evictions) == (3, 1)
    assert slots.active_names() == ["a", "c"]
    assert c.admitted_time is not None and c.admitted_time >= short_b.finish_time  # type: ignore[operator]
    # both idle: the least recently used goes, not the first loaded
    drive(eng, [Request("a-again", prompt(32, 7), 1, arrival=1.0, lora_name="a")])
    drive(eng, [Request("b", prompt(32, 8), 1, arrival=2.0, lora_name="b")])
    assert slots.active_names() == ["a", "b"] and slots.evictions == 2  # c went
    # a third adapter while both are busy: it waits until one finishes
    eng2 = engine()
    for name in ("a", "b", "c"):
        eng2.adapters.load(name, size_bytes=0)
    busy = [Request(n, prompt(32, i), 30, lora_name=n) for i, n in enumerate("ab")]
    late = Request("late", prompt(32, 9), 2, arrival=0.001, lora_name="c")
    drive(eng2, [*busy, late])
    assert late.admitted_time is not None
    assert late.admitted_time >= min(r.finish_time for r in busy)  # type: ignore[type-var]


def test_unknown_adapter_refused_and_unload_drops_its_blocks() -> None:
    eng = engine()
    with pytest.raises(ValueError, match="not loaded"):
        eng.submit(Request("x", prompt(32, 1), 1, lora_name="nope"))
    eng.adapters.load("a1", size_bytes=0)
    with pytest.raises(ValueError, match="already been loaded"):
        eng.adapters.load("a1")
    req = Request("a", prompt(64, 1), 1, lora_name="a1")
    drive(eng, [req])
    eng.drain_events()
    done = eng.adapters.unload("a1")
    assert done.freed_blocks == 4 and not eng.cache.keys("a1")
    removed = [e for e in eng.drain_events() if type(e) is BlockRemoved]
    assert sorted(k for e in removed for k in e.block_hashes) == sorted(
        block_keys(req.prompt, BS, lora="a1")
    )
    eng.check()
    with pytest.raises(KeyError):
        eng.adapters.unload("a1")


def test_adapter_size_from_its_peft_file_else_the_default(tmp_path: object) -> None:
    from pathlib import Path

    directory = Path(str(tmp_path))
    (directory / "adapter_model.safetensors").write_bytes(b"\0" * 12345)
    eng = engine(lora_default_mb=3.0)
    assert eng.adapters.load("files", str(directory)).size_bytes == 12345
    assert eng.adapters.load("none", str(directory / "missing")).size_bytes == 3 * MB
