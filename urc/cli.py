"""`urc`: one entry point for the gateway, workers, local clusters, replay, load (docs/cli.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# Subcommand -> (one-line help, the issue that brings it while it is not built yet).
SUBCOMMANDS: dict[str, tuple[str, int | None]] = {
    "gateway": ("the OpenAI-compatible cache-aware HTTP gateway", None),
    "worker": ("one worker process (--engine emulated|torch)", None),
    "cluster": ("gateway plus N local workers on this machine", None),
    "replay": ("the offline simulator: replay a trace through the policies", None),
    "bench": ("a load generator against any OpenAI-compatible endpoint", None),
    "keys": ("print the block keys of a prompt (debugging the index)", None),
}
# Subcommands whose arguments belong to another package: everything after the name is theirs.
DELEGATED = {
    "worker": "the worker's own --help lists its flags",
    "bench": "urc bench --help lists its flags",
    "replay": "urc replay --help lists its flags",
}


def _gateway(args: argparse.Namespace) -> int:
    from router.gateway.app import run_gateway
    from router.gateway.config import ConfigError, apply_flags, load_config

    try:
        config = apply_flags(load_config(args.config), args)
    except ConfigError as exc:
        print(f"urc gateway: {exc}", file=sys.stderr)
        return 2
    if not config.workers:
        print(
            "urc gateway: no workers: give --worker URL (repeatable) or a config file",
            file=sys.stderr,
        )
        return 2
    run_gateway(config, args.config)
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from urc.cluster import cluster_main

    return cluster_main(args)


def _delegate(command: str, argv: list[str]) -> int:
    """Worker and bench parse their own flags (their packages load only when asked for)."""
    if command == "bench":
        from loadgen.cli import main as bench_main

        return bench_main(argv)
    if command == "replay":
        from simulation.cli import main as replay_main

        return replay_main(argv)
    pre = argparse.ArgumentParser(prog="urc worker", add_help=False)
    pre.add_argument("--engine", default="emulated")
    known, rest = pre.parse_known_args(argv)
    engine = known.engine
    if engine == "emulated":
        from backends.emulated.server import main as worker_main

        return worker_main(rest)
    if engine == "torch":
        from backends.torch_worker.server import main as torch_main

        return torch_main(rest)
    print(
        f"urc worker: unknown engine {engine!r} (emulated, torch; vllm/sglang: issue 6)",
        file=sys.stderr,
    )
    return 2


def _keys(args: argparse.Namespace) -> int:
    from core.blocks import block_keys
    from core.tokenizer import load_tokenizer

    tokens = load_tokenizer(args.tokenizer).encode(args.text)
    for i, key in enumerate(block_keys(tokens, args.block_size, args.salt)):
        print(f"{i:5d}  {key:016x}")
    print(f"{len(tokens)} tokens, {len(tokens) // args.block_size} full blocks", file=sys.stderr)
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[..., int]]]:
    parser = argparse.ArgumentParser(
        prog="urc",
        description="urc (Unified Radix Cache): a cache-aware gateway for LLM fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Callable[..., int]] = {}
    for name, (help_text, issue) in SUBCOMMANDS.items():
        suffix = f" [not built yet: issue {issue}]" if issue is not None else ""
        sub.add_parser(name, help=help_text + suffix, description=help_text + suffix)
    from router.gateway.config import add_gateway_arguments
    from urc.cluster import add_cluster_arguments

    add_gateway_arguments(sub.choices["gateway"])
    handlers["gateway"] = _gateway
    add_cluster_arguments(sub.choices["cluster"])
    handlers["cluster"] = _cluster
    keys = sub.choices["keys"]
    keys.add_argument("text", help="the prompt text")
    keys.add_argument("--tokenizer", default="byte", help="'byte' or a model directory")
    keys.add_argument("--block-size", type=int, default=16)
    keys.add_argument("--salt", default=None, help="the tenant's cache salt (default: shared)")
    handlers["keys"] = _keys
    return parser, handlers


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handler = handlers.get(args.command)
    if handler is None:
        issue = SUBCOMMANDS[args.command][1]
        print(f"urc {args.command}: not built yet (issue {issue})", file=sys.stderr)
        return 2
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
