"""Real engines (vLLM, SGLang) as child processes: the command line that turns on prefix
caching, cached-token reporting and KV events, and what the gateway must know about each (real
engines have no /urc/info: the `[[workers]]` entry of a gateway config, docs/cli.md); and
`urc cluster --engine vllm|sglang`, N of them started in parallel on free ports."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core import lifeline
from core.blocks import DEFAULT_BLOCK_SIZE
from core.ports import free_ports

KV_TOPIC = "kv"
PORTS_PER_ENGINE = 3  # HTTP, KV events, KV replay (EngineSpec's order)
_PORT_TRIES = 3
# vLLM's CPU build: the engine core in-process (quicker start, one process to kill), 1 GiB of
# KV cache, no hub
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}


@dataclass(slots=True)
class EngineEndpoints:
    """One engine as the gateway's `[[workers]]` entry describes it."""

    url: str
    models: list[str]
    block_size: int
    kv_events: str  # as the gateway connects to it (tcp://host:port)
    kv_replay: str
    kv_topic: str = KV_TOPIC

    def worker_entry(self) -> dict[str, Any]:
        """The `[[workers]]` table of a gateway config file."""
        return asdict(self)


@dataclass(slots=True)
class EngineLaunch:
    """A command line and environment that start one engine, and its endpoints once up."""

    argv: list[str]
    env: dict[str, str]
    endpoints: EngineEndpoints


@dataclass(slots=True, eq=False)
class EngineProcess:
    """A started engine; its output goes to `log_path` (engines are chatty)."""

    launch: EngineLaunch
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def endpoints(self) -> EngineEndpoints:
        return self.launch.endpoints

    def wait_ready(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        """Until /health answers 200; RuntimeError (with the log's tail) if it exits or the
        time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self.popen.returncode}:\n{self.log_tail()}"
                )
            health = self.endpoints.url + "/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(interval_s)
        raise RuntimeError(f"engine not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def lost_a_port(self) -> bool:
        """Whether it exited because one of its ports was taken when it came to bind it."""
        with contextlib.suppress(OSError):
            return "address already in use" in self.log_path.read_text(errors="replace").lower()
        return False

    def kill(self) -> None:
        """SIGKILL to the whole engine (its engine-core child holds the KV-event sockets),
        as a crash: no goodbye on any socket."""
        self._signal_group(signal.SIGKILL)
        self.popen.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to whatever of the engine is left (children included)."""
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        self.kill()

    def _signal_group(self, sig: signal.Signals) -> None:
        # start_engine made the engine a session (and process group) leader
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


def start_engine(launch: EngineLaunch, log_path: str | Path) -> EngineProcess:
    """Start `launch` in its own process group, output to `log_path`; does not wait. The engine
    gets SIGTERM when this process dies, even by SIGKILL (core/lifeline.py)."""
    path = Path(log_path)
    with path.open("wb") as log:  # the child writes to its own copy of the descriptor
        popen = lifeline.popen(
            launch.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **launch.env},
            start_new_session=True,
        )
    return EngineProcess(launch, popen, path)


@dataclass(slots=True)
class EngineSpec:
    """One engine to launch; SGLang serves one name (the first), vLLM all of them."""

    model: str  # a model directory (or hub id, if the engine may download it)
    port: int
    events_port: int
    replay_port: int
    names: list[str] = field(default_factory=list)  # none: the model path
    host: str = "127.0.0.1"
    # SGLang's default page size, 1, would make every token a block
    block_size: int = DEFAULT_BLOCK_SIZE
    python: str = sys.executable  # the interpreter of the environment the engine is installed in
    extra_args: list[str] = field(default_factory=list)
    cpu: bool = False  # vLLM's CPU build (block size a multiple of 32): CPU_ENV, bf16, eager
    max_model_len: int | None = None  # vLLM
    num_gpu_blocks: int | None = None  # vLLM's --num-gpu-blocks-override: a small cache evicts
    load_format: str | None = None  # SGLang; "dummy": random weights of the model's config

    def launch(self, argv: list[str], names: list[str], env: dict[str, str]) -> EngineLaunch:
        connect = f"tcp://{self.host}:"
        endpoints = EngineEndpoints(
            f"http://{self.host}:{self.port}",
            names,
            self.block_size,
            f"{connect}{self.events_port}",
            f"{connect}{self.replay_port}",
        )
        return EngineLaunch(argv + self.extra_args, env, endpoints)

    def kv_events_config(self, **extra: Any) -> str:
        """The `--kv-events-config` both engines take: ZMQ PUB and replay on every interface
        (vLLM binds an endpoint only when it names a wildcard; any other it connects to)."""
        return json.dumps(
            {
                **extra,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port}",
                "replay_endpoint": f"tcp://*:{self.replay_port}",
                "topic": KV_TOPIC,
            }
        )


