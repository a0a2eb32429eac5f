"""Instructions per request of urc's gateway variants: a count that resolves a few percent
where CPU time on a shared machine does not.

    python bench/gateway_instructions.py --variants rollout,flow,base --base . [--requests 200]

Each gateway of bench/gateway_overhead.py's variants runs under valgrind's callgrind, which
counts the user-space instructions its process executes (this machine's virtual CPU has no
hardware counters for `perf stat`); the same requests go through every gateway, one gateway at a
time, in rotating order; method: docs/benchmarks.md."""

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import overhead_load as load
from gateway_overhead import PATHS, load_parser, urc_specs
from harness import fast_worker, log, percentile
from overhead_load import ratio

from urc.processes import start_gateway

# work the gateway does by the clock (the workers' load sampled every 50 ms, health checks, the
# KV subscriber's look at its stop flag, the loop-lag timer, a rollout's evaluation): valgrind's
# ~50x slow-down would add 50x as much of it to each request, so it runs rarely here, and what
# is left (its idle rate, counted just before) is taken out of each block's count
SLOW_CLOCK = ("--load-interval", "1", "--health-interval", "5")
SLOW_TIMERS = (
    "import router.kv_subscriber as k, router.gateway.stalls as s, router.gateway.rollout as r",
    "k.POLL_MS = s.PERIOD_S = r.EVALUATE_EVERY_S = 5000",
)
URC_MAIN = "from urc.cli import main"
SETTLE_S = 0.3  # after a block: the workers' KV events for it reach the gateway in its window
IDLE_S = 1.0  # how long a gateway's idle work is counted before each block


@dataclass(slots=True)
class Counted:
    """A gateway under callgrind: its counters zeroed before a block, dumped after it."""

    target: load.Target
    out: str  # callgrind's output file; dump n is `out.n`
    dumps: int = 0
    idle_per_s: list[float] = field(default_factory=list)  # with no request, before each block
    per_request: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    with_idle: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})

    def control(self, option: str) -> None:
        command = ["callgrind_control", option, str(self.target.pid)]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def dumped(self) -> int:
        """Instructions since the last zero (the dump's `summary:` line)."""
        self.control("--dump")
        self.dumps += 1
        for line in Path(f"{self.out}.{self.dumps}").read_text().splitlines():
            if line.startswith("summary:"):
                return int(line.split()[1])
        raise RuntimeError(f"{self.out}.{self.dumps}: no summary line")


def slowed(launch: tuple[str, ...]) -> tuple[str, ...]:
    """`launch` (`-m urc.cli`, or a `-c` that ends by running it) with its timers slowed first
    (after the `-c`'s own path: a --base checkout's modules)."""
    code = launch[1] if launch[0] == "-c" else f"import sys; {URC_MAIN}; sys.exit(main())"
    if URC_MAIN not in code:
        raise SystemExit(f"gateway_instructions: cannot slow the timers of {launch}")
    return ("-c", code.replace(URC_MAIN, "; ".join((*SLOW_TIMERS, URC_MAIN))))


def start(args: argparse.Namespace, scratch: str, dumps: str) -> list[Counted]:
    """The workers, then every urc variant under callgrind (hash seed fixed: the same dicts)."""
    step = args.decode_step_ms
    fleet = [fast_worker("--model", load.MODEL, decode_step_ms=step) for _ in range(args.workers)]
    workers = [child.url for child in fleet]
    gateways = []
    for name, (env, launch, flags) in urc_specs(args, scratch):
        out = f"{dumps}/{name}.callgrind"
        wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}")
        extra = ("--host", "127.0.0.1", "--policy", args.policy, *SLOW_CLOCK, *flags)
        child = start_gateway(
            workers,
            *extra,
            env={**env, "PYTHONHASHSEED": "0"},
            launch=slowed(launch),
            wrapper=wrapper,
            timeout_s=900,
        )
        target = load.Target(name, [child.url], PATHS[args.api], child.pid)
        gateways.append(Counted(target, out))
        log(f"{name}: started under callgrind")
    return gateways


