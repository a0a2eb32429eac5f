"""A model configured without a block size (here: only its tokenizer) is keyed with its
workers' block size, as engines that cannot be asked are described (vLLM on CPU: 32)."""

from __future__ import annotations

import httpx

from tests.processes import wait_for
from urc.processes import start_gateway, start_worker


def test_a_model_without_a_block_size_takes_its_workers() -> None:
    worker = start_worker("--block-size", "32")
    gateway = start_gateway([worker.url], "--admin-key", "k", "--model-tokenizer", "emulated=byte")
    try:
        admin = {"Authorization": "Bearer k"}
        url = gateway.url

        def exact() -> bool:
            workers = httpx.get(f"{url}/admin/workers", headers=admin, timeout=5).json()
            return [(w["mode"], w["block_size"]) for w in workers["workers"]] == [("exact", 32)]

        assert wait_for(exact, 20)
        body = {
            "model": "emulated",
            "prompt": "a prompt of some length " * 8 + "end",
            "max_tokens": 2,
        }
        httpx.post(f"{url}/v1/completions", json=body, timeout=30).raise_for_status()

        def predicted() -> int:
            plan = httpx.post(f"{url}/admin/route", json=body, headers=admin, timeout=5).json()
            return max(c["matched_tokens"] for c in plan["candidates"])

        assert wait_for(lambda: predicted() == 192, 10)  # 195 bytes: 6 full blocks of 32
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    finally:
        gateway.stop()
        worker.stop()
