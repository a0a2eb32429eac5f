"""`urc`: one entry point for the gateway, workers, local clusters, replay, load (docs/cli.md)."""

from __future__ import annotations

import argparse
import importlib
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import lifeline
from core.logs import configure_logging

if TYPE_CHECKING:
    from router.gateway.config import GatewayConfig

SUBCOMMANDS: dict[str, str] = {  # subcommand -> its one-line help
    "gateway": "the OpenAI-compatible cache-aware HTTP gateway",
    "epp": "the gateway's routing as an Envoy ext_proc endpoint picker (Inference Extension)",
    "worker": "one worker process (--engine emulated|torch)",
    "cluster": "gateway plus N local workers on this machine",
    "replay": "the offline simulator: replay a trace through the policies",
    "bench": "a load generator against any OpenAI-compatible endpoint",
    "keys": "print the block keys of a prompt (debugging the index)",
}
DELEGATED = {"bench": "loadgen.cli", "replay": "simulation.cli"}  # main(argv) gets all the rest
ENGINES = {"emulated": "backends.emulated.server", "torch": "backends.torch_worker.server"}
DISTRIBUTION = "unified-radix-cache"  # pyproject.toml [project] name


def version() -> str:
    """The installed distribution's version; run from a checkout that is not installed, the
    pyproject.toml beside the packages; else "unknown"."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return "unknown"
    meta = project.get("project", {})
    return str(meta["version"]) if meta.get("name") == DISTRIBUTION else "unknown"


class _Version(argparse.Action):
    """`--version`, looked up only when asked: importlib.metadata costs ~0.1 s at each start."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"urc {version()}")
        parser.exit()


def _fleet_config(args: argparse.Namespace) -> GatewayConfig | None:
    """The config file and the flags merged; None when --print-config printed it instead."""
    from router.gateway.config import ConfigError, load_config
    from router.gateway.config_flags import apply_flags

    config = apply_flags(load_config(args.config), args)
    if args.print_config:
        from router.gateway.config_print import config_toml

        print(config_toml(config), end="")
        return None
    if not config.workers and not config.discover:
        raise ConfigError("no workers: give --worker URL (repeatable), --discover or a config file")
    configure_logging(config.log_level, config.log_format)  # --processes: each child inherits it
    return config


def _gateway(args: argparse.Namespace) -> int:
    from router.gateway.serve import run_gateway
    from router.gateway.supervisor import run_processes

    config = _fleet_config(args)
    if config is None:
        return 0
    if config.processes > 1:
        return run_processes(config, args.config)
    try:
        run_gateway(config, args.config)
    except OSError as exc:  # at start: the port is taken, or the host is not ours
        print(f"urc gateway: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _epp(args: argparse.Namespace) -> int:
    from router.epp.server import run_epp

    config = _fleet_config(args)
    if config is None:
        return 0
    if config.rollout.configured:  # it never sees an answer to judge a candidate by
        from router.gateway.config import ConfigError

        raise ConfigError("urc epp runs no rollout (docs/rollouts.md): split traffic by HTTPRoute")
    try:
        run_epp(config, args.grpc_port, args.max_in_flight)
    except OSError as exc:  # at start: the port is taken, or the host is not ours
        print(f"urc epp: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _delegate(command: str, argv: list[str]) -> int:
    """Run another package's `main`; `urc worker` picks its module by `--engine`."""
    if command == "worker":
        pre = argparse.ArgumentParser(prog="urc worker", add_help=False, allow_abbrev=False)
        pre.add_argument("--engine", default="emulated")
        known, argv = pre.parse_known_args(argv)
        if known.engine not in ENGINES:
            why = f"unknown engine {known.engine!r} (emulated, torch; vllm/sglang: issue 6)"
            print(f"urc worker: {why}", file=sys.stderr)
            return 2
        module = ENGINES[known.engine]
    else:
        module = DELEGATED[command]
    return importlib.import_module(module).main(argv)


def _keys(args: argparse.Namespace) -> int:
    from core.blocks import block_keys
    from core.tokenizer import load_tokenizer

    tokens = load_tokenizer(args.tokenizer).encode(args.text)
    for i, key in enumerate(block_keys(tokens, args.block_size, args.salt)):
        print(f"{i:5d}  {key:016x}")
    print(f"{len(tokens)} tokens, {len(tokens) // args.block_size} full blocks", file=sys.stderr)
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[..., int]]]:
    """The `urc` parser (no prefix abbreviations anywhere: `--capacity` is not
    `--capacity-tokens`) and each built subcommand's handler."""
    parser = argparse.ArgumentParser(
        prog="urc",
        description="urc (Unified Radix Cache): a cache-aware gateway for LLM fleets.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action=_Version, help="print urc's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        usage = "%(prog)s [OPTION ...]" if name in ("gateway", "epp", "cluster") else None
        sub.add_parser(name, help=help_text, description=help_text, usage=usage, allow_abbrev=False)
    from core.blocks import DEFAULT_BLOCK_SIZE
    from router.gateway.config_flags import add_gateway_arguments
    from urc.cluster import add_cluster_arguments, cluster_main

    epp = sub.choices["epp"].add_argument_group("endpoint picker")
    epp.add_argument("--grpc-port", type=int, default=9002, help="ext_proc and gRPC health port")
    epp.add_argument(
        "--max-in-flight",
        type=int,
        default=0,
        help="shed with 429 when every eligible endpoint has this many in flight (0: never)",
    )
    for name in ("gateway", "epp"):
        add_gateway_arguments(sub.choices[name])
    add_cluster_arguments(sub.choices["cluster"])
    keys = sub.choices["keys"]
    keys.add_argument("text", help="the prompt text")
    keys.add_argument("--tokenizer", default="byte", help="'byte' or a model directory")
    keys.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per block (default {DEFAULT_BLOCK_SIZE})",
    )
    keys.add_argument("--salt", default=None, help="the tenant's cache salt (default: shared)")
    handlers = {"gateway": _gateway, "epp": _epp, "cluster": cluster_main, "keys": _keys}
    return parser, handlers


def main(argv: Sequence[str] | None = None) -> int:
    lifeline.watch_parent()  # started by a urc process: do not outlive it
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and (argv[0] in DELEGATED or argv[0] == "worker"):
        return _delegate(argv[0], argv[1:])
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from router.gateway.config import ConfigError

    try:
        return handlers[args.command](args)
    except ConfigError as exc:  # a bad config file or flag: before anything starts
        print(f"urc {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