async def measure(args: argparse.Namespace, gateways: list[Counted]) -> None:
    """Per round and per kind (non-streamed, streamed): the round's block through each gateway
    in turn, its instructions per request."""
    prompts = load.build_prompts(args)
    targets = [g.target for g in gateways]
    by_name = {g.target.name: g for g in gateways}
    async with load.session_for(args.concurrency, len(targets)) as session:
        # warm: connections, first calls, and every prompt cached on the worker each gateway
        # picks, so that no block stores KV (whose events every gateway would ingest, counted
        # only in the window of the one that sent it)
        for g in gateways:
            for stream in (False, True):
                await load.lanes(session, g.target, prompts, args.concurrency, stream)
        await asyncio.sleep(1.0)
        for r in range(args.rounds):
            block = [prompts[(r * args.requests + i) % len(prompts)] for i in range(args.requests)]
            for stream in (False, True):
                for target in load.rotated(targets, r):
                    g = by_name[target.name]
                    g.control("--zero")  # its idle rate now, then the block
                    await asyncio.sleep(IDLE_S)
                    g.idle_per_s.append(g.dumped() / IDLE_S)
                    g.control("--zero")
                    began = time.perf_counter()
                    samples = await load.lanes(session, target, block, args.concurrency, stream)
                    await asyncio.sleep(SETTLE_S)
                    idle = g.idle_per_s[-1] * (time.perf_counter() - began)
                    counted = g.dumped()
                    if bad := sum(not s.ok for s in samples):
                        raise RuntimeError(f"{target.name}: {bad} of {len(samples)} failed")
                    g.per_request[stream].append((counted - idle) / len(samples))
                    g.with_idle[stream].append(counted / len(samples))
            log(f"  round {r + 1} of {args.rounds} done")


def report(args: argparse.Namespace, gateways: list[Counted]) -> str:
    base = gateways[0]
    out = [
        f"user-space instructions per request (callgrind), {args.workers} emulated workers, "
        f"{args.requests} requests a block at concurrency {args.concurrency}, {args.rounds} "
        f"rounds in rotating order; policy {args.policy}; median over rounds, and each round's "
        "ratio to urc"
    ]
    for stream in (False, True):
        out.append("streamed" if stream else "non-streamed")
        for g in gateways:
            counts = g.per_request[stream]
            line = f"  {g.target.name:<14} {percentile(counts, 0.5):>10.0f}"
            line += f"  idle {percentile(g.idle_per_s, 0.5):>9.0f}/s"
            if g is not base:
                rounds = [a / b for a, b in zip(counts, base.per_request[stream], strict=True)]
                line += f"  x urc {ratio(sum(counts), sum(base.per_request[stream]))}"
                line += f"  (rounds {min(rounds):.3f}-{max(rounds):.3f}"
                idle_in = ratio(sum(g.with_idle[stream]), sum(base.with_idle[stream]))
                line += f"; idle left in: {idle_in})"
            out.append(line)
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = load_parser(__doc__)
    add = parser.add_argument
    parser.set_defaults(prompts=64)  # every one cached before the rounds (see measure)
    add("--requests", type=int, default=200, help="requests per gateway, round and kind")
    add("--rounds", type=int, default=4, help="rounds (rotating order)")
    add("--concurrency", type=int, default=8, help="requests in flight")
    add(
        "--keep",
        metavar="DIR",
        help="keep callgrind's dumps in DIR (NAME.callgrind.N: odd N idle, even N a block, in "
        "order) for callgrind_annotate",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.concurrency < 1:
        raise SystemExit("need --requests, --rounds and --concurrency >= 1")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the children on `kill` too
    with tempfile.TemporaryDirectory(prefix="urc-instructions-") as scratch:
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
        try:
            gateways = start(args, scratch, args.keep or scratch)
            asyncio.run(measure(args, gateways))
        except KeyboardInterrupt:
            print("interrupted: stopping the processes", file=sys.stderr)
            return 130
        except RuntimeError as exc:
            print(f"gateway_instructions: {exc}", file=sys.stderr)
            return 1
    print(report(args, gateways))
    return 0


if __name__ == "__main__":
    sys.exit(main())
