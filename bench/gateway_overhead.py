"""Gateway overhead: the latency urc adds over going straight to a worker, and its throughput.

    python bench/gateway_overhead.py [--sglang-router BIN] [--variants source,aiohttp,python]
                                     [--processes 2] [--envoy]
    python bench/gateway_overhead.py --no-sglang --variants access-log,otel,base --base HEAD~1


urc and sglang-router in front of the same emulated workers; method: docs/benchmarks.md."""

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from argparse import BooleanOptionalAction
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import overhead_load as load
from harness import fast_worker, log
from overhead_envoy import checkout_config, envoy_lines
from overhead_load import ratio

from core.ports import free_port
from urc.envoy import Envoy
from urc.envoy_epp import epp_envoy_config
from urc.processes import Child, start_gateway

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# sglang-router has fewer policies: the nearest one to ours, else cache_aware
SGLANG_POLICY = {"round_robin": "round_robin", "power_of_two": "power_of_two"}
# --variants: urc without one of its speed parts (docs/benchmarks.md)
GATEWAY_SOURCE = "router.gateway,router.kv_mirror,router.kv_outcomes,core.strict_json"
AIOHTTP_FRONT = (  # the routes are registered before the hot paths are emptied
    "import sys, router.gateway.app, router.gateway.connection as c; c.HOT_PATHS = {}; "
    "from urc.cli import main; sys.exit(main())"
)
SHIPPED = ({}, ("-m", "urc.cli"))  # (env, launch) of urc as installed
VARIANTS = {
    "source": ({"URC_PURE_PYTHON": GATEWAY_SOURCE}, SHIPPED[1]),
    "aiohttp": ({}, ("-c", AIOHTTP_FRONT)),
    "python": ({"URC_PURE_PYTHON": "1"}, SHIPPED[1]),
}
# --variants: urc with its logs and traces on (docs/operability.md), flow control on
# (docs/flow-control.md: unsaturated, its admission path alone), a rollout running
# (docs/rollouts.md: the policy against itself at 50 %, its arms and guardrails alone), or the
# code at --base
OPERABILITY = ("access-log", "otel", "flow", "rollout", "base")
Spec = tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]  # a urc's (env, launch, flags)


def launch_code(base: str | None = None, stderr_to: str | None = None) -> tuple[str, str]:
    """`-c` code that runs `urc` from the checkout `base` (else this one), its stderr (its log)
    appended to the file `stderr_to` (else as every child's, to this script)."""
    code = ["import os, sys"]
    if base is not None:
        code.append(f"sys.path.insert(0, {base!r})")
    if stderr_to is not None:
        code.append(f"os.dup2(os.open({stderr_to!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)")
    code += ["from urc.cli import main", "sys.exit(main())"]
    return ("-c", "; ".join(code))


def base_checkout(ref: str, directory: str) -> str:
    """The tree of the commit `ref`, as files in `directory` (git archive); with this
    checkout's compiled modules when `ref` has the same source for every one of them (else it
    runs from source: the comparison says so)."""
    Path(directory).mkdir()
    root = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(root), "archive", ref], capture_output=True)
    archive.check_returncode()
    subprocess.run(["tar", "-x", "-C", directory], input=archive.stdout, check=True)
    compiled = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["urc"]["compiled"]
    built = [p for p in root.glob("*/**/*.so") if ".venv" not in p.parts]
    sources = [*compiled, "core/_blockkeys.c"]
    same = all((root / m).read_bytes() == (Path(directory) / m).read_bytes() for m in sources)
    if same and built:
        for path in built:
            shutil.copy2(path, Path(directory) / path.relative_to(root))
    log(f"--base {ref}: " + ("compiled as here" if same and built else "runs from source"))
    return directory


