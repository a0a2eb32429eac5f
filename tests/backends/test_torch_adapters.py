"""LoRA adapters in the torch engine (issue 32's acceptance): the tiny checkpoint and two tiny
PEFT adapters written here; the same prompt through the base and both adapters gives three
different outputs, each adapter's exactly what the base with the LoRA merged into its weights
gives; each reuses only its own cached prefix; one pool holds all three kv_groups' pages, its
integrity checked after every step; slots, evictions and unloading."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from backends.tiny_checkpoint import write_checkpoint
from backends.tiny_lora import write_adapter
from backends.torch_worker.engine import EngineConfig, TorchEngine
from backends.torch_worker.loader import LoadedModel, load_model
from backends.torch_worker.request import Request, SamplingParams
from tests.backends.test_engine_server import running_worker

torch.set_num_threads(2)
CPU = torch.device("cpu")
PROMPT = list(range(3, 60))  # 57 tokens: 3 full pages of 16, the rest computed


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = write_checkpoint(root / "base", seed=0)
    return {
        "base": base,
        "a1": write_adapter(root / "a1", base, seed=1),
        "a2": write_adapter(root / "a2", base, seed=2),
    }


def load(directory: Path) -> LoadedModel:
    return load_model(str(directory), device=CPU, dtype="float32", page_size=16)


def run(engine: TorchEngine, model: str, prompt: list[int] = PROMPT, n: int = 6) -> Request:
    req = engine.new_request(model, prompt, SamplingParams(n, ignore_eos=True))
    engine.submit(req)
    while engine.has_work():
        engine.step()
        engine.check()  # free + cached + in use == total, pages on each request's own path
    return req


def merged(files: dict[str, Path], adapter: str, into: Path) -> Path:
    """The base checkpoint with W + (alpha / r) B A in every adapted projection."""
    into.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (into / name).write_bytes((files["base"] / name).read_bytes())
    weights = {k: v.float() for k, v in load_file(str(files["base"] / "model.safetensors")).items()}
    config = json.loads((files[adapter] / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(files[adapter] / "adapter_model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." in key:
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[target] += scale * (b.float() @ a.float())
    save_file(weights, str(into / "model.safetensors"))
    return into


def test_base_and_two_adapters_three_outputs_each_its_own_cache(
    files: dict[str, Path], tmp_path: Path
) -> None:
    engine = TorchEngine(
        {"base": load(files["base"])}, EngineConfig(num_pages=64, record_logits=True)
    )
    engine.load_adapter("a1", str(files["a1"]))
    engine.load_adapter("a2", str(files["a2"]))
    first = {m: run(engine, m) for m in ("base", "a1", "a2")}
    outputs = {m: tuple(r.output) for m, r in first.items()}
    assert len(set(outputs.values())) == 3, outputs
    assert all(r.cached_tokens == 0 for r in first.values())  # nobody else's prefix
    again = {m: run(engine, m) for m in ("a2", "base", "a1")}
    for m, r in again.items():
        assert r.cached_tokens == 48, m  # its own three full pages
        assert tuple(r.output) == outputs[m]
    pool = next(iter(engine.pools.values()))
    groups = {g: tree.blocks for g, tree in pool.cache.trees.items()}
    base_group = engine.served["base"].kv_group
    assert set(groups) == {base_group, f"{base_group}+lora:a1", f"{base_group}+lora:a2"}
    assert all(blocks >= 3 for blocks in groups.values()), groups

    # the adapter's math: the base with the LoRA merged into its weights
    for adapter in ("a1", "a2"):
        reference = TorchEngine(
            {"m": load(merged(files, adapter, tmp_path / adapter))},
            EngineConfig(num_pages=64, record_logits=True),
        )
        ref = run(reference, "m")
        assert tuple(ref.output) == outputs[adapter]
        got, want = torch.stack(first[adapter].logits or []), torch.stack(ref.logits or [])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_slots_evict_the_idle_lru_and_unload_drops_the_tree(files: dict[str, Path]) -> None:
    config = EngineConfig(num_pages=64, max_loras=1)
    engine = TorchEngine({"base": load(files["base"])}, config)
    engine.load_adapter("a1", str(files["a1"]))
    engine.load_adapter("a2", str(files["a2"]))
    slots = engine.adapters.slots
    run(engine, "a1")
    run(engine, "a2")  # one slot: a1 (idle) gives it up
    assert (slots.loads, slots.evictions, slots.active_names()) == (2, 1, ["a2"])
    assert run(engine, "a1").cached_tokens == 48  # evicted from its slot, not from the cache
    # both at once with one slot: a2 waits until a1's request is done, then takes the slot
    r1 = engine.new_request("a1", PROMPT, SamplingParams(4, ignore_eos=True))
    r2 = engine.new_request("a2", PROMPT, SamplingParams(4, ignore_eos=True))
    engine.submit(r1)
    engine.submit(r2)
    steps = 0
    while engine.has_work():
        engine.step()
        engine.check()
        steps += 1
        assert steps < 200
    assert r1.finish_reason == r2.finish_reason == "length"
    group = engine.served["a1"].kv_group
    with pytest.raises(ValueError, match="already been loaded"):
        engine.load_adapter("a1", str(files["a1"]))
    with pytest.raises(ValueError, match="cannot read"):
        engine.load_adapter("a3", str(files["base"] / "missing"))
    engine.unload_adapter("a1")
    pool = next(iter(engine.pools.values()))
    assert group not in pool.cache.trees and "a1" not in engine.served
    engine.check()
    with pytest.raises(KeyError):
        engine.unload_adapter("a1")
    assert tuple(run(engine, "a2").output)  # the other adapter still serves


def test_the_torch_worker_serves_adapters_over_http(files: dict[str, Path]) -> None:
    """vLLM's endpoints and flags on a real torch worker process; adapter blocks in events."""
    args = ["--model", f"base={files['base']}", "--enable-lora", "--max-loras", "2"]
    args += ["--lora-modules", f"a1={files['a1']}", "--num-pages", "64"]
    with running_worker(*args) as w, httpx.Client(base_url=w.url, timeout=30) as http:
        body = {"lora_name": "a2", "lora_path": str(files["a2"])}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
        bad = {"lora_name": "a3", "lora_path": str(files["base"])}  # a model, not an adapter
        resp = http.post("/v1/load_lora_adapter", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_path"

        def complete(model: str) -> tuple[str, int]:
            req = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
            out = http.post("/v1/completions", json={**req, "ignore_eos": True}).json()
            return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

        first = {m: complete(m) for m in ("base", "a1", "a2")}
        assert len({text for text, _ in first.values()}) == 3
        assert [cached for _, cached in first.values()] == [0, 0, 0]
        assert [complete(m)[1] for m in ("a1", "a2", "base")] == [48, 48, 48]
        info = http.get("/urc/info").json()
        base_group = info["models"][0]["kv_group"]
        assert info["lora"] == {"max_loras": 2, "active": ["a1", "a2"]}  # a2 used last
        assert info["pools"][0]["kv_groups"] == [
            base_group,
            f"{base_group}+lora:a1",
            f"{base_group}+lora:a2",
        ]
        assert 'urc_worker_lora_loads_total{model="base"} 2.0' in http.get("/metrics").text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
        assert http.get("/urc/load").json()["lora_active"] == ["a2"]
