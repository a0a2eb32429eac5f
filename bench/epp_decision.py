"""The endpoint picker's decision per request, in process: `urc epp`'s whole pick (tenant,
parse, tokens, keys, index match, policy, ranked endpoints, the body with its cache_salt) of
an 8k-token prompt, against the gateway's routing alone (`Router.plan`) in the same run.

    python bench/epp_decision.py [--requests 2000] [--prompt-tokens 8192]

4 emulated workers; each prompt shares a 6k-token prefix of one of 8 groups, which the
workers hold (sent to them first, so the index has it from their KV events)."""

import argparse
import asyncio
import json
import statistics
import time
import urllib.request

from harness import fast_worker, percentile

from core.text import filler
from router.epp.picker import EndpointPicker
from router.gateway.app import Gateway
from router.gateway.config import GatewayConfig, WorkerConfig
from urc.processes import JSON_HEADERS

GROUPS = 8


def prompts(n: int, tokens: int) -> list[bytes]:
    shared = tokens * 3 // 4
    heads = [filler(shared, f"epp/{g}") for g in range(GROUPS)]
    return [
        json.dumps(
            {
                "model": "emulated",
                "prompt": heads[i % GROUPS] + filler(tokens - shared, f"epp/q/{i}"),
                "max_tokens": 1,
            }
        ).encode()
        for i in range(n)
    ]


def warm(urls: list[str], bodies: list[bytes]) -> None:
    """Each group's prefix onto one worker (so the index holds real matches)."""
    for g in range(GROUPS):
        url = urls[g % len(urls)] + "/v1/completions"
        req = urllib.request.Request(url, data=bodies[g], headers=JSON_HEADERS)
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


def micros(values: list[float]) -> str:
    p50, p99 = percentile(values, 0.5) * 1e6, percentile(values, 0.99) * 1e6
    return f"p50 {p50:7.1f} us   p99 {p99:7.1f} us   mean {statistics.fmean(values) * 1e6:7.1f} us"


async def measure(urls: list[str], bodies: list[bytes]) -> tuple[list[float], list[float]]:
    config = GatewayConfig(workers=[WorkerConfig(url) for url in urls], parity_interval_s=0)
    gateway = Gateway(config)
    await gateway._start(gateway.app)
    try:
        deadline = time.monotonic() + 10
        while gateway.index.stats().blocks < GROUPS and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the warm-up's KV events
        picker = EndpointPicker(gateway)
        headers: dict[str, str] = {}
        picks, plans = [], []
        for raw in bodies:  # alternated: the same noise for both
            t0 = time.perf_counter()
            pick = picker.pick("POST", "/v1/completions", headers, raw)
            picks.append(time.perf_counter() - t0)
            pick.load.finish()
            body = json.loads(raw)
            t0 = time.perf_counter()
            gateway.router.plan(body, False, None)
            plans.append(time.perf_counter() - t0)
        return picks, plans
    finally:
        await gateway._stop(gateway.app)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    args = parser.parse_args()
    workers = [fast_worker("--model", "emulated") for _ in range(4)]
    try:
        urls = [w.url for w in workers]
        bodies = prompts(args.requests, args.prompt_tokens)
        warm(urls, bodies)
        picks, plans = asyncio.run(measure(urls, bodies))
    finally:
        for w in workers:
            w.stop()
    print(f"decision per request, {args.prompt_tokens}-token prompts, {args.requests} requests")
    print(f"  urc epp pick          {micros(picks)}")
    print(f"  gateway Router.plan   {micros(plans)}")
    ratio = statistics.median(picks) / statistics.median(plans)
    print(f"  pick / plan (p50)     {ratio:.2f}  (the rest: parse, ranking, the salted body)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