def operability_variant(name: str, args: argparse.Namespace, scratch: str) -> Spec:
    """(env, launch, flags) of urc-NAME; the OTLP sink of `otel` starts here."""
    if name == "access-log":
        return {}, launch_code(stderr_to=f"{scratch}/access.log"), ("--access-log",)
    if name == "flow":
        return {}, SHIPPED[1], ("--flow-control",)
    if name == "rollout":  # never advances: the dwell outlasts the run
        steps = ("--rollout-steps", "50,100", "--rollout-dwell", "1e9")
        return {}, SHIPPED[1], ("--rollout-policy", args.policy, *steps)
    if name == "otel":
        sink = Child("otlp sink", [sys.executable, "bench/otlp_sink.py"], "sink: ")
        return {}, SHIPPED[1], ("--otel-endpoint", sink.wait_announced().url)
    if args.base is None:
        raise SystemExit("--variants base needs --base REF (e.g. the commit before a change)")
    if Path(args.base).is_dir():  # a checkout built in place (its compiled modules run)
        return {}, launch_code(base=str(Path(args.base).resolve())), ()
    return {}, launch_code(base=base_checkout(args.base, f"{scratch}/base")), ()


def sglang_command(spec: str | None) -> list[str] | None:
    """How to launch sglang-router: BIN's Python (from its shebang) with `-m
    sglang_router.launch_router`, BIN itself with `launch`, or this environment's copy."""
    module = ["-m", "sglang_router.launch_router"]
    if not spec:
        return [sys.executable, *module] if importlib.util.find_spec("sglang_router") else None
    if not Path(spec).exists():
        raise SystemExit(f"--sglang-router: {spec} does not exist")
    with open(spec, "rb") as f:
        first = f.readline(200)
    if first.startswith(b"#!") and b"python" in first:
        return [first[2:].decode().strip().split()[0], *module]
    return [spec, "launch"]


def _failed(failed: dict[str, int], gap: str) -> str:
    failed = {k: v for k, v in failed.items() if v}
    return f"{gap}failed {failed}" if failed else ""


def latency_table(rows: list[load.LatencyRow], routers: list[str], sgl: bool) -> list[str]:
    out = ["added latency = through router - direct, paired per request, in ms"]
    cols = f"{'row':<20} {'c':>3} {'pairs':>6} {'direct p50':>10} {'p99':>7}"
    for name in routers:
        cols += f" {name + ' +p50':>{len(name) + 6}} {'+p99':>7} {'+mean':>7}"
    urcs = [n for n in routers if n == "urc" or n.startswith("urc-p")] if sgl else []
    for name in urcs:
        label = f"{name}/sgl p50"
        cols += f" {label:>{len(label)}} {'p99':>6} {'mean':>6}"
    out.append(cols)
    for row in rows:
        line = f"{row.metric:<20} {row.concurrency:>3} {row.pairs:>6} "
        line += f"{row.direct_p50_ms:>10.2f} {row.direct_p99_ms:>7.2f}"
        stats = (row.added_p50_ms, row.added_p99_ms, row.added_mean_ms)
        for name in routers:
            p50, p99, mean = (f"{stat[name]:.2f}" for stat in stats)
            line += f" {p50:>{len(name) + 6}} {p99:>7} {mean:>7}"
        for name in urcs:
            p50, p99, mean = (ratio(stat[name], stat["sglang-router"]) for stat in stats)
            line += f" {p50:>{len(name) + 8}} {p99:>6} {mean:>6}"
        out.append(line + _failed(row.failed, "  "))
    return out