def vllm_launch(spec: EngineSpec) -> EngineLaunch:
    names = spec.names or [spec.model]
    events = spec.kv_events_config(enable_kv_cache_events=True)
    argv = [
        *(spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model),
        *("--served-model-name", *names, "--host", spec.host, "--port", str(spec.port)),
        *("--block-size", str(spec.block_size), "--enable-prefix-caching"),
        *("--enable-prompt-tokens-details", "--kv-events-config", events),
        *("--dtype", "bfloat16" if spec.cpu else "auto"),
        # honour the `priority` the gateway forwards (else ignored): by (priority, arrival)
        *("--scheduling-policy", "priority"),
    ]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks)]
    if spec.cpu:
        argv.append("--enforce-eager")
    return spec.launch(argv, names, dict(CPU_ENV) if spec.cpu else {})


def sglang_launch(spec: EngineSpec) -> EngineLaunch:
    name = spec.names[0] if spec.names else spec.model
    argv = [
        *(spec.python, "-m", "sglang.launch_server", "--model-path", spec.model),
        *("--served-model-name", name, "--host", spec.host, "--port", str(spec.port)),
        *("--page-size", str(spec.block_size), "--enable-cache-report"),
        *("--kv-events-config", spec.kv_events_config()),
    ]
    if spec.load_format is not None:
        argv += ["--load-format", spec.load_format]
    return spec.launch(argv, [name], {})


def add_real_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("real engines (--engine vllm|sglang)")
    group.add_argument("--model", help="the model directory (or hub id) the engines serve")
    group.add_argument("--served-model-name", help="the name clients use (default: --model)")
    group.add_argument(
        "--engine-python",
        help="the interpreter of the environment the engine is installed in (default: this one)",
    )
    group.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE}; vLLM on CPU: 32)",
    )
    group.add_argument("--cpu", action="store_true", help="vLLM's CPU build: small footprint")
    group.add_argument("--engine-log-dir", help="where engine logs go (default: a temp dir)")


def engine_launch(args: argparse.Namespace, ports: list[int]) -> EngineLaunch:
    if not args.model:
        raise ValueError(f"--engine {args.engine} needs --model")
    vllm = args.engine == "vllm"
    spec = EngineSpec(
        args.model,
        *ports,
        [args.served_model_name] if args.served_model_name else [],
        block_size=args.block_size or (32 if vllm and args.cpu else DEFAULT_BLOCK_SIZE),
        python=args.engine_python or sys.executable,
        extra_args=list(args.worker_arg),
        cpu=vllm and args.cpu,
    )
    return vllm_launch(spec) if vllm else sglang_launch(spec)


async def start_real_engines(
    args: argparse.Namespace, timeout_s: float = 600.0
) -> list[EngineProcess]:
    """Start `args.workers` engines at once and wait until all are healthy (or stop them all)."""
    engine_launch(args, [0] * PORTS_PER_ENGINE)  # a bad command line fails here, not n times
    log_dir = Path(args.engine_log_dir or tempfile.mkdtemp(prefix=f"urc-{args.engine}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{args.engine}: {args.workers} engine(s) starting, logs in {log_dir}", flush=True)
    started: list[EngineProcess] = []
    try:
        return await asyncio.to_thread(
            start_ready_engines,
            lambda ports: engine_launch(args, ports),
            args.workers,
            log_dir,
            timeout_s=timeout_s,
            started=started,
        )
    except BaseException:  # cancelled (Ctrl-C) while the engines start: none is left running
        stop_engines(started)
        raise


def start_ready_engines(
    launch_on: Callable[[list[int]], EngineLaunch],
    n: int,
    log_dir: Path,
    name: str = "engine",
    timeout_s: float = 600.0,
    started: list[EngineProcess] | None = None,
) -> list[EngineProcess]:
    """`n` engines started at once, each on `PORTS_PER_ENGINE` free ports (`launch_on`'s
    argument), and waited on until all are healthy, or all stopped. A port is free when drawn but
    not held: an engine that finds one taken when it binds is started again on fresh ports.
    Every engine started is appended to `started`, for a caller that must stop them itself."""
    started = [] if started is None else started

    def start_one(i: int) -> EngineProcess:
        for attempt in range(_PORT_TRIES):
            launch = launch_on(free_ports(PORTS_PER_ENGINE))
            engine = start_engine(launch, log_dir / f"{name}{i}.log")
            started.append(engine)
            try:
                engine.wait_ready(timeout_s)
                return engine
            except RuntimeError:
                if attempt + 1 == _PORT_TRIES or not engine.lost_a_port():
                    raise
                engine.stop()
        raise AssertionError("unreachable")

    try:
        with cf.ThreadPoolExecutor(n) as pool:
            return list(pool.map(start_one, range(n)))
    except BaseException:
        stop_engines(started)
        raise


def stop_engines(engines: list[EngineProcess]) -> None:
    for engine in engines:
        engine.stop()
