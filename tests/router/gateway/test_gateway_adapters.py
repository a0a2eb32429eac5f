"""LoRA adapters through a real gateway process (docs/adapters.md): loading on demand, the slot
limit, failures as OpenAI errors, discovery from /v1/models, metrics. The workers are small
stand-ins that speak vLLM's adapter API (/v1/models with parents, /v1/load_lora_adapter,
/v1/unload_lora_adapter) and refuse a model they have not loaded, as vLLM does; the real engines
are tested with real vLLM (docs/adapters.md, "With real vLLM")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from core.errors import APIError
from router.adapters import Adapters
from router.epp.picker import EndpointPicker
from router.gateway.app import Gateway
from router.gateway.config import (
    ConfigError,
    GatewayConfig,
    ModelConfig,
    WorkerConfig,
    check,
    parse_config,
)
from router.gateway.load_report import parse_prometheus, parse_urc
from tests.processes import wait_for
from urc.processes import start_gateway

BASE = "tiny"


class StandIn:
    """One vLLM-like worker in a thread of the test: its loaded adapters and the calls."""

    def __init__(self, preloaded: dict[str, str] | None = None) -> None:
        self.loaded: dict[str, str] = dict(preloaded or {})  # name -> path
        self.calls: list[tuple[str, str]] = []  # (load|unload|chat, model)
        self.url = ""
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._text)
        app.router.add_get("/metrics", self._text)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _text(self, request: web.Request) -> web.Response:
        return web.Response(text="ok" if request.path == "/health" else "")

    async def _models(self, _: web.Request) -> web.Response:
        data = [{"id": BASE, "parent": None, "root": BASE}]
        data += [{"id": n, "parent": BASE, "root": p} for n, p in self.loaded.items()]
        return web.json_response({"object": "list", "data": data})

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        self.calls.append(("load", name))
        if name in self.loaded:
            return web.Response(
                status=400, text=f"The lora adapter '{name}' has already been loaded."
            )
        if "missing" in path:
            return web.Response(status=400, text=f"No adapter found for {path}")
        self.loaded[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        if self.loaded.pop(name, None) is None:
            return web.Response(status=404, text=f"The lora adapter '{name}' cannot be found.")
        return web.Response(text="ok")

    async def _chat(self, request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        self.calls.append(("chat", model))
        if model != BASE and model not in self.loaded:
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        usage = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
        usage["prompt_tokens_details"] = {"cached_tokens": 0}  # type: ignore[assignment]
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}}
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )


def _config(tmp: Path, workers: list[StandIn]) -> Path:
    lines = ['[gateway]\nadmin_key = "admin-secret"\n']
    for w in workers:
        lines.append(f'[[workers]]\nurl = "{w.url}"\nmodels = ["{BASE}"]\nengine = "vllm"\n')
    lines.append(f'[[models]]\nname = "{BASE}"\nblock_size = 16\n')
    for k in range(6):
        lines.append(f'[[models]]\nname = "a{k}"\nbase = "{BASE}"\nlora_path = "/lora/a{k}"\n')
    lines.append(f'[[models]]\nname = "broken"\nbase = "{BASE}"\nlora_path = "/lora/missing"\n')
    lines.append(f'[[models]]\nname = "pathless"\nbase = "{BASE}"\n')
    path = tmp / "gateway.toml"
    path.write_text("\n".join(lines))
    return path


@contextlib.contextmanager
def _fleet(tmp: Path, workers: list[StandIn]) -> Iterator[str]:
    gateway = start_gateway([], "--config", str(_config(tmp, workers)))
    try:
        up = lambda: httpx.get(f"{gateway.url}/health", timeout=5).json()["workers_up"]  # noqa: E731
        assert wait_for(lambda: up() == len(workers), 20)
        yield gateway.url
    finally:
        gateway.stop()
        for w in workers:
            w.stop()


def _chat(url: str, model: str, text: str = "hello there, adapter") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_an_adapter_is_loaded_on_demand_once_and_unloaded_past_the_slots(tmp_path: Path):
    worker = StandIn()
    with _fleet(tmp_path, [worker]) as url:
        for _ in range(3):
            assert _chat(url, "a0").status_code == 200
        assert worker.calls.count(("load", "a0")) == 1  # one load, then it is there
        for k in range(1, 5):  # four slots (vLLM's metrics say none here: the default)
            assert _chat(url, f"a{k}").status_code == 200
        unloads = [c for c in worker.calls if c[0] == "unload"]
        assert unloads == [("unload", "a0")]  # the least recently used, idle
        assert set(worker.loaded) == {"a1", "a2", "a3", "a4"}
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert f'urc_adapter_loads_total{{worker="{worker.url[7:]}"}} 5.0' in metrics
        assert f'urc_adapter_unloads_total{{worker="{worker.url[7:]}"}} 1.0' in metrics
        slots = [m for m in metrics.splitlines() if m.startswith("urc_adapter_slots{")]
        assert any('state="max"' in m and m.endswith(" 4.0") for m in slots), slots
        assert any('state="loaded"' in m and m.endswith(" 4.0") for m in slots), slots


def test_failed_loads_try_the_next_worker_then_answer_503(tmp_path: Path):
    workers = [StandIn(), StandIn()]
    with _fleet(tmp_path, workers) as url:
        answer = _chat(url, "broken")
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "adapter_load_failed" and "broken" in error["message"]
        tried = [[c for c in w.calls if c[1] == "broken"] for w in workers]
        assert tried == [[("load", "broken")]] * 2  # both tried, nothing sent
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert metrics.count("urc_adapter_load_failures_total{") == 2


def test_an_adapter_without_a_path_is_served_only_where_loaded(tmp_path: Path):
    holder, other = StandIn({"pathless": "/lora/pathless"}), StandIn()
    with _fleet(tmp_path, [holder, other]) as url:
        for text in ("one", "two", "three", "four"):
            assert _chat(url, "pathless", text).status_code == 200
        assert [c for c in other.calls if c[1] == "pathless"] == []
        assert holder.calls.count(("chat", "pathless")) == 4


def test_an_adapter_nowhere_and_without_a_path_is_404(tmp_path: Path):
    with _fleet(tmp_path, [StandIn()]) as url:
        answer = _chat(url, "pathless")
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "model_not_found"


def test_discovered_adapters_are_models_with_their_own_kv_group(tmp_path: Path):
    worker = StandIn({"found": "/lora/found"})
    with _fleet(tmp_path, [worker]) as url:
        assert _chat(url, "found").status_code == 200
        assert ("load", "found") not in worker.calls  # vLLM's /v1/models said it is there
        plan = httpx.post(
            f"{url}/admin/route",
            json={"model": "found", "messages": [{"role": "user", "content": "x" * 100}]},
            headers={"Authorization": "Bearer admin-secret"},
            timeout=5,
        ).json()
        assert plan["kv_group"] == f"{BASE}+lora:found", json.dumps(plan)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('name = "x"\nbase = "nope"', "is not a model of [[models]]"),
        ('name = "x"\nbase = "tiny"\nkv_group = "g"', "kv_group is derived"),
        ('name = "x"\nlora_path = "/p"', "need a base"),
    ],
)
def test_adapter_config_errors_are_caught_at_start(table: str, message: str):
    text = f'[[models]]\nname = "tiny"\n[[models]]\n{table}\n'
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(parse_config(tomllib.loads(text)))


def test_vllm_lora_metric_and_our_load_say_the_active_adapters_and_slots():
    text = (
        b'vllm:num_requests_running{model_name="tiny"} 1.0\n'
        b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
        b'waiting_lora_adapters=""} 1.7e9\n'
        b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="b,a",'
        b'waiting_lora_adapters="c"} 1.8e9\n'
    )
    sample = parse_prometheus(text)
    assert sample is not None and sample.lora == (["b", "a", "c"], 2)  # the latest series
    ours = b'{"waiting":0,"running":1,"queued_prefill_tokens":0,"running_decode":1,'
    assert parse_urc(ours + b'"free_kv_pages":1,"total_kv_pages":2}').lora is None
    ours += b'"free_kv_pages":1,"total_kv_pages":2,"lora_active":["x"],"max_loras":3}'
    assert parse_urc(ours).lora == (["x"], 3)
    adapters = Adapters()
    adapters.observe_active("w", ["x", "y"], 3)
    adapters.observe_active("w", ["y"], 0)
    state = adapters.worker("w")
    assert set(state.loaded) == {"x", "y"} and set(state.active) == {"y"}
    assert state.max_loras == 3


async def test_urc_epp_loads_an_adapter_and_offers_only_the_endpoints_that_have_it():
    """urc epp's picker (no Envoy here): it loads the adapter as the gateway does and names
    only endpoints holding it; a failing load is the same 503."""
    workers = [StandIn(), StandIn()]
    config = GatewayConfig(
        workers=[WorkerConfig(w.url, models=[BASE], engine="vllm") for w in workers],
        models=[
            ModelConfig(BASE, block_size=16),
            ModelConfig("a0", base=BASE, lora_path="/lora/a0"),
            ModelConfig("broken", base=BASE, lora_path="/lora/missing"),
        ],
        parity_interval_s=0,
        load_interval_s=0,
    )
    gateway = Gateway(config)
    await gateway.fleet.start()
    picker = EndpointPicker(gateway)
    try:
        body = {"model": "a0", "messages": [{"role": "user", "content": "hi " * 40}]}
        raw = json.dumps(body).encode()
        pick = await picker.pick("POST", "/v1/chat/completions", {}, raw)
        holders = [w for w in workers if "a0" in w.loaded]
        assert len(holders) == 1 and pick.endpoints == [holders[0].url[len("http://") :]]
        assert gateway.fleet.adapters.worker(pick.worker.name).in_flight == {"a0": 1}
        picker.ended(pick, 1)
        assert gateway.fleet.adapters.worker(pick.worker.name).in_flight == {}
        raw = json.dumps({**body, "model": "broken"}).encode()
        with pytest.raises(APIError) as refused:
            await picker.pick("POST", "/v1/chat/completions", {}, raw)
        assert (refused.value.status, refused.value.code) == (503, "adapter_load_failed")
    finally:
        await gateway.fleet.close()
        for w in workers:
            w.stop()
