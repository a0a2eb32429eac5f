"""The flags every worker takes: where it serves, its KV-event ports, request limits, logging."""

from __future__ import annotations

import argparse


def add_serving_arguments(parser: argparse.ArgumentParser, kv_port_note: str = "") -> None:
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    parser.add_argument(
        "--default-max-tokens", type=int, default=256, help="output length when a chat sets none"
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help=f"ZMQ PUB port for KV events (0: any){kv_port_note}",
    )
    parser.add_argument(
        "--kv-replay-port",
        type=int,
        default=0,
        help=f"ZMQ ROUTER port for replays (0: any){kv_port_note}",
    )
    parser.add_argument(
        "--max-body-mb", type=float, default=32.0, help="larger request bodies get 413"
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level")
