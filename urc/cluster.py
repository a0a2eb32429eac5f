"""`urc cluster` (docs/cli.md): the gateway in this process, N workers as child processes on
127.0.0.1 (real engines: backends/real/process.py); SIGINT/SIGTERM stop the gateway, then those."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from core.logs import configure_logging
from core.ports import check_listen
from router.gateway.config import ConfigError, GatewayConfig, ModelConfig, WorkerConfig, load_config
from router.gateway.config_flags import add_gateway_arguments, apply_flags
from router.gateway.serve import run_async, serve_gateway
from urc.cli import ENGINES
from urc.processes import Child

REAL_ENGINES = ("vllm", "sglang")  # backends/real/process.py, imported only when asked for
READY_TIMEOUT_S = 120.0


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster's own flags first, then the real engines', then every gateway flag."""
    cluster = parser.add_argument_group("cluster", "the workers started on 127.0.0.1")
    cluster.add_argument(
        "--workers", type=int, default=4, metavar="N", help="number of workers (default 4)"
    )
    cluster.add_argument(
        "--engine",
        choices=sorted([*ENGINES, *REAL_ENGINES]),
        default="emulated",
        help="the workers' engine: ours, emulated (default) or torch; or vllm or sglang, real "
        "engines started with --model",
    )
    cluster.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument passed to every worker, e.g. --worker-arg=--capacity-tokens=200000",
    )
    cluster.add_argument(
        "--host-capacity-tokens",
        type=int,
        default=0,
        metavar="N",
        help="each worker's host-memory KV tier in tokens (0: none; docs/tiers.md)",
    )
    cluster.add_argument(
        "--host-copy-tokens-per-s",
        type=float,
        default=None,
        metavar="R",
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
        await _serve(config, stop)
    finally:
        await asyncio.to_thread(stop_engines, engines)


async def _serve(config: GatewayConfig, stop: asyncio.Event) -> None:
    try:
        await serve_gateway(config, stop)
    except OSError as exc:  # at start: the port was taken after _check_ports, or not our host
        raise RuntimeError(f"cannot listen: {exc}") from exc


def _check_ports(config: GatewayConfig) -> None:
    """RuntimeError naming the address when the gateway could not listen now: before any worker
    starts (the gateway itself binds only once they are up)."""
    listens = [(config.host, config.port)]
    if config.metrics_port:
        listens.append((config.metrics_host or config.host, config.metrics_port))
    for host, port in listens:
        try:
            check_listen(host, port)
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def worker_argv(args: argparse.Namespace, config: GatewayConfig) -> list[str]:
    """The command line of each of our workers (ENGINES): `urc worker`, which stops itself when
    we die where the kernel would not tell it (core/lifeline.py)."""
    argv = [sys.executable, "-m", "urc.cli", "worker", "--engine", args.engine]
    # port 0: each worker binds a port of its own and announces it (no race for a free one)
    argv += ["--host", "127.0.0.1", "--port", "0"]
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
        await _serve(config, stop)
    finally:
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in workers))


def cluster_main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    config = apply_flags(load_config(args.config), args)
    if args.print_config:
        from router.gateway.config_print import config_toml

        print(config_toml(config), end="")
        return 0
    configure_logging(config.log_level, config.log_format)
    try:
        _check_ports(config)
        run_async(run_cluster(args, config))
    except (RuntimeError, ValueError) as exc:
        print(f"urc cluster: {exc}", file=sys.stderr)
        return 1
    return 0