def throughput_lines(row: load.ThroughputRow, names: list[str], sgl: bool) -> list[str]:
    title = f"throughput, {row.metric}, concurrency {row.concurrency}: requests/s"
    out = ["", f"{title} (median of {len(row.rounds[names[0]])} rounds)"]
    line = "  ".join(f"{name} {row.rps[name]:.0f}" for name in names)
    line += f"   urc/direct {ratio(row.rps['urc'], row.rps['direct'])}"
    if sgl:
        for name in (n for n in names if n == "urc" or n.startswith("urc-p")):
            line += f"   {name}/sglang-router {ratio(row.rps[name], row.rps['sglang-router'])}"
    for name in (n for n in names if n.startswith("urc-")):  # --variants: what the part buys
        cpu = row.cpu_us_per_request
        line += f"   {name}/urc {ratio(row.rps[name], row.rps['urc'])}"
        line += f" (router CPU per request {ratio(cpu[name][name], cpu['urc']['urc'])})"
    out.append("  " + line + _failed(row.failed, "   "))
    out.append("  CPU per request in µs (cores busy on average) while each target ran:")
    for name in names:
        cpu = row.cpu_us_per_request[name]
        busy = row.busy_cores[name]
        parts = [f"{role} {cpu[role]:.0f} ({busy[role]:.2f})" for role in cpu]
        split = "/".join(f"{share * 100:.0f}" for share in row.worker_split[name])
        out.append(f"    {name:<14} " + ", ".join(parts) + f"; worker CPU split {split}%")
        if busy["loadgen"] >= 0.9:
            out.append(f"      ^ the load generator used ~a core: {name} may be bound by it")
        if busy["machine"] >= 0.95 * (os.cpu_count() or 1):
            out.append("      ^ every CPU was busy: compare CPU per request, not requests/s")
    return out


def report(result: load.Result, names: list[str], header: str) -> str:
    routers = names[1:]
    sgl = "sglang-router" in routers
    out = [header, "", *latency_table(result.latency, routers, sgl)]
    if "envoy-epp" in routers:
        out += envoy_lines(result, routers)
    for row in result.throughput:
        out += throughput_lines(row, names, sgl)
    streamed = [row for row in result.latency if row.metric.startswith("streamed")]
    if sgl and any(30 < row.added_p50_ms["sglang-router"] < 60 for row in streamed):
        note = "note: sglang-router's streamed rows add ~40 ms: on a kept-alive connection its "
        note += "first SSE chunk waits for the ACK of the headers (Nagle on its client socket vs "
        out += ["", note + "the client's delayed ACK), a TCP artifact rather than routing work."]
    legend = "ratios urc/sglang-router: <= 1 is as good or better for added latency, >= 1 for "
    out += ["", legend + "requests/s; 'n/a' when a side's added latency is <= 0 (within noise)."]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = load_parser(__doc__)
    add = parser.add_argument
    add("--sglang-router", metavar="BIN", help="sglang-router script (default: sglang_router here)")
    add("--sglang-policy", default=None, help="default: nearest to --policy")
    add("--no-sglang", action="store_true", help="measure urc only")
    add("--processes", type=int, default=1, help="also measure urc with --processes N (urc-pN)")
    add("--envoy", action="store_true", help="also Envoy round robin, and Envoy + urc epp")
    add(
        "--epp-classic",
        action="store_true",
        help="with --envoy: also urc epp in GIE's reference exchange (BUFFERED request body, "
        "the response's headers answered by the EPP)",
    )
    add("--requests", type=int, default=3000, help="requests per target per latency row")
    add("--duration", type=float, default=6.0, help="seconds per target for throughput")
    add("--rounds", type=int, default=3, help="throughput rounds (rotating order)")
    add("--concurrency", type=int, nargs="+", default=[1, 32])
    add("--throughput-concurrency", type=int, default=64)
    add("--stream-throughput", action=BooleanOptionalAction, default=True, help="streamed rps too")
    add("--json", metavar="OUT", help="write the table as JSON")
    return parser


