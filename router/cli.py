"""`urc`: one entry point for the gateway, workers, local clusters, replay and load (DESIGN §6)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# Subcommand -> (one-line help, the issue that brings it while it is not built yet).
SUBCOMMANDS: dict[str, tuple[str, int | None]] = {
    "gateway": ("the OpenAI-compatible cache-aware HTTP gateway", 3),
    "worker": ("one worker process (--engine torch|emulated)", 3),
    "cluster": ("gateway plus N local workers on this machine", 3),
    "replay": ("the offline simulator: replay a trace through the policies", 5),
    "bench": ("a load generator against any OpenAI-compatible endpoint", 3),
    "keys": ("print the block keys of a prompt (debugging the index)", None),
}


def _keys(args: argparse.Namespace) -> int:
    from router.blocks import block_keys
    from router.tokenizer import load_tokenizer

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
    keys = sub.choices["keys"]
    keys.add_argument("text", help="the prompt text")
    keys.add_argument("--tokenizer", default="byte", help="'byte' or a model directory")
    keys.add_argument("--block-size", type=int, default=16)
    keys.add_argument("--salt", default=None, help="the tenant's cache salt (default: shared)")
    handlers["keys"] = _keys
    return parser, handlers


def main(argv: Sequence[str] | None = None) -> int:
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
