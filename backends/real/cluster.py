"""`urc cluster --engine vllm|sglang`: N real engines on this machine, started in parallel on
free ports, each waited for until healthy; the gateway is handed their endpoints."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
from pathlib import Path

from backends.real.process import (
    EngineLaunch,
    EngineProcess,
    EngineSpec,
    sglang_launch,
    start_engine,
    vllm_launch,
)


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (held open together so that none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def add_real_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("real engines (--engine vllm|sglang)")
    group.add_argument("--model", help="the model directory (or hub id) the engines serve")
    group.add_argument("--served-model-name", help="the name clients use (default: --model)")
    group.add_argument(
        "--engine-python",
        help="the interpreter of the environment the engine is installed in (default: this one)",
    )
    group.add_argument(
        "--block-size", type=int, help="tokens per KV block (default 16; vLLM on CPU: 32)"
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
        block_size=args.block_size or (32 if vllm and args.cpu else 16),
        python=args.engine_python or sys.executable,
        extra_args=list(args.worker_arg),
        cpu=vllm and args.cpu,
    )
    return vllm_launch(spec) if vllm else sglang_launch(spec)


async def start_real_engines(
    args: argparse.Namespace, timeout_s: float = 600.0
) -> list[EngineProcess]:
    """Start `args.workers` engines at once and wait until all are healthy (or stop them all)."""
    log_dir = Path(args.engine_log_dir or tempfile.mkdtemp(prefix=f"urc-{args.engine}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(3 * args.workers)
    engines = [
        start_engine(engine_launch(args, ports[3 * i : 3 * i + 3]), log_dir / f"engine{i}.log")
        for i in range(args.workers)
    ]
    print(f"{args.engine}: {len(engines)} engine(s) starting, logs in {log_dir}", flush=True)
    try:
        await asyncio.gather(*(asyncio.to_thread(e.wait_ready, timeout_s) for e in engines))
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: list[EngineProcess]) -> None:
    for engine in engines:
        engine.stop()