def load_parser(doc: str) -> argparse.ArgumentParser:
    """A parser of the workers, urc's variants and the prompts (gateway_instructions.py's too),
    described by `doc`'s first line."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    add("--workers", type=int, default=2, help="emulated workers (K)")
    add("--policy", default="cache_aware", help="urc's routing policy")
    add(
        "--variants",
        default="",
        help="also measure, comma-separated: source, aiohttp, python (speed parts off); "
        "access-log, otel (to a local sink), flow (flow control on), rollout (a rollout "
        "running), base (the code at --base)",
    )
    add(
        "--base",
        metavar="REF",
        help="the git commit of --variants base, e.g. main, or a checkout's folder (built in "
        "place: its compiled modules run); with --envoy: of urc epp too",
    )
    add("--api", choices=["completions", "chat"], default="completions")
    add("--groups", type=int, default=8, help="shared-prefix groups")
    add("--prefix-tokens", type=int, default=1024, help="shared prefix per group")
    add("--prompts", type=int, default=512, help="distinct prompts")
    add("--max-tokens", type=int, default=8, help="output tokens per request")
    add("--decode-step-ms", type=float, default=0.01, help="the workers' modelled decode step")
    add("--seed", type=int, default=0)
    return parser


def start_fleet(
    args: argparse.Namespace, sglang: list[str] | None, probe: bytes, scratch: str
) -> tuple[list[load.Target], dict[str, list[int]]]:
    """Workers, then urc (and sglang-router) in front of them: the targets and pids by role.
    urc/processes.py stops every child at exit, whatever happens in between."""
    step = args.decode_step_ms
    fleet = [fast_worker("--model", load.MODEL, decode_step_ms=step) for _ in range(args.workers)]
    workers = [child.url for child in fleet]
    path = PATHS[args.api]
    targets = [load.Target("direct", workers, path, None)]

    def front(name: str, child: Child, timeout_s: float) -> None:
        child.wait_serving(path, probe, timeout_s)
        targets.append(load.Target(name, [child.url], path, child.pid))

    urcs = [(name, spec, 1) for name, spec in urc_specs(args, scratch)]
    if args.processes > 1:
        urcs.append((f"urc-p{args.processes}", (*SHIPPED, ()), args.processes))
    for name, (env, launch, flags), processes in urcs:
        extra = ("--host", "127.0.0.1", "--policy", args.policy, "--processes", str(processes))
        front(name, start_gateway(workers, *extra, *flags, env=env, launch=launch), 30)
    if sglang is not None:
        port = free_port()
        cmd = [*sglang, "--host", "127.0.0.1", "--port", str(port), "--policy", args.sglang_policy]
        cmd += ["--worker-urls", *workers, "--log-level", "warn"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        sgl = Child("sglang-router", cmd, None, url=f"http://127.0.0.1:{port}")
        front("sglang-router", sgl, 60)
    extra_pids = start_envoys(args, workers, scratch, front) if args.envoy else {}
    routers = {t.name: [t.pid] for t in targets if t.pid}
    routers.update(extra_pids)
    return targets, {"workers": [child.pid for child in fleet], **routers}


def start_envoys(
    args: argparse.Namespace,
    workers: list[str],
    scratch: str,
    front: Callable[[str, Child, float], None],
) -> dict[str, list[int]]:
    """The Inference Extension's wiring (docs/epp.md): Envoy round robin, then Envoy asking
    urc epp (and the base's epp, under the base's own Envoy config); the pickers' pids."""
    ports = [port_of(url) for url in workers]
    rr = Envoy(ports)
    rr.wait_healthy(len(ports))
    rr.child.url = rr.url
    front("envoy-rr", rr.child, 30)
    epps: list[tuple[str, tuple[str, ...], dict, str | None]] = [
        ("envoy-epp", SHIPPED[1], {}, None)
    ]
    if args.epp_classic:  # GIE's reference shape: two exchanges each way
        classic = {"body_mode": "BUFFERED", "response_headers": True}
        epps.append(("envoy-epp-classic", SHIPPED[1], classic, None))
    if args.base is not None:  # the picker of the code at --base, under its own config
        base = base_checkout(args.base, f"{scratch}/eb")
        epps.append(("envoy-epp-base", launch_code(base), {}, base))
    pids = {}
    for name, launch, shape, checkout in epps:
        argv = [sys.executable, *launch, "epp", "--grpc-port", "0"]
        argv += [a for url in workers for a in ("--worker", url)]
        epp = Child("urc epp", argv, "epp: ").wait_announced()
        kwargs = {"epp_port": port_of(epp.url), "workers": ports, **shape}
        if checkout is None:
            config = partial(epp_envoy_config, **kwargs)
        else:  # the exchange the base's picker speaks is the one its config sets up
            config = partial(checkout_config, checkout, kwargs)
        picked = Envoy([], config_for=config)
        picked.child.url = picked.url
        front(name, picked.child, 30)
        pids[name.replace("envoy", "picker")] = [epp.pid]  # its Envoy: `name`
    return pids


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def variants(args: argparse.Namespace) -> list[str]:
    known = [*VARIANTS, *OPERABILITY]
    names = [name for name in args.variants.split(",") if name]
    if unknown := set(names) - set(known):
        raise SystemExit(f"--variants: unknown {sorted(unknown)} (known: {', '.join(known)})")
    return names


