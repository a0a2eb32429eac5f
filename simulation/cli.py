"""`urc replay`: a trace, a gateway recording (--shadow) or a built-in workload through the
gateway's policies against emulated workers, offline (docs/cli.md). Prints a table; --out DIR
gets report.md, report.json, series.json and PNG plots; --json FILE the report alone.
Exit status: 0 on success, 2 on bad arguments or an unreadable trace."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from backends.emulated.config import EngineConfig
from core.settings import add_setting_flags, from_flags, settings_of
from loadgen.mooncake import TraceFormatError
from loadgen.workloads import WORKLOADS, parse_models, parse_params
from router.admission import FlowSettings
from router.policies import POLICY_NAMES
from router.rollout_plan import RolloutPlan
from simulation.compare import compare, policy_names, split_params
from simulation.flow import FlowConfig, parse_tenant_flow
from simulation.replay import FleetConfig
from simulation.report import (
    build_report,
    format_table,
    table_rows,
    tenant_rows,
    write_json,
    write_out,
)
from simulation.requests import SimRequest
from simulation.rollout import add_rollout_arguments, plan_from_args, print_rollout, replay_rollout
from simulation.shadow import LIVE, fleet_names, replay_shadow, shadow_rows
from simulation.traces import Trace, read_trace, trace_requests
from simulation.workloads import DEFAULT_MODELS, workload_requests

DEFAULT_WORKLOAD_REQUESTS = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `replay` options, for a standalone parser or the `urc replay` subparser."""
    d = FleetConfig()
    add = p.add_argument
    add("trace", nargs="?", help="a Mooncake-format JSONL trace or a gateway recording")
    add("--workload", choices=sorted(WORKLOADS), help="a built-in workload instead")
    add(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload parameter, e.g. -p groups=5 (as urc bench)",
    )
    add("--model", action="append", default=[], help="workload model names")
    add("--rate", type=float, help="workload: open loop, Poisson at R requests/s")
    add("--concurrency", type=int, help="closed loop: C in flight (a workload without --rate: 8)")
    add("--requests", type=int, help="replay the first N requests")
    add("--seed", type=int, default=0, help="workload, arrivals and policy seed")
    add("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    add("--max-output-tokens", type=int, help="trace: cap each request's output")
    add(
        "--trace-kind",
        choices=("completion", "chat"),
        default="completion",
        help="trace: send the trace's requests as chats or completions",
    )
    add("--skip-bad-lines", action="store_true", help="trace: skip invalid lines")
    add = p.add_argument_group("fleet").add_argument
    add("--workers", type=int, default=8, help="emulated workers")
    add("--worker-names", help="comma-separated names (rendezvous hashes them)")
    add(
        "--policy",
        help="a policy, a comma-separated list, or 'all' (default: all; none with --shadow)",
    )
    add(
        "--shadow",
        action="append",
        default=[],
        choices=POLICY_NAMES,
        metavar="NAME",
        help="recording: follow its live decisions; NAME chooses beside them without acting "
        "(the gateway's --shadow-policy); repeatable",
    )
    add(
        "--policy-param",
        action="append",
        default=[],
        metavar="[POLICY:]KEY=VALUE",
        help="a policy parameter; without POLICY: every listed policy that has KEY",
    )
    add("--max-model-len", type=int, default=0, help="0: min(capacity, 131072)")
    add("--event-delay-ms", type=float, default=2.0, help="KV events reach the index after this")
    add(
        "--hop-ms",
        type=float,
        default=0.0,
        help="added to each request's TTFT and latency: a live request's HTTP, gateway and "
        "event loop time",
    )
    add(
        "--no-kv-events",
        action="store_true",
        help="workers publish no KV events: approximate residency from routing history",
    )
    add(
        "--pending-ttl",
        type=float,
        default=d.pending_ttl_s,
        metavar="S",
        help="a request's keys are held on its worker from dispatch until its KV events confirm "
        "them, or for S seconds, as `urc gateway --pending-ttl` does (0: off)",
    )
    add("--max-in-flight", type=int, default=1024, help="open loop cap")
    add(
        "--adapter-load-ms",
        type=float,
        default=d.adapter_load_s * 1e3,
        help="LoRA adapters: the gateway's load call before a worker has one (docs/adapters.md)",
    )
    add_flow_arguments(p)
    add_rollout_arguments(p)
    engine = p.add_argument_group(
        "emulated engine", "each worker's (a trace keys its prompts with its own block size)"
    )
    add_setting_flags(engine, EngineConfig)
    add = p.add_argument_group("output").add_argument
    add("--out", help="directory for report.md, report.json, series.json, PNGs")
    add("--json", help="write the report as JSON here")
    add(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr (default: when stderr is a terminal)",
    )


def add_flow_arguments(p: argparse.ArgumentParser) -> None:
    """Flow control's options, as the gateway's (docs/flow-control.md, "In the replay")."""
    d = FlowSettings()
    add = p.add_argument_group(
        "flow control", "the gateway's admission in virtual time (docs/flow-control.md)"
    ).add_argument
    add("--flow-control", action="store_true", help="queue while a pool is saturated, budgets")
    add(
        "--flow-saturation-ms",
        type=float,
        default=d.saturation_ms,
        metavar="MS",
        help="a pool is saturated when every worker has this many ms of prefill queued",
    )
    add(
        "--flow-queue-timeout",
        type=float,
        default=d.queue_timeout_s,
        metavar="S",
        help="seconds a request waits in the queue at most, then fails (429 queue_timeout)",
    )
    add("--flow-queue-max", type=int, default=d.queue_max, help="requests queued at most")
    add(
        "--flow-protect-window",
        type=float,
        default=d.protect_window_s,
        metavar="S",
        help="seconds a flow's rank sent to a worker stays protected there (x-urc-protect; 0: off)",
    )
    add(
        "--tenant-flow",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a tenant's [[tenants]] flow settings: weight, priority, requests_per_minute, "
        "tokens_per_minute, max_concurrent_requests; repeatable",
    )


def flow_from_args(args: argparse.Namespace) -> FlowConfig | None:
    """The flow-control settings (None: off); ValueError on a bad --tenant-flow or value."""
    if not args.flow_control:
        return None
    if args.flow_saturation_ms <= 0 or args.flow_queue_timeout <= 0 or args.flow_queue_max < 0:
        raise ValueError("--flow-saturation-ms and --flow-queue-timeout must be > 0")
    if args.flow_protect_window < 0:
        raise ValueError("--flow-protect-window must be >= 0")
    settings = FlowSettings(
        enabled=True,
        saturation_ms=args.flow_saturation_ms,
        queue_max=args.flow_queue_max,
        queue_timeout_s=args.flow_queue_timeout,
        protect_window_s=args.flow_protect_window,
    )
    return FlowConfig(settings, [parse_tenant_flow(text) for text in args.tenant_flow])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="urc replay",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
        description="The offline simulator: replay a trace through the gateway's policies "
        "against emulated workers in virtual time.",
    )
    add_arguments(parser)
    return parser


