"""SGLang's server as a worker, unchanged: its radix cache (on by default), cached-token
reporting (`--enable-cache-report`) and KV events (the vLLM wire format, `--kv-events-config`).

SGLang's default page size is 1, which would make every token a block; the launcher asks for
`page_size` tokens per page (the gateway's block size). `load_format="dummy"` serves random
weights of the model's config (no checkpoint needed: a GPU check with a small Llama config).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from backends.real.process import (
    EngineEndpoints,
    EngineLaunch,
    served_names,
    tcp_bind,
    tcp_connect,
)

KV_TOPIC = "kv"


@dataclass(slots=True)
class SGLangSpec:
    model: str  # a model directory (or hub id)
    port: int
    events_port: int
    replay_port: int
    served_model_name: str | None = None  # SGLang serves one name
    host: str = "127.0.0.1"
    page_size: int = 16
    load_format: str | None = None  # "dummy": random weights
    context_length: int | None = None
    max_total_tokens: int | None = None  # a small KV pool evicts early
    mem_fraction_static: float | None = None
    python: str = sys.executable
    extra_args: list[str] = field(default_factory=list)


def kv_events_config(events_port: int, replay_port: int, topic: str = KV_TOPIC) -> str:
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": tcp_bind(events_port),
            "replay_endpoint": tcp_bind(replay_port),
            "topic": topic,
        }
    )


def sglang_launch(spec: SGLangSpec) -> EngineLaunch:
    names = served_names(spec.model, [spec.served_model_name] if spec.served_model_name else None)
    argv = [
        spec.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model,
        "--served-model-name",
        names[0],
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--page-size",
        str(spec.page_size),
        "--enable-cache-report",
        "--kv-events-config",
        kv_events_config(spec.events_port, spec.replay_port),
    ]
    optional = {
        "--load-format": spec.load_format,
        "--context-length": spec.context_length,
        "--max-total-tokens": spec.max_total_tokens,
        "--mem-fraction-static": spec.mem_fraction_static,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    argv += spec.extra_args
    endpoints = EngineEndpoints(
        url=f"http://{spec.host}:{spec.port}",
        models=names,
        block_size=spec.page_size,
        kv_events=tcp_connect(spec.host, spec.events_port),
        kv_replay=tcp_connect(spec.host, spec.replay_port),
        kv_topic=KV_TOPIC,
    )
    return EngineLaunch(argv, {}, endpoints)
