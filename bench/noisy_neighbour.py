"""Flow control's acceptance numbers on real processes (issue 31; docs/flow-control.md,
"Measured"): two emulated workers at their defaults and `urc gateway --config` with tenants,
each tenant's clients streaming the noisy-neighbour workload's requests.

    python bench/noisy_neighbour.py [--parts 1,2,3,4] [--phase-s 15] [--flood-clients 48]

1. Noisy neighbour: tenant quiet (2 clients) alone, then while tenant flood (48 clients,
   5k-token uncached prompts) floods; flow control off, on, on without the gateway's protect
   hint (--flow-protect-window 0), and on with the workers' --protect-step-ms 10 (twice the
   default step budget) and --protect-step-ms 0 (no step budget: full chunks beside the quiet
   tenant).
2. Priority: a critical tenant (priority 1) alone, then under a sheddable flood (priority -1).
3. Budget: a tenant sending twice its tokens_per_minute for a minute, a quiet one beside it.
4. The replay: part 1's flow-control run through `urc replay`'s engine (simulation.compare),
   each request at the live run's send time: the quiet tenant's p99 ratio offline and live.

Clients honour Retry-After on a 429. Prints numbers and ratios; asserts nothing."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import aiohttp
from harness import log, percentile

from core.tokenizer import ByteTokenizer
from loadgen.client import RequestResult, base_url, stream_request
from loadgen.workloads import RequestSpec, iter_requests
from router.admission import FlowSettings
from simulation.compare import compare
from simulation.flow import FlowConfig
from simulation.replay import FleetConfig
from simulation.workloads import workload_requests
from urc.processes import JSON_HEADERS, Child, start_gateway, start_worker

MODELS = ("emulated",)
QUIET, FLOOD = "quiet", "flood"  # the workload's two kinds of request (and part 1's tenants)
SHARE = {"quiet_share": 0.5}  # the workload's mix; each client takes the next of its kind
WORKERS = 2
WARM_S = 2.0  # the quiet tenant alone before a cluster's first phase: its prefix cached
RAMP_S = 3.0  # the flood alone before the quiet tenant joins it: the pool saturated
GRACE_S = 3.0  # after a phase, for its last answers; what is still in flight is then cancelled
GAP_S = 1.0  # part 4: the replay's idle time between two phases (live: their last answers)
TIMEOUT_S = 60.0  # per request
BUDGET_PROMPT = 1000  # part 3: tokens of each prompt (plus the chat template)
Tenants = dict[str, dict[str, int]]  # name -> its [[tenants]] keys


class Specs:
    """The noisy-neighbour workload's requests (seeded, as `urc replay` builds them), handed
    out per kind in the workload's order."""

    def __init__(self, seed: int, **params: int) -> None:
        self._stream = iter_requests("noisy-neighbour", seed, MODELS, **SHARE, **params)
        self._held: dict[str, deque[RequestSpec]] = {QUIET: deque(), FLOOD: deque()}

    def take(self, kind: str) -> RequestSpec:
        held = self._held[kind]
        while not held:
            spec = next(self._stream)
            self._held[spec.tenant or QUIET].append(spec)
        return held.popleft()


@dataclass(slots=True)
class Clients:
    """`n` closed-loop clients of `tenant` sending `kind` requests, or one open loop sending
    one every `every_s`; from `after_s` into the phase."""

    tenant: str
    kind: str
    n: int = 1
    every_s: float | None = None
    after_s: float = 0.0


@dataclass(slots=True)
class Phase:
    seconds: float
    results: list[RequestResult]  # `tenant`: the sender's; `index`: the workload's


class Run(NamedTuple):
    """A cluster's phases in turn: the quiet tenant warming up, alone, beside the flood."""

    warm: Phase
    alone: Phase
    flood: Phase


def key(tenant: str) -> str:
    return f"key-{tenant}"