def load(
    args: argparse.Namespace,
) -> tuple[list[SimRequest], Trace | None, FleetConfig, dict[str, Any]]:
    """The requests, the trace (if any), the fleet, and the report's config so far."""
    trace = None
    if args.trace is not None:
        trace = read_trace(args.trace, skip_bad=args.skip_bad_lines)
        requests = trace_requests(
            trace,
            model=(args.model or list(DEFAULT_MODELS))[0],
            time_scale=args.time_scale,
            max_output_tokens=args.max_output_tokens,
            limit=args.requests,
            chat=args.trace_kind == "chat",
        )
        config = {
            "trace": Path(args.trace).name,
            "recorded": trace.recorded,
            "time_scale": args.time_scale,
            "max_output_tokens": args.max_output_tokens,
            "skipped_lines": len(trace.skipped),
        }
    else:
        models = parse_models(args.model)
        params = parse_params(args.param)
        requests = workload_requests(
            args.workload,
            args.requests or DEFAULT_WORKLOAD_REQUESTS,
            seed=args.seed,
            models=models or DEFAULT_MODELS,
            rate=args.rate,
            block_size=args.block_size,
            params=params,
        )
        config = {"workload": args.workload, "params": params, "models": models or None}
    fleet = fleet_from_args(args, args.block_size if trace is None else trace.block_size)
    if args.shadow and trace is not None:  # the simulated workers carry the recorded names
        fleet.names = fleet_names(trace, len(requests), fleet.names)
        fleet.workers = len(fleet.names)
    fleet.worker_names()  # ValueError on a bad fleet, before any run
    # one flat record: the engine's settings beside the fleet's
    fleet_config = {k: v for k, v in dataclasses.asdict(fleet).items() if k != "engine"}
    fleet_config.update(settings_of(fleet.engine))
    config.update(requests=len(requests), seed=args.seed, rate=args.rate, fleet=fleet_config)
    return requests, trace, fleet, config


def fleet_from_args(args: argparse.Namespace, block_size: int) -> FleetConfig:
    open_loop = args.trace is not None or args.rate is not None
    names = None
    if args.worker_names:
        names = [n.strip() for n in args.worker_names.split(",") if n.strip()]
    return FleetConfig(
        workers=args.workers,
        names=names,
        engine=from_flags(EngineConfig, args, block_size=block_size),
        max_model_len=args.max_model_len,
        event_delay_s=args.event_delay_ms / 1e3,
        hop_s=args.hop_ms / 1e3,
        kv_events=not args.no_kv_events,
        pending_ttl_s=args.pending_ttl,
        concurrency=None if open_loop else (args.concurrency or 8),
        max_in_flight=args.max_in_flight,
        adapter_load_s=args.adapter_load_ms / 1e3,
    )


