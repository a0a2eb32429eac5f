"""LoRA adapters through the gateway in front of a real vLLM CPU engine (`make test-vllm`;
skipped without URC_VLLM_PYTHON; docs/adapters.md): the tiny base served with `--enable-lora` and
two tiny adapters written here (backends/tiny_lora.py), one loaded at start-up, the other on
demand by the gateway (vLLM's /v1/load_lora_adapter, runtime updating on). Repeated prompts per
adapter are cached and predicted exactly (x-urc-route's matched_tokens = vLLM's cached_tokens);
a prompt cached under one adapter is predicted 0 for another and for the base."""

from __future__ import annotations

import httpx
import pytest

from backends.real.process import EngineLaunch, EngineSpec, start_ready_engines, vllm_launch
from backends.tiny_checkpoint import write_checkpoint
from backends.tiny_lora import write_adapter
from core.text import filler
from tests.backends.vllm_fleet import (
    ADMIN,
    BLOCK,
    MODEL,
    VLLM_PYTHON,
    admin_workers,
    cached_tokens,
    route,
    settle,
)
from tests.processes import wait_for
from urc.processes import start_gateway

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON, reason="URC_VLLM_PYTHON unset (make test-vllm)"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm-lora")
    model_dir = write_checkpoint(root / "model")
    paths = {
        name: write_adapter(root / name, model_dir, seed=i + 1)
        for i, name in enumerate(("sql", "poet"))
    }

    def launch_on(ports: list[int]) -> EngineLaunch:
        lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
        spec = EngineSpec(
            str(model_dir),
            *ports,
            names=[MODEL],
            block_size=BLOCK,
            max_model_len=1024,
            num_gpu_blocks=128,
            cpu=True,
            python=VLLM_PYTHON,
            extra_args=[*lora, "--lora-modules", f"sql={paths['sql']}"],
        )
        launch = vllm_launch(spec)
        launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return launch

    engine = start_ready_engines(launch_on, 1, root, name="vllm-lora")[0]
    e = engine.endpoints
    config = root / "gateway.toml"
    config.write_text(
        f'[gateway]\nadmin_key = "admin"\n'
        f'[[workers]]\nurl = "{e.url}"\nmodels = ["{MODEL}"]\nengine = "vllm"\n'
        f'kv_events = "{e.kv_events}"\nkv_replay = "{e.kv_replay}"\nkv_topic = "{e.kv_topic}"\n'
        f"block_size = {BLOCK}\n"
        f'[[models]]\nname = "{MODEL}"\ntokenizer = "{model_dir}"\nblock_size = {BLOCK}\n'
        f'[[models]]\nname = "sql"\nbase = "{MODEL}"\nlora_path = "{paths["sql"]}"\n'
        f'[[models]]\nname = "poet"\nbase = "{MODEL}"\nlora_path = "{paths["poet"]}"\n'
    )
    gateway = start_gateway([], "--config", str(config))
    try:
        assert wait_for(lambda: [w["mode"] for w in admin_workers(gateway.url)] == ["exact"], 60)
        yield gateway.url, engine
    finally:
        gateway.stop()
        engine.stop()


def complete(url: str, model: str, prompt: str) -> tuple[int, int]:
    """(predicted, cached) of one completion through the gateway."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return int(route(resp)["matched_tokens"]), cached_tokens(resp)


def predicted(url: str, model: str, prompt: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 4}
    plan = httpx.post(f"{url}/admin/route", json=body, headers=ADMIN, timeout=10).json()
    return max(c["matched_tokens"] for c in plan["candidates"])


def test_adapters_cached_and_predicted_exactly_and_loaded_on_demand(fleet) -> None:
    url, engine = fleet
    models = httpx.get(f"{engine.endpoints.url}/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["parent"] for m in models} == {MODEL: None, "sql": MODEL}
    prompt = filler(300, "vllm-lora/sql")
    assert complete(url, "sql", prompt) == (0, 0)
    settle(url)
    hit = complete(url, "sql", prompt)
    assert hit[0] == hit[1] > 0  # vLLM's cached tokens, as the gateway predicted them
    assert predicted(url, "poet", prompt) == 0  # never another adapter's
    assert predicted(url, MODEL, prompt) == 0  # nor the base's
    # poet is loaded nowhere: the gateway loads it (its lora_path), then it is answered
    assert complete(url, "poet", prompt) == (0, 0)
    models = httpx.get(f"{engine.endpoints.url}/v1/models", timeout=10).json()["data"]
    assert "poet" in {m["id"] for m in models}
    settle(url)
    again = complete(url, "poet", prompt)
    assert again[0] == again[1] > 0
    assert complete(url, MODEL, prompt) == (0, 0)
    metrics = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=10).text
    assert any(
        m.startswith("urc_adapter_loads_total{") and m.endswith(" 1.0")
        for m in metrics.splitlines()
    )
