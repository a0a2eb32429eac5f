"""`urc cluster` (docs/cli.md): the gateway in this process, N workers as child processes on
127.0.0.1 (real engines: backends/real/process.py); SIGINT/SIGTERM stop the gateway, then those."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from core.logs import configure_logging
from router.gateway.app import run_async, serve_gateway
from router.gateway.config import ConfigError, GatewayConfig, ModelConfig, WorkerConfig, load_config
from router.gateway.config_flags import add_gateway_arguments, apply_flags
from urc.cli import ENGINES
from urc.processes import Child

REAL_ENGINES = ("vllm", "sglang")  # backends/real/process.py, imported only when asked for
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
    parser.add_argument(
        "--host-capacity-tokens",
        type=int,
        default=0,
        help="each worker's host-memory KV tier in tokens (0: none; docs/tiers.md)",
    )
    parser.add_argument(
        "--host-copy-tokens-per-s",
        type=float,
        default=None,
        help="the emulated host tier's host -> GPU copy rate, tokens/s (default: the worker's)",
    )
    from backends.real.process import add_real_engine_arguments

    add_real_engine_arguments(parser)
    add_gateway_arguments(parser)


async def run_real_cluster(
    args: argparse.Namespace, config: GatewayConfig, stop: asyncio.Event
) -> None:
    from backends.real.process import start_real_engines, stop_engines

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


def worker_argv(args: argparse.Namespace, config: GatewayConfig) -> list[str]:
    """The command line of each of our workers (ENGINES)."""
    # port 0: each worker binds a port of its own and announces it (no race for a free one)
    argv = [sys.executable, "-m", ENGINES[args.engine], "--host", "127.0.0.1", "--port", "0"]
    argv += ["--log-level", config.log_level, "--log-format", config.log_format]  # as ours
    if args.host_capacity_tokens:
        argv += ["--host-capacity-tokens", str(args.host_capacity_tokens)]
    if args.host_copy_tokens_per_s is not None:
        if args.engine != "emulated":  # the torch worker's copies take what they take
            raise ValueError("--host-copy-tokens-per-s models the emulated engine's copies")
        argv += ["--host-copy-tokens-per-s", str(args.host_copy_tokens_per_s)]
    return [*argv, *args.worker_arg]


async def run_cluster(args: argparse.Namespace, config: GatewayConfig) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    if args.engine in REAL_ENGINES:
        if args.host_capacity_tokens or args.host_copy_tokens_per_s is not None:
            raise ValueError("--host-capacity-tokens applies to our workers (emulated, torch)")
        await run_real_cluster(args, config, stop)
        return
    argv = worker_argv(args, config)
    workers = [Child(f"worker {i}", argv, "ready: ", console=True) for i in range(args.workers)]
    try:
        results = await asyncio.gather(
            *(asyncio.to_thread(w.wait_announced, READY_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"{len(failed)} worker(s) did not start: {failed[0]}")
        config.workers.extend(WorkerConfig(url=w.url) for w in workers)
        await serve_gateway(config, stop)
    finally:
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in workers))


def cluster_main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    config = apply_flags(load_config(args.config), args)
    configure_logging(config.log_level, config.log_format)
    try:
        run_async(run_cluster(args, config))
    except (RuntimeError, ValueError) as exc:
        print(f"urc cluster: {exc}", file=sys.stderr)
        return 1
    return 0
