"""`urc cluster`: a gateway and N local workers on 127.0.0.1, the embedded default.

Workers run as child processes (`python -m backends.<engine>.server`), each announcing
`ready: URL`; the gateway runs in this process and prints `gateway: URL` once it accepts
connections. SIGINT/SIGTERM stop the gateway, then the workers.

`--engine vllm|sglang` starts real engines instead (backends/real/cluster.py), in parallel,
and hands the gateway their endpoints and the model directory's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from router.gateway.app import run_async, serve_gateway
from router.gateway.config import (
    ConfigError,
    GatewayConfig,
    ModelConfig,
    WorkerConfig,
    add_gateway_arguments,
    apply_flags,
    load_config,
)

ENGINES = {"emulated": "backends.emulated.server", "torch": "backends.torch_worker.server"}
REAL_ENGINES = ("vllm", "sglang")  # backends/real/cluster.py, imported only when asked for
READY_TIMEOUT_S = 120.0


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="number of workers (default 4)")
    parser.add_argument("--engine", choices=sorted([*ENGINES, *REAL_ENGINES]), default="emulated")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument passed to every worker, e.g. --worker-arg=--capacity-tokens=200000",
    )
    from backends.real.cluster import add_real_engine_arguments

    add_real_engine_arguments(parser)
    add_gateway_arguments(parser)


async def start_worker(
    engine: str, port: int, extra: list[str]
) -> tuple[asyncio.subprocess.Process, str]:
    """Start one worker; returns it and its URL once it prints `ready: URL`."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        ENGINES[engine],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None

    async def ready() -> str:
        while line := await proc.stdout.readline():  # type: ignore[union-attr]
            text = line.decode(errors="replace").strip()
            if text.startswith("ready: "):
                return text.removeprefix("ready: ")
        raise RuntimeError(f"worker on port {port} exited with {await proc.wait()}")

    try:
        url = await asyncio.wait_for(ready(), READY_TIMEOUT_S)
    except BaseException:
        await stop_workers([proc])
        raise
    # keep draining its stdout so a chatty worker never blocks on a full pipe
    asyncio.get_running_loop().create_task(_drain(proc))
    return proc, url


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def stop_workers(procs: list[asyncio.subprocess.Process], timeout_s: float = 10.0) -> None:
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def run_real_cluster(args: argparse.Namespace, config: GatewayConfig) -> None:
    from backends.real.cluster import start_real_engines, stop_engines

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engines = await start_real_engines(args)
    try:
        for engine in engines:
            config.workers.append(WorkerConfig(**engine.endpoints.worker_entry()))
        names = engines[0].endpoints.models
        configured = {m.name for m in config.models}
        if Path(args.model).is_dir():  # key prompts with the engine's own tokenizer
            config.models += [
                ModelConfig(n, tokenizer=args.model) for n in names if n not in configured
            ]
        await serve_gateway(config, stop)
    finally:
        await asyncio.to_thread(stop_engines, engines)


async def run_cluster(args: argparse.Namespace, config: GatewayConfig) -> None:
    if args.engine in REAL_ENGINES:
        await run_real_cluster(args, config)
        return
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # port 0: each worker binds a port of its own and announces it (no race for a free one)
    results = await asyncio.gather(
        *(start_worker(args.engine, 0, args.worker_arg) for _ in range(args.workers)),
        return_exceptions=True,
    )
    procs = [r[0] for r in results if not isinstance(r, BaseException)]
    try:
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"{len(failed)} worker(s) did not start: {failed[0]}")
        config.workers.extend(WorkerConfig(url=r[1]) for r in results)  # type: ignore[index]
        await serve_gateway(config, stop)
    finally:
        await stop_workers(procs)


def cluster_main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("urc cluster: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        config = apply_flags(load_config(args.config), args)
    except ConfigError as exc:
        print(f"urc cluster: {exc}", file=sys.stderr)
        return 2
    try:
        run_async(run_cluster(args, config))
    except (RuntimeError, ValueError) as exc:
        print(f"urc cluster: {exc}", file=sys.stderr)
        return 1
    return 0