class Progress:
    """`[urc replay] cache_aware  2048/3993  51%` on one stderr line per policy."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.name: str | None = None
        self.t0 = time.perf_counter()

    def __call__(self, name: str, sent: int) -> None:
        if name != self.name:
            self.end()
            self.name, self.t0 = name, time.perf_counter()
        sent = min(sent, self.total)
        pct = 100 * sent // max(self.total, 1)
        bar = "#" * (pct // 4)
        rate = sent / max(time.perf_counter() - self.t0, 1e-9)
        self.out.write(
            f"\r[urc replay] {name:16s} [{bar:25s}] {sent}/{self.total} {pct:3d}%  "
            f"{rate:,.0f} req/s "
        )
        self.out.flush()

    def end(self) -> None:
        if self.name is not None:
            self.out.write("\n")
            self.out.flush()
            self.name = None


def _fail(message: str) -> int:
    print(f"urc replay: {message}", file=sys.stderr)
    return 2


def _misuse(args: argparse.Namespace) -> str | None:
    """What is wrong with this combination of arguments, if anything."""
    if (args.trace is None) == (args.workload is None):
        return "give a TRACE or --workload NAME (one of them)"
    if args.trace is not None and (args.param or args.rate or args.concurrency):
        return "--param, --rate and --concurrency apply to workloads"
    if args.rate is not None and args.concurrency is not None:
        return "--rate (open loop) or --concurrency (closed loop), not both"
    if args.shadow and args.trace is None:
        return "--shadow replays a gateway recording (TRACE)"
    if args.tenant_flow and not args.flow_control:
        return "--tenant-flow needs --flow-control"
    return None


def run(args: argparse.Namespace) -> int:
    """`urc replay` with parsed arguments (the `urc` CLI calls this for its subparser)."""
    if misuse := _misuse(args):
        return _fail(misuse)
    try:
        spec = args.policy or ("" if args.shadow else "all")
        names = policy_names(spec) if spec else []
        requests, trace, fleet, config = load(args)
        given = split_params(args.policy_param, names)
        flow = flow_from_args(args)
        plan = plan_from_args(args)
    except (TraceFormatError, ValueError, OSError) as e:
        return _fail(str(e))
    if not requests:
        return _fail("no requests to replay")
    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = Progress(len(requests), sys.stderr) if show else None
    if plan is not None:
        return _rollout(args, requests, names, plan, fleet, given, progress)
    section = watched = None
    try:
        comparison = compare(
            requests, names, fleet, params=given, seed=args.seed, progress=progress, flow=flow
        )
        runs = comparison.runs
        if args.shadow and trace is not None:  # the followed live decisions: the first row
            live, section = replay_shadow(trace, requests, args.shadow, fleet, progress)
            runs = {LIVE: live, **runs}
    except ValueError as e:
        return _fail(str(e))
    finally:
        if progress is not None:
            progress.end()
    config.update(policies=names, policy_params=comparison.params)
    if flow is not None:
        config["flow"] = flow.describe()
    if section is not None:
        config["shadow"] = list(args.shadow)
    recorded = trace.recorded_summary() if trace is not None and trace.recorded else None
    summaries = {name: run.summary for name, run in runs.items()}
    report = build_report(config, summaries, comparison.bound, recorded, section)
    speeds = {name: run.speed for name, run in runs.items()}
    print(format_table(table_rows(report["policies"], report["bound"]["hit_rate"], speeds)))
    if tenants := tenant_rows(report["policies"]):
        print()
        print(format_table(tenants))
    if section is not None:
        watched = shadow_rows(section)
        print()
        print(format_table(watched))
    if args.json:
        write_json(report, args.json)
    if args.out:
        write_out(Path(args.out), report, runs, comparison.bound, watched)
    return 0


def _rollout(
    args: argparse.Namespace,
    requests: list[SimRequest],
    names: list[str],
    plan: RolloutPlan,
    fleet: FleetConfig,
    given: dict[str, dict[str, str]],
    progress: Progress | None,
) -> int:
    """--rollout-policy: the plan against the one --policy (docs/rollouts.md)."""
    if len(names) != 1 or args.shadow or args.flow_control:
        return _fail("--rollout-policy runs against one --policy, without --shadow or flow control")
    try:
        run, report = replay_rollout(
            requests, names[0], plan, fleet, given[names[0]], args.seed, progress
        )
    except ValueError as e:
        return _fail(str(e))
    finally:
        if progress is not None:
            progress.end()
    print_rollout(report, run, args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
