"""SGLang's server as a worker, unchanged: its radix cache (on by default), cached-token
reporting (`--enable-cache-report`) and KV events (the vLLM wire format, `--kv-events-config`).

SGLang's default page size is 1, which would make every token a block; the launcher asks for
`page_size` tokens per page (the gateway's block size). `load_format="dummy"` serves random
weights of the model's config (no checkpoint needed: a GPU check with a small Llama config).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from backends.real.process import EngineEndpoints, EngineLaunch, kv_events_config


@dataclass(slots=True)
class SGLangSpec:
    model: str  # a model directory (or hub id)
    port: int
    events_port: int
    replay_port: int
    served_model_name: str | None = None  # SGLang serves one name (none: the model path)
    host: str = "127.0.0.1"
    page_size: int = 16
    load_format: str | None = None  # "dummy": random weights
    context_length: int | None = None
    max_total_tokens: int | None = None  # a small KV pool evicts early
    mem_fraction_static: float | None = None
    python: str = sys.executable
    extra_args: list[str] = field(default_factory=list)


def sglang_launch(spec: SGLangSpec) -> EngineLaunch:
    name = spec.served_model_name or spec.model
    argv = [
        *(spec.python, "-m", "sglang.launch_server", "--model-path", spec.model),
        *("--served-model-name", name, "--host", spec.host, "--port", str(spec.port)),
        *("--page-size", str(spec.page_size), "--enable-cache-report"),
        *("--kv-events-config", kv_events_config(spec.events_port, spec.replay_port)),
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
    endpoints = EngineEndpoints.of(
        spec.host, spec.port, [name], spec.page_size, spec.events_port, spec.replay_port
    )
    return EngineLaunch(argv + spec.extra_args, {}, endpoints)
