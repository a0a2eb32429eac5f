"""Real vLLM CPU engines on 127.0.0.1 for the integration tests (`make test-vllm`).

`URC_VLLM_PYTHON` names the interpreter of an environment with vLLM installed (the Makefile
builds `.venv-vllm`); the engines serve a tiny random-weight Llama written here
(backends/tiny_checkpoint.py), so nothing is downloaded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from backends.real.process import (
    EngineLaunch,
    EngineProcess,
    EngineSpec,
    start_ready_engines,
    vllm_launch,
)

VLLM_PYTHON = os.environ.get("URC_VLLM_PYTHON", "")
MODEL = "tiny"
BLOCK = 32  # vLLM on CPU wants a multiple of 32
ADMIN = {"Authorization": "Bearer admin"}


def start_vllm_engines(
    model_dir: Path, log_dir: Path, n: int, num_blocks: int
) -> list[EngineProcess]:
    """`n` engines started at once, each with `num_blocks` KV blocks; all healthy or none."""

    def launch_on(ports: list[int]) -> EngineLaunch:
        spec = EngineSpec(
            str(model_dir),
            *ports,
            names=[MODEL],
            block_size=BLOCK,
            max_model_len=1024,
            num_gpu_blocks=num_blocks,
            cpu=True,
            python=VLLM_PYTHON,
        )
        return vllm_launch(spec)

    return start_ready_engines(launch_on, n, log_dir, name="vllm")


def attach_args(engines: list[EngineProcess]) -> list[str]:
    args = []
    for engine in engines:
        e = engine.endpoints
        spec = (
            f"{e.url},model={MODEL},kv_events={e.kv_events},kv_replay={e.kv_replay},"
            f"kv_topic={e.kv_topic},block_size={e.block_size}"
        )
        args += ["--attach", spec]
    return args


def admin_workers(gateway: str) -> list[dict]:
    return httpx.get(f"{gateway}/admin/workers", headers=ADMIN, timeout=10).json()["workers"]


def settle(gateway: str, quiet_s: float = 0.4, timeout_s: float = 10.0) -> None:
    """Until no worker's KV-event stream has moved for `quiet_s` (the engines are idle)."""

    def seqs() -> list:
        return [
            (s["mirror"] or {}).get("last_seq")
            for w in admin_workers(gateway)
            for s in w["kv_events"]
        ]

    deadline = time.monotonic() + timeout_s
    last = seqs()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = seqs()
        if now == last:
            return
        last = now


def route(response: httpx.Response) -> dict[str, str]:
    header = response.headers["x-urc-route"]
    return dict(part.strip().split("=", 1) for part in header.split(";"))


def cached_tokens(response: httpx.Response) -> int:
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
