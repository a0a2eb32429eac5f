"""`urc bench` (docs/cli.md): a built-in workload or a trace against an OpenAI-compatible
endpoint. Exit status: 0 when a request succeeded, 1 when none did, 2 on bad arguments or trace."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp

from loadgen.client import base_url, list_models
from loadgen.mooncake import BLOCK_TOKENS, TraceFormatError, TraceRecord, read_trace, trace_requests
from loadgen.report import format_report, summarize, write_json
from loadgen.runner import BenchConfig, KeyRing, RunResult, run_bench
from loadgen.workloads import (
    WORKLOADS,
    RequestSpec,
    defaults,
    iter_requests,
    make_workload,
    parse_models,
    parse_params,
)

DEFAULT_REQUESTS = 100  # a workload is endless: without --duration, this many


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="urc bench",
        description="A load generator for any OpenAI-compatible endpoint.",
        allow_abbrev=False,  # `--request 5` is not `--requests 5`
    )
    p.add_argument("--target", help="the endpoint's base URL, e.g. http://127.0.0.1:8000")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--workload", default=None, help="a built-in workload (--list-workloads)")
    source.add_argument("--trace", default=None, help="a Mooncake-format JSONL trace")
    p.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload parameter, e.g. -p groups=5 -p prefix_tokens=1024",
    )
    p.add_argument("--list-workloads", action="store_true", help="list workloads and exit")
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, default=None, help="closed loop: C in flight")
    loop.add_argument("--rate", type=float, default=None, help="open loop: Poisson, R req/s")
    p.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    p.add_argument("--requests", type=int, default=None, help="send at most N requests")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="model name (repeat or comma-separate for several; default: GET /v1/models)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="[TENANT=]KEY",
        help="bearer key; repeat for tenants (in order of appearance) or name them TENANT=KEY",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the summary as JSON")
    p.add_argument("--json-requests", action="store_true", help="add every request to --json")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--max-output-tokens", type=int, default=512, help="trace: cap max_tokens")
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, help="trace: tokens/hash id")
    p.add_argument("--trace-kind", choices=("completion", "chat"), default="completion")
    p.add_argument("--skip-bad-lines", action="store_true", help="trace: skip invalid lines")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--grace", type=float, default=10.0, help="after --duration, for in-flight")
    p.add_argument("--max-in-flight", type=int, default=1024, help="open loop: cap and pool size")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress line on stderr (default: when stderr is a terminal)",
    )
    return p


def _print_workloads() -> None:
    for name, cls in WORKLOADS.items():
        print(f"{name}\n    {' '.join((cls.__doc__ or '').split())}")
        print("    " + "  ".join(f"{k}={v!r}" for k, v in defaults(cls).items()))


async def _run(args: argparse.Namespace, config: BenchConfig) -> tuple[RunResult, list[str]]:
    records: list[TraceRecord] = []
    if args.trace is not None:  # a bad trace fails before any request
        records, bad = read_trace(args.trace, skip_bad=args.skip_bad_lines)
        if bad:
            print(f"[urc bench] skipped {len(bad)} bad line(s) of {args.trace}", file=sys.stderr)
    models = parse_models(args.model)
    if not models:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            models = await list_models(http, base_url(args.target), config.api_keys.key_for(None))
        if not models:
            raise ValueError("the endpoint lists no models; pass --model")
        if args.workload not in ("multi-model", "mixed"):
            models = models[:1]
        print(f"[urc bench] models from /v1/models: {', '.join(models)}", file=sys.stderr)
    specs: Iterator[RequestSpec]
    if args.trace is not None:
        config.progress_total = min(len(records), args.requests or len(records))
        specs = trace_requests(
            records,
            models[0],
            args.trace_kind,
            args.block_tokens,
            args.time_scale,
            args.max_output_tokens,
            args.seed,
        )
    else:
        config.progress_total = config.max_requests
        specs = iter_requests(args.workload, args.seed, models, **parse_params(args.param))
    if args.workload == "multi-model" and len(models) < 2:
        print("[urc bench] note: multi-model with one model is system-prompts", file=sys.stderr)
    if args.workload == "two-tenants" and len(config.api_keys.plain) < 2:
        print("[urc bench] note: two-tenants wants two --api-key values", file=sys.stderr)
    interactive = threading.current_thread() is threading.main_thread()
    return await run_bench(specs, config, stop_on_sigint=interactive), models


def _fail(message: str) -> int:
    print(f"urc bench: {message}", file=sys.stderr)
    return 2


def _config(args: argparse.Namespace, replay: bool, max_requests: int | None) -> BenchConfig:
    return BenchConfig(
        target=args.target,
        concurrency=args.concurrency or 8,
        rate=args.rate,
        replay_arrivals=replay,
        duration_s=args.duration,
        max_requests=max_requests,
        api_keys=KeyRing(args.api_key),
        timeout_s=args.timeout,
        grace_s=args.grace,
        max_in_flight=args.max_in_flight,
        seed=args.seed,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_workloads:
        _print_workloads()
        return 0
    if not args.target:
        return _fail("--target is required")
    if args.trace is None and args.workload is None:
        args.workload = "system-prompts"
    if args.trace is not None and args.param:
        return _fail("--param applies to workloads, not traces")
    try:  # bad workload parameters fail before any request
        if args.trace is None:
            make_workload(args.workload, **parse_params(args.param))
    except ValueError as e:
        return _fail(str(e))
    max_requests = args.requests
    if args.trace is None and max_requests is None and args.duration is None:
        max_requests = DEFAULT_REQUESTS
    replay = args.trace is not None and args.concurrency is None and args.rate is None
    mode = "poisson" if args.rate is not None else "trace" if replay else "closed"
    config = _config(args, replay, max_requests)
    try:
        outcome, models = asyncio.run(_run(args, config))
    except (TraceFormatError, ValueError, OSError, aiohttp.ClientError) as e:
        return _fail(str(e))
    described: dict[str, Any] = {
        "target": args.target,
        "workload": args.workload if args.trace is None else None,
        "params": parse_params(args.param),
        "trace": args.trace,
        "mode": mode,
        "concurrency": config.concurrency if mode == "closed" else None,
        "rate": args.rate,
        "duration_s": args.duration,
        "requests": max_requests,
        "models": models,
        "seed": args.seed,
        "time_scale": args.time_scale if args.trace else None,
    }
    summary = summarize(
        outcome.results, outcome.wall_s, outcome.dropped, described, args.json_requests
    )
    print(format_report(summary))
    if args.json:
        write_json(summary, args.json)
    return 0 if summary["counts"]["ok"] > 0 else 1
