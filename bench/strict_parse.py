"""What the strict parse costs: per request, and as a share of the gateway's CPU per request.

    python bench/strict_parse.py [--requests N] [--repeat N]

The parse before and after, timed here, against a live gateway's CPU (docs/benchmarks.md)."""

import argparse
import concurrent.futures as cf
import json
import timeit
import urllib.request
from typing import Any

import msgspec
from harness import cpu_seconds, fast_worker

from router.gateway.parsing import forwarded, parse_request, validate
from urc.processes import JSON_HEADERS, start_gateway

SALT = "urc-0123456789abcdef0123456789abcdef"
_decode = msgspec.json.Decoder().decode


def bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    text = "".join(f"word{i % 97} " for i in range(1400))[:8000]
    chat = [{"role": "system", "content": text[:2000]}]
    chat += [
        {"role": ("user", "assistant")[i % 2], "content": text[i * 700 : (i + 1) * 700]}
        for i in range(7)
    ]
    ids = [32 + i % 90 for i in range(8000)]
    return {
        "prompt 8k chars": ("/v1/completions", {"model": "emulated", "prompt": text}),
        "prompt 8k ids": ("/v1/completions", {"model": "emulated", "prompt": ids}),
        "chat 8 messages": ("/v1/chat/completions", {"model": "emulated", "messages": chat}),
    }


def before(raw: bytes, chat: bool) -> bytes:
    body = _decode(raw)
    validate(body, chat)
    start = raw.index(b"{") + 1
    return b'{"cache_salt":' + msgspec.json.encode(SALT) + b"," + raw[start:]


def after(raw: bytes, chat: bool) -> bytes:
    return forwarded(parse_request(raw, chat), SALT, 0)


def per_call_us(fn: Any, raw: bytes, chat: bool, repeat: int) -> float:
    return min(timeit.repeat(lambda: fn(raw, chat), number=repeat, repeat=5)) / repeat * 1e6


def gateway_cpu_us(path: str, raw: bytes, requests: int) -> float:
    """CPU microseconds per request of a live gateway serving `raw` (concurrency 8)."""
    workers = [fast_worker("--default-max-tokens", "8") for _ in range(2)]
    gateway = start_gateway([w.url for w in workers])
    try:
        gateway.wait_serving(path, raw, 30)

        def send(_: int) -> None:
            req = urllib.request.Request(gateway.url + path, data=raw, headers=JSON_HEADERS)
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()

        cpu0 = cpu_seconds(gateway.pid)
        with cf.ThreadPoolExecutor(8) as pool:
            list(pool.map(send, range(requests)))
        return (cpu_seconds(gateway.pid) - cpu0) / requests * 1e6
    finally:
        for child in (gateway, *workers):
            child.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="through the live gateway")
    parser.add_argument("--repeat", type=int, default=2000, help="calls per timing run")
    args = parser.parse_args()
    print(
        f"{'body':18} {'bytes':>7} {'before us':>10} {'after us':>9} {'added us':>9} "
        f"{'gateway CPU us/req':>19} {'added share':>12}"
    )
    for name, (path, body) in bodies().items():
        raw = json.dumps({**body, "max_tokens": 8}).encode()
        chat = path.endswith("chat/completions")
        old = per_call_us(before, raw, chat, args.repeat)
        new = per_call_us(after, raw, chat, args.repeat)
        cpu = gateway_cpu_us(path, raw, args.requests)
        print(
            f"{name:18} {len(raw):7d} {old:10.1f} {new:9.1f} {new - old:9.1f} {cpu:19.0f} "
            f"{(new - old) / cpu:12.1%}"
        )


if __name__ == "__main__":
    main()