async def send(
    http: aiohttp.ClientSession,
    url: str,
    spec: RequestSpec,
    start_s: float,
    out: list[RequestResult],
) -> RequestResult:
    result = RequestResult.for_spec(spec, start_s)
    out.append(result)
    assert spec.tenant is not None
    await stream_request(http, base_url(url), spec, result, key(spec.tenant), TIMEOUT_S)
    return result


async def client(
    http: aiohttp.ClientSession,
    url: str,
    specs: Specs,
    who: Clients,
    clock: tuple[float, float],
    out: list[RequestResult],
) -> None:
    """One client from `clock`'s start until its end (perf_counter); `who.every_s`: an open
    loop of its own requests."""
    t0, until = clock
    await asyncio.sleep(who.after_s)
    if who.every_s is None:
        while (now := time.perf_counter()) < until:
            spec = dataclasses.replace(specs.take(who.kind), tenant=who.tenant)
            result = await send(http, url, spec, now - t0, out)
            if result.status == 429:  # as OpenAI's clients do: wait as long as it says
                await asyncio.sleep(min(result.retry_after or 1, until - time.perf_counter()))
        return
    async with asyncio.TaskGroup() as group:  # cancelled: its requests are too
        due = time.perf_counter()
        while due < until:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            spec = dataclasses.replace(specs.take(who.kind), tenant=who.tenant)
            group.create_task(send(http, url, spec, due - t0, out))
            due += who.every_s