def urc_specs(args: argparse.Namespace, scratch: str) -> list[tuple[str, Spec]]:
    """urc as shipped, then each of --variants, by name."""
    specs: list[tuple[str, Spec]] = [("urc", (*SHIPPED, ()))]
    for v in variants(args):
        spec = operability_variant(v, args, scratch) if v in OPERABILITY else (*VARIANTS[v], ())
        specs.append((f"urc-{v}", spec))
    return specs


def describe(args: argparse.Namespace, prompts: list[load.Prompt], sglang: bool) -> str:
    lengths = [p.tokens for p in prompts]
    routers = f"urc policy {args.policy}; " + (
        f"sglang-router policy {args.sglang_policy}" if sglang else "no sglang-router"
    )
    return (
        f"gateway overhead: {args.workers} emulated workers (prefill 1e9 tokens/s, decode step "
        f"{args.decode_step_ms} ms, max_tokens {args.max_tokens}); {PATHS[args.api]}; prompts "
        f"{min(lengths)}-{max(lengths)} tokens in {args.groups} prefix groups; {routers}\n"
        f"machine: {os.cpu_count()} CPUs shared by the load generator, the workers, the routers "
        "and anything else running (see the CPU lines)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.requests < 1 or args.duration <= 0 or args.rounds < 1:
        raise SystemExit("need --workers >= 1, --requests >= 1, --duration > 0, --rounds >= 1")
    variants(args)  # an unknown name stops here, before any process starts
    sglang = None if args.no_sglang else sglang_command(args.sglang_router)
    args.sglang_policy = args.sglang_policy or SGLANG_POLICY.get(args.policy, "cache_aware")
    prompts = load.build_prompts(args)
    header = describe(args, prompts, sglang is not None)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in background
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the children on `kill` too
    scratch = tempfile.TemporaryDirectory(prefix="urc-overhead-")
    try:
        targets, pids = start_fleet(args, sglang, prompts[0].bodies[0], scratch.name)
        log(header.splitlines()[0])
        result = asyncio.run(load.measure(args, targets, prompts, pids))
        access_log = Path(scratch.name, "access.log")
        if access_log.exists():  # a line per request it served, else it measured something else
            with access_log.open("rb") as f:
                log(f"urc-access-log wrote {sum(1 for _ in f)} log lines")
    except KeyboardInterrupt:
        print("interrupted: stopping the processes", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"gateway_overhead: {exc}", file=sys.stderr)
        return 1
    finally:
        scratch.cleanup()
    print(report(result, [t.name for t in targets], header))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        out = {"config": {**config, "cpus": os.cpu_count()}, **asdict(result)}
        out = json.loads(json.dumps(out), parse_constant=lambda _: None)  # JSON has no NaN: null
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
