"""A local scale-out fleet on 127.0.0.1 for tests and benchmarks (docs/scale-out.md): emulated
workers, gateway replicas (separate processes, or one gateway with --processes N) behind a real
Envoy, and a closed-loop client that keeps what routing did to each request."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from core.ports import free_port
from loadgen.workloads import RequestSpec
from urc.envoy import Envoy
from urc.processes import Child, start_gateway, start_worker

SALT_SECRET = "replicas-share-this-secret"


@dataclass(slots=True)
class Outcome:
    group: str
    stream: bool
    status: int  # 0: no HTTP answer (reset, refused)
    latency_s: float
    worker: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    complete: bool = False  # a whole answer: JSON with usage, or a stream to data: [DONE]


@dataclass(slots=True)
class Fleet:
    """Workers, gateways and Envoy, stopped together."""

    workers: list[Child]
    gateways: list[Child] = field(default_factory=list)
    envoy: Envoy | None = None
    gateway_ports: list[int] = field(default_factory=list)
    admin_key: str = "admin"

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for child in [*self.gateways, *self.workers]:
            child.stop()


def start_workers(n: int, *extra: str) -> list[Child]:
    return [
        start_worker("--kv-events-port", "0", "--kv-replay-port", "0", *extra) for _ in range(n)
    ]


def start_replica(fleet: Fleet, port: int, *extra: str) -> Child:
    urls = [w.url for w in fleet.workers]
    flags = ["--salt-secret", SALT_SECRET, "--admin-key", fleet.admin_key, *extra]
    child = start_gateway(urls, *flags, port=port)
    fleet.gateways.append(child)
    return child


def start_fleet(
    workers: int, replicas: int, processes: int = 1, spare: int = 0, worker_args: Sequence[str] = ()
) -> Fleet:
    """`replicas` gateways (each `processes` processes) behind Envoy, which also lists `spare`
    ports where replicas may start later."""
    fleet = Fleet(start_workers(workers, *worker_args))
    fleet.gateway_ports = [free_port() for _ in range(replicas + spare)]
    for port in fleet.gateway_ports[:replicas]:
        start_replica(fleet, port, "--processes", str(processes))
    fleet.envoy = Envoy(fleet.gateway_ports)
    fleet.envoy.wait_healthy(replicas)
    return fleet


def request_body(spec: RequestSpec, stream: bool) -> bytes:
    body: dict = {"model": spec.model, "max_tokens": spec.max_tokens, "stream": stream}
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


async def send(http: aiohttp.ClientSession, url: str, spec: RequestSpec, stream: bool) -> Outcome:
    """One request; what came back (never raises)."""
    path = "/v1/chat/completions" if spec.kind == "chat" else "/v1/completions"
    outcome = Outcome(spec.group_id or "", stream, 0, 0.0)
    start = time.perf_counter()
    try:
        async with http.post(url + path, data=request_body(spec, stream)) as resp:
            outcome.status = resp.status
            route = resp.headers.get("x-urc-route", "")
            outcome.worker = route.partition("worker=")[2].partition(";")[0]
            usage: dict = {}
            if stream:
                async for line in resp.content:
                    data = line.strip().removeprefix(b"data: ")
                    if data == b"[DONE]":
                        outcome.complete = True
                    elif data.startswith(b"{"):
                        usage = json.loads(data).get("usage") or usage
            else:
                usage = (await resp.json()).get("usage") or {}
                outcome.complete = resp.status == 200 and bool(usage)
            outcome.prompt_tokens = usage.get("prompt_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            outcome.cached_tokens = details.get("cached_tokens", 0)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        outcome.status = 0
    outcome.latency_s = time.perf_counter() - start
    return outcome


async def closed_loop(
    url: str,
    specs: Sequence[RequestSpec],
    concurrency: int,
    stream_every: int = 0,
    at: dict[int, Callable[[], object]] | None = None,
) -> list[Outcome]:
    """`specs` through `url`, `concurrency` in flight; every `stream_every`-th streamed (0:
    none); `at[i]` is called (in a thread) when request i is sent, e.g. to kill a replica."""
    outcomes: list[Outcome] = []
    queue = list(enumerate(specs))
    queue.reverse()
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def lane() -> None:
            while queue:
                i, spec = queue.pop()
                if at and i in at:
                    asyncio.get_running_loop().run_in_executor(None, at[i])
                stream = stream_every > 0 and i % stream_every == 0
                outcomes.append(await send(http, url, spec, stream))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return outcomes


def summary(outcomes: Sequence[Outcome]) -> dict:
    """Hit rate, affinity (the share of each group's requests on its busiest worker, weighted),
    the busiest worker's share, latency percentiles, failures."""
    ok = [o for o in outcomes if o.status == 200 and o.complete]
    failed = [o for o in outcomes if not (o.status == 200 and o.complete)]
    prompt = sum(o.prompt_tokens for o in ok)
    by_group: dict[str, Counter[str]] = {}
    for o in ok:
        by_group.setdefault(o.group, Counter())[o.worker] += 1
    affinity = sum(c.most_common(1)[0][1] for c in by_group.values()) / max(1, len(ok))
    per_worker = Counter(o.worker for o in ok)
    latencies = sorted(o.latency_s for o in ok)

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(f"{o.status}" for o in failed)),
        "failed_non_streamed": sum(1 for o in failed if not o.stream),
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "affinity": affinity,
        "busiest_share": max(per_worker.values()) / len(ok) if ok else 0.0,
        "per_worker": dict(sorted(per_worker.items())),
        "latency_p50_s": pct(0.5),
        "latency_p99_s": pct(0.99),
    }


async def admin_get(url: str, path: str, key: str) -> dict:
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {key}"}
        async with http.get(url + path, headers=headers) as resp:
            return await resp.json()