async def run_phase(url: str, specs: Specs, who: Sequence[Clients], seconds: float) -> Phase:
    """Every client for `seconds`, then GRACE_S for their last answers."""
    out: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        clock = (t0, t0 + seconds)
        tasks = [
            asyncio.create_task(client(http, url, specs, c, clock, out))
            for c in who
            for _ in range(c.n)
        ]
        _, late = await asyncio.wait(tasks, timeout=seconds + GRACE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    return Phase(seconds, out)


def config_text(tenants: Tenants, flow: bool) -> str:
    lines = ["[gateway]", f"flow_control = {'true' if flow else 'false'}"]
    for name, keys in tenants.items():
        lines += ["[[tenants]]", f'name = "{name}"', f'api_keys = ["{key(name)}"]']
        lines += [f"{k} = {v}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def wait_serving(gateway: Child, tenant: str, timeout_s: float = 30.0) -> None:
    """Until a request of `tenant` through the gateway answers 200 (it knows its workers)."""
    body = (
        b'{"model": "emulated", "messages": [{"role": "user", "content": "up?"}], "max_tokens": 1}'
    )
    headers = {**JSON_HEADERS, "Authorization": f"Bearer {key(tenant)}"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        req = urllib.request.Request(gateway.url + "/v1/chat/completions", body, headers)
        with suppress(OSError), urllib.request.urlopen(req, timeout=5) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise gateway.fail(f"did not serve within {timeout_s:.0f} s")


@contextmanager
def cluster(
    tenants: Tenants, flow: bool, worker_args: Sequence[str] = (), gateway_args: Sequence[str] = ()
) -> Iterator[str]:
    """WORKERS emulated workers (their defaults, then `worker_args`) and `urc gateway` with
    `tenants` over them (then `gateway_args`), fresh; yields the gateway's URL."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "urc.toml"
        path.write_text(config_text(tenants, flow))
        children = [start_worker(*worker_args) for _ in range(WORKERS)]
        try:
            urls = [w.url for w in children]
            gateway = start_gateway(urls, "--config", str(path), *gateway_args)
            children.append(gateway)
            wait_serving(gateway, next(iter(tenants)))
            yield gateway.url
        finally:
            for child in reversed(children):
                child.stop()


class Stats(NamedTuple):
    sent: int
    answered: int  # 200 in full
    completed: int  # of those, ended within the phase
    ttft_p50_ms: float  # of those answered 200 (within the grace too)
    ttft_p99_ms: float
    tpot_p50_ms: float  # time per output token after the first, of those
    refused: int  # 429s
    retry_after: int  # of those, with a Retry-After
    server_errors: int  # >= 500
    unfinished: int  # still in flight (or queued) at the end, cancelled
    other: int  # any other failure (timeouts, connections)
    tokens: int  # usage of the 200s: prompt + output
    reasons: Counter[str]  # 429s by their error code


def stats(phase: Phase, tenant: str) -> Stats:
    mine = [r for r in phase.results if r.tenant == tenant]
    ok = [r for r in mine if r.ok and r.ttft_s is not None and r.latency_s is not None]
    ttfts = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    tpots = [
        (r.latency_s - r.ttft_s) * 1e3 / (r.output_tokens - 1)
        for r in ok
        if r.latency_s is not None and r.ttft_s is not None and r.output_tokens > 1
    ]
    refused = [r for r in mine if r.status == 429]
    unfinished = sum(r.error == "cancelled" for r in mine)
    server = sum(r.status is not None and r.status >= 500 for r in mine)
    reasons = Counter(code(r.detail) for r in refused)
    return Stats(
        len(mine),
        len(ok),
        sum(r.start_s + (r.latency_s or 0.0) <= phase.seconds for r in ok),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        percentile(tpots, 0.5),
        len(refused),
        sum(r.retry_after is not None for r in refused),
        server,
        unfinished,
        len(mine) - len(ok) - len(refused) - unfinished - server,
        sum((r.prompt_tokens or 0) + r.output_tokens for r in ok),
        reasons,
    )


def code(body: str) -> str:
    found = re.search(r'"code":\s*"(\w+)"', body)
    return found.group(1) if found else "?"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"


def table(columns: Sequence[str], rows: Sequence[tuple[str, Sequence[object]]]) -> None:
    width = max(16, *(len(c) + 2 for c in columns))
    print(f"{'':44s}" + "".join(f"{c:>{width}s}" for c in columns))
    for label, cells in rows:
        text = [f"{c:,.0f}" if isinstance(c, float) else str(c) for c in cells]
        print(f"{label:44s}" + "".join(f"{c:>{width}s}" for c in text))
    print(flush=True)


def alone_then_flood(
    args: argparse.Namespace,
    tenants: Tenants,
    quiet: Clients,
    flood: Clients,
    flow: bool = True,
    worker_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
) -> Run:
    """On a fresh cluster: `quiet` alone for --phase-s; then `flood` for RAMP_S, and with
    `quiet` for --phase-s more."""
    specs = Specs(args.seed)
    late = dataclasses.replace(quiet, after_s=RAMP_S)
    with cluster(tenants, flow, worker_args, gateway_args) as url:
        warm = asyncio.run(run_phase(url, specs, [quiet], WARM_S))
        alone = asyncio.run(run_phase(url, specs, [quiet], args.phase_s))
        both = asyncio.run(run_phase(url, specs, [late, flood], RAMP_S + args.phase_s))
    return Run(warm, alone, both)


def noisy_column(alone: Phase, both: Phase) -> dict[str, object]:
    """One setting's cells: B is the quiet tenant, A the flood."""
    b0, b1, a = stats(alone, QUIET), stats(both, QUIET), stats(both, FLOOD)
    every = [b0, b1, a]
    return {
        "B TTFT p50 alone / flood (ms)": f"{b0.ttft_p50_ms:.0f} / {b1.ttft_p50_ms:.0f}",
        "B TTFT p99 alone / flood (ms)": f"{b0.ttft_p99_ms:.0f} / {b1.ttft_p99_ms:.0f}",
        "B answered (TTFT samples) alone / flood": f"{b0.answered} / {b1.answered}",
        "B time per output token p50 (ms)": f"{b0.tpot_p50_ms:.0f} / {b1.tpot_p50_ms:.0f}",
        "B completed alone / flood": f"{b0.completed} / {b1.completed}",
        "B p99 ratio flood/alone (target <= 3)": ratio(b1.ttft_p99_ms, b0.ttft_p99_ms),
        "B completed flood/alone (target >= 0.5)": ratio(b1.completed, b0.completed),
        "A completed (sent)": f"{a.completed} ({a.sent})",
        "A TTFT p50 / p99 (ms)": f"{a.ttft_p50_ms:.0f} / {a.ttft_p99_ms:.0f}",
        "A tokens served (k/s)": f"{a.tokens / both.seconds / 1e3:.1f}",
        "429s (with Retry-After)": f"{sum(s.refused for s in every)} "
        f"({sum(s.retry_after for s in every)})",
        ">= 500 (must be 0)": sum(s.server_errors for s in every),
        "other failures": sum(s.other for s in every),
        "A in flight or queued at the end": a.unfinished,
    }


def columns_table(columns: dict[str, dict[str, object]]) -> None:
    """One column per setting, one row per measure."""
    labels = list(next(iter(columns.values())))
    table(list(columns), [(label, [c[label] for c in columns.values()]) for label in labels])


NOISY: Tenants = {QUIET: {}, FLOOD: {}}
SETTINGS = {  # part 1's columns: flow control, the workers' and the gateway's flags
    "off": (False, (), ()),
    "on": (True, (), ()),
    "on, no protect hint": (True, (), ("--flow-protect-window", "0")),
    "on, step 10 ms": (True, ("--protect-step-ms", "10"), ()),
    "on, no step budget": (True, ("--protect-step-ms", "0"), ()),
}
PRIORITY: Tenants = {"critical": {"priority": 1}, "sheddable": {"priority": -1}}
BUDGET_S = 60.0  # part 3: one minute of the sliding window


def quiet_and_flood(args: argparse.Namespace, quiet: str, flood: str) -> tuple[Clients, Clients]:
    return Clients(quiet, QUIET, args.quiet_clients), Clients(flood, FLOOD, args.flood_clients)


def part_noisy(args: argparse.Namespace) -> Run:
    """Part 1; returns flow control's run (part 4 replays it)."""
    quiet, flood = quiet_and_flood(args, QUIET, FLOOD)
    runs = {}
    for name, (flow, worker_args, gateway_args) in SETTINGS.items():
        log(f"part 1: flow control {name} ...")
        runs[name] = alone_then_flood(args, NOISY, quiet, flood, flow, worker_args, gateway_args)
    print(
        f"1. noisy neighbour: B = {args.quiet_clients} quiet clients, alone {args.phase_s:g} s, "
        f"then while A = {args.flood_clients} flood clients (5k-token prompts) run"
    )
    columns_table({name: noisy_column(run.alone, run.flood) for name, run in runs.items()})
    return runs["on"]


def part_priority(args: argparse.Namespace) -> None:
    log("part 2: a critical tenant under a sheddable flood ...")
    _, alone, both = alone_then_flood(args, PRIORITY, *quiet_and_flood(args, *PRIORITY))
    c0, c1, s = stats(alone, "critical"), stats(both, "critical"), stats(both, "sheddable")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.reasons.items())) or "-"
    print(
        f"2. priority: critical (priority 1, {args.quiet_clients} clients) alone, then under "
        f"{args.flood_clients} sheddable clients (priority -1), flow control on"
    )
    rows: list[tuple[str, Sequence[object]]] = [
        ("critical TTFT p50 alone / flood (ms)", [f"{c0.ttft_p50_ms:.0f} / {c1.ttft_p50_ms:.0f}"]),
        ("critical TTFT p99 alone / flood (ms)", [f"{c0.ttft_p99_ms:.0f} / {c1.ttft_p99_ms:.0f}"]),
        ("critical p99 ratio (target <= 2)", [ratio(c1.ttft_p99_ms, c0.ttft_p99_ms)]),
        ("critical completed alone / flood", [f"{c0.completed} / {c1.completed}"]),
        ("critical 429s / >= 500", [f"{c0.refused + c1.refused} / {c1.server_errors}"]),
        ("sheddable sent / 200", [f"{s.sent} / {s.sent - s.refused - s.unfinished - s.other}"]),
        ("sheddable 429s (with Retry-After)", [f"{s.refused} ({s.retry_after})"]),
        ("sheddable 429s by reason", [reasons]),
        ("sheddable >= 500 / timeouts, other", [f"{s.server_errors} / {s.other}"]),
        ("sheddable in flight at the end", [s.unfinished]),
    ]
    table(["value"], rows)


def part_budget(args: argparse.Namespace) -> None:
    tpm = args.tpm
    log(f"part 3: a tenant at twice its tokens_per_minute = {tpm:,} for {BUDGET_S:g} s ...")
    specs = Specs(args.seed, flood_tokens=BUDGET_PROMPT)
    sample = Specs(args.seed, flood_tokens=BUDGET_PROMPT).take(FLOOD)
    assert sample.messages is not None
    per_request = len(ByteTokenizer().encode_chat(sample.messages)) + sample.max_tokens
    quiet = Clients(QUIET, QUIET, args.quiet_clients)
    budget = Clients("budget", FLOOD, every_s=60.0 * per_request / (2 * tpm))
    with cluster({QUIET: {}, "budget": {"tokens_per_minute": tpm}}, True) as url:
        asyncio.run(run_phase(url, specs, [quiet], WARM_S))
        alone = asyncio.run(run_phase(url, specs, [quiet], args.phase_s))
        both = asyncio.run(run_phase(url, specs, [quiet, budget], BUDGET_S))
    q0, q1, b = stats(alone, QUIET), stats(both, QUIET), stats(both, "budget")
    print(
        f"3. budget: tenant budget (tokens_per_minute = {tpm:,}) sends {per_request:,}-token "
        f"requests at twice that for {BUDGET_S:g} s; quiet ({args.quiet_clients} clients) beside"
    )
    rows: list[tuple[str, Sequence[object]]] = [
        ("budget: offered tokens (sent x per request)", [f"{b.sent * per_request:,}"]),
        ("budget: admitted tokens (usage of the 200s)", [f"{b.tokens:,}"]),
        ("budget: admitted / budget (target 0.9-1.1)", [ratio(b.tokens, tpm)]),
        (
            "budget: 200s / 429s (with Retry-After)",
            [f"{b.sent - b.refused} / {b.refused} ({b.retry_after})"],
        ),
        ("budget: >= 500 / other failures", [f"{b.server_errors} / {b.other}"]),
        ("quiet TTFT p50 alone / beside (ms)", [f"{q0.ttft_p50_ms:.0f} / {q1.ttft_p50_ms:.0f}"]),
        ("quiet TTFT p99 alone / beside (ms)", [f"{q0.ttft_p99_ms:.0f} / {q1.ttft_p99_ms:.0f}"]),
        ("quiet p99 ratio beside / alone", [ratio(q1.ttft_p99_ms, q0.ttft_p99_ms)]),
        (
            "quiet completed per s alone / beside",
            [f"{q0.completed / args.phase_s:.1f} / {q1.completed / BUDGET_S:.1f}"],
        ),
    ]
    table(["value"], rows)


class Replayed(NamedTuple):
    tenant: str | None
    phase: int  # of the Run: 0 warm, 1 alone, 2 flood
    ttft_ms: float  # nan: not answered


def replay_live(args: argparse.Namespace, live: Run, hop_s: float = 0.0) -> list[Replayed]:
    """The live run's requests through `urc replay`'s engine and admission, each at its live
    send time after its phase's start; a phase starts GAP_S after the one before ends.
    `hop_s`: the replay's `--hop-ms` (HTTP, gateway and event loops)."""
    sent: list[tuple[float, int, RequestResult]] = []
    start = 0.0
    for phase, p in enumerate(live):
        sent += [(start + r.start_s, phase, r) for r in p.results]
        start += p.seconds + GAP_S
    sent.sort(key=lambda one: one[0])
    n = max(r.index for _, _, r in sent) + 1
    built = workload_requests("noisy-neighbour", n, seed=args.seed, params=dict(SHARE))
    requests = [
        dataclasses.replace(built[r.index], index=i, arrival_s=t)
        for i, (t, _, r) in enumerate(sent)
    ]
    flow = FlowConfig(FlowSettings(enabled=True))
    run = compare(requests, ["cache_aware"], FleetConfig(workers=WORKERS, hop_s=hop_s), flow=flow)
    result = run.runs["cache_aware"].result
    return [
        Replayed(req.tenant, phase, result.ttft_s[i] * 1e3 if result.ok[i] else math.nan)
        for i, (req, (_, phase, _)) in enumerate(zip(requests, sent, strict=True))
    ]


def quiet_ttfts(replayed: Sequence[Replayed], phase: int) -> list[float]:
    return [r.ttft_ms for r in replayed if r.tenant == QUIET and r.phase == phase and r.ttft_ms > 0]


def part_replay(args: argparse.Namespace, live: Run) -> None:
    """The replay's hop (`--hop-ms`) is calibrated on the warm-up phase, which neither side of
    the comparison uses: the live TTFT p50 there less the replay's without a hop."""
    log("part 4: the live flow-control run through the replay ...")
    bare = percentile(quiet_ttfts(replay_live(args, live), 0), 0.5)
    hop_ms = max(0.0, stats(live.warm, QUIET).ttft_p50_ms - bare)
    replayed = replay_live(args, live, hop_ms / 1e3)
    off0, off1 = (quiet_ttfts(replayed, phase) for phase in (1, 2))
    on0, on1 = stats(live.alone, QUIET), stats(live.flood, QUIET)
    p = [percentile(v, q) for v in (off0, off1) for q in (0.5, 0.99)]
    live_ratio = on1.ttft_p99_ms / on0.ttft_p99_ms
    offline_ratio = p[3] / p[1]
    print(
        "4. the replay: part 1's flow-control run (every request at its live send time) "
        f"through simulation.compare, cache_aware, flow control on, --hop-ms {hop_ms:.1f} (the "
        "warm-up's live TTFT p50 less the replay's)"
    )
    rows: list[tuple[str, Sequence[object]]] = [
        (
            "B TTFT p50 alone / flood (ms)",
            [f"{on0.ttft_p50_ms:.0f} / {on1.ttft_p50_ms:.0f}", f"{p[0]:.0f} / {p[2]:.0f}"],
        ),
        (
            "B TTFT p99 alone / flood (ms)",
            [f"{on0.ttft_p99_ms:.0f} / {on1.ttft_p99_ms:.0f}", f"{p[1]:.0f} / {p[3]:.0f}"],
        ),
        ("B p99 ratio flood/alone", [f"{live_ratio:.2f}x", f"{offline_ratio:.2f}x"]),
        (
            "B answered alone / flood",
            [f"{on0.answered} / {on1.answered}", f"{len(off0)} / {len(off1)}"],
        ),
    ]
    table(["live", "replay"], rows)
    print(
        f"p99 ratio, replay / live: {offline_ratio / live_ratio:.2f} (target 0.8-1.2); "
        f"B's flood p99, replay / live: {p[3] / on1.ttft_p99_ms:.2f}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="1,2,3,4", help="which parts, comma-separated")
    parser.add_argument("--phase-s", type=float, default=15.0, help="seconds of each phase")
    parser.add_argument("--quiet-clients", type=int, default=2)
    parser.add_argument("--flood-clients", type=int, default=48)
    parser.add_argument("--tpm", type=int, default=60_000, help="part 3's tokens_per_minute")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",") if p.strip()}
    started = time.perf_counter()
    live = part_noisy(args) if 1 in parts else None
    if 2 in parts:
        part_priority(args)
    if 3 in parts:
        part_budget(args)
    if 4 in parts:
        if live is None:
            log("part 4: part 1's flow-control run first ...")
            live = alone_then_flood(args, NOISY, *quiet_and_flood(args, QUIET, FLOOD))
        part_replay(args, live)
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
