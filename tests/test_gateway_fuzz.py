"""Fuzzing the gateway's front door: real worker and gateway processes on 127.0.0.1, raw sockets.

A seeded generator (deterministic: SEED) writes a few thousand requests over the request's
grammar (bodies, headers, framing) and a few slow ones (headers trickled past the header
timeout, bodies stalled past the body timeout). Every case must get an answer below 500; no
connection may close without one; the gateway must be healthy, serve both tenants and hold about
the memory it held after warm-up once the connections are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.procs import Proc, start_gateway, start_worker, wait_for

SEED = 20_250_611
ADMIN = "admin-secret"
TIMEOUT_S = 2.0  # the gateway's header and body timeouts
LIMITS = ("--header-timeout", "2", "--body-timeout", "2", "--max-header-bytes", "16384")
LIMITS += ("--max-request-line-bytes", "4096", "--max-body-bytes", "1048576")
KEYS = ("--admin-key", ADMIN, "--api-key", "acme:key-acme", "--api-key", "beta:key-beta")
FAST = ("--decode-base-ms", "1", "--decode-per-request-ms", "0", "--prefill-tps", "10000000")
FAST += ("--max-model-len", "8192", "--default-max-tokens", "4")
Part = tuple[float, bytes]  # seconds to wait, then bytes to send


@dataclass(slots=True)
class Case:
    desc: str
    parts: list[Part]
    expect: int = 1  # requests in it: answers wanted at most
    half_close: bool = False
    slow: bool = False  # unfinished on purpose: a 408 is the answer
    head: bool = False  # a HEAD request: its answer has no body


@dataclass(slots=True)
class Outcome:
    statuses: list[int]  # final ones (1xx left out)
    end: str  # done, eof, reset, timeout, garbled
    seconds: float


@dataclass(slots=True)
class Fleet:
    gateway: Proc
    port: int
    start_rss_kb: int


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# -- the grammar ------------------------------------------------------------------------------

VALUES = [
    "null", "true", "false", "0", "-1", "1.5", "-0", "1e999", "-1e999", "1E2", "0.1e-400",
    "2147483648", "4294967296", "9223372036854775807", "9223372036854775808",
    "-9223372036854775809", "1" + "0" * 40, '""', '"x"', '"NaN"', '"Infinity"', "NaN",
    "Infinity", "[]", "{}", '[1,"a",null]', '{"a":{"b":[]}}', '"\\ud800"', '"\\udfff\\ud800"',
    '"a\\ud83d"', '"\\u0000"', '"\udcff\udcfe"', '"' + "\u00e9" * 3000 + '"', "[" * 70 + "]" * 70,
]  # fmt: skip
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "n",
    "temperature", "top_p", "top_k", "seed", "stream_options", "user", "stop", "logprobs",
    "tools", "tool_choice", "response_format", "cache_salt", "urc_public_tokens", "ignore_eos",
    "logit_bias", "echo", "suffix", "best_of", "presence_penalty", "frequency_penalty",
]  # fmt: skip
ESCAPED = ['"urc\\u005fpublic_tokens"', '"cache\\u005fsalt"', '"\\u006dodel"', '"urc_x"']
ESCAPED += ['"URC_PUBLIC_TOKENS"', '"cache_salt"', '"\\ud800"', '""', '"\udcff"']
TOKENS = ["0", "1", "255", "256", "2147483647", "2147483648", "-1", "4294967296", "1.0"]
TOKENS += ["9223372036854775807", "9223372036854775808", "-9223372036854775809", "1e3"]
TOKENS += ["1" + "0" * 30, "true", "null", '"1"', "[]", "-0"]
MAX_TOKENS = ["0", "-1", "1", "4", "8192", "1000000000", "2147483648", "9223372036854775807"]
MAX_TOKENS += ["18446744073709551616", "1.0", "1e2", '"4"', "null", "true", "[4]"]
SURROGATE = ['"\\ud800"', '"x\\udc00y"', '"\\ud83d\\ude00"', '"\udcc3\udca8"']


def q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def nested(rng: random.Random) -> str:
    depth = rng.choice([10, 63, 64, 65, 100, 1000, rng.randint(10, 5000), 5000])
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def base_fields(rng: random.Random, chat: bool) -> list[tuple[str, str]]:
    words = " ".join(
        rng.choice(["hello", "fuzz", "cache", "token", "\u00e9t\u00e9"]) for _ in "xyz"
    )
    fields = [('"model"', '"emulated"')]
    if chat:
        fields.append(('"messages"', '[{"role":"user","content":' + q(words) + "}]"))
    elif rng.random() < 0.3:
        fields.append(('"prompt"', "[" + ",".join(str(rng.randint(0, 255)) for _ in "abcd") + "]"))
    else:
        fields.append(('"prompt"', q(words)))
    fields.append(('"max_tokens"', str(rng.randint(1, 4))))
    if rng.random() < 0.3:
        fields.append(('"stream"', rng.choice(["true", "false"])))
    return fields


def mutate(rng: random.Random, fields: list[tuple[str, str]], chat: bool) -> str:
    """Changes `fields` in place; what it did."""
    kind = rng.randrange(12)
    if kind == 0 and fields:
        del fields[rng.randrange(len(fields))]
        return "missing field"
    if kind == 1:
        key, value = q(rng.choice(FIELDS)), rng.choice(VALUES)
    elif kind == 2:
        key = '"prompt"'
        value = "[" + ",".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 6))) + "]"
    elif kind == 3:  # deep nesting somewhere
        deep, where = nested(rng), rng.randrange(4)
        if where == 0:
            key, value = q(f"extra{rng.randrange(9)}"), deep
        elif where == 1:
            key, value = '"messages"', '[{"role":"user","content":' + deep + "}]"
        elif where == 2:
            call = '{"id":"c1","type":"function","function":{"name":"f","arguments":' + deep
            key = '"messages"'
            value = '[{"role":"user","content":"hi"},{"role":"assistant","content":null,'
            value += '"tool_calls":[' + call + "}}]}]"
        else:
            key = '"tools"'
            value = '[{"type":"function","function":{"name":"f","parameters":' + deep + "}}]"
    elif kind == 4:
        key, value = rng.choice(ESCAPED), rng.choice(["5", '"salt"', "-1", "[]", "1e999"])
    elif kind == 5:
        key = rng.choice(['"prompt"', '"model"', '"user"', q(f"u{rng.randrange(9)}")])
        value = rng.choice(SURROGATE)
        if key == '"messages"' or (chat and rng.random() < 0.5):
            key, value = '"messages"', '[{"role":"user","content":' + value + "}]"
    elif kind == 6:
        size = rng.choice([10**3, 10**4, 10**5, 5 * 10**5])
        key = rng.choice(['"user"', '"prompt"', '"stop"', q("x" * rng.choice([8, 5000]))])
        value = q(rng.choice("ab\u00e9") * size)
    elif kind == 7 and fields:  # a duplicate key
        key, value = rng.choice(fields)[0], rng.choice(VALUES)
        fields.append((key, value))
        return f"duplicate {key}"
    elif kind == 8:
        key = rng.choice(['"stream"', '"stream_options"'])
        value = rng.choice(["true", "false", '"true"', "1", "null", "{}", "[]", '"x"'])
        value = rng.choice([value, '{"include_usage":' + rng.choice(VALUES[:12]) + "}"])
    elif kind == 9:
        key = rng.choice(['"max_tokens"', '"max_completion_tokens"', '"n"'])
        value = rng.choice(MAX_TOKENS + ["2", "-5"])
    elif kind == 10:
        key = rng.choice(['"temperature"', '"top_p"', '"top_k"', '"seed"'])
        value = rng.choice(["-1", "3", "2.0000001", "1e308", '"hot"', "NaN", "-0.0", "0"])
    else:
        key, value = q(f"unknown_{rng.randrange(10**6)}"), rng.choice(VALUES)
    fields[:] = [f for f in fields if f[0] != key]
    fields.insert(rng.randrange(len(fields) + 1), (key, value))
    return f"{key}={value[:40]}"


def fuzz_body(rng: random.Random, chat: bool) -> tuple[bytes, str]:
    fields = base_fields(rng, chat)
    what = [mutate(rng, fields, chat) for _ in range(rng.randint(1, 3))]
    text = "{" + ",".join(f"{k}:{v}" for k, v in fields) + "}"
    whole = rng.randrange(14)
    if whole == 0:
        text, what = text[: rng.randrange(len(text))], ["truncated"]
    elif whole == 1:
        text = rng.choice(
            ["", " ", "\r\n", "null", "1", '"s"', "[]", "[" + text + "]", "\ufeff" + text]
        )
        what = [f"top level {text[:20]!r}"]
    elif whole == 2:
        text = rng.choice([text + " xyz", text + text, text + "}", "{" + text, "not json"])
        what = ["trailing or non-JSON"]
    return text.encode("utf-8", "surrogateescape"), "; ".join(what)


def http(
    body: bytes = b"",
    path: str = "/v1/completions",
    method: str = "POST",
    headers: tuple[bytes, ...] = (),
    auth: bytes | None = b"Bearer key-acme",
    version: str = "HTTP/1.1",
    length: bool = True,
    ctype: bytes | None = b"application/json",
) -> bytes:
    lines = [f"{method} {path} {version}".encode(), b"Host: 127.0.0.1"]
    lines += [b"Authorization: " + auth] if auth is not None else []
    lines += [b"Content-Type: " + ctype] if ctype is not None else []
    lines += [b"Content-Length: %d" % len(body)] if length else []
    return b"\r\n".join([*lines, *headers]) + b"\r\n\r\n" + body


def valid(rng: random.Random) -> tuple[bytes, str]:
    chat = rng.random() < 0.5
    text = "{" + ",".join(f"{k}:{v}" for k, v in base_fields(rng, chat)) + "}"
    return text.encode(), "/v1/chat/completions" if chat else "/v1/completions"


AUTHS = [None, b"", b"Bearer", b"Bearer ", b"Basic a2V5", b"bearer key-beta", b"Bearer key-acme x"]
AUTHS += [b"Bearer key-\xff\xfe", b"Bearer \xe2\x82\xac", b"Bearer " + b"k" * 9000, b"\x00\x01"]
AUTHS += [b"Bearer\tkey-acme", b"Bearer  key-acme ", b"Bearer admin-secret", b"Bearer key-beta"]
PATHS = ["/", "/v1", "/v1/foo", "//v1/completions", "/v1/completions/", "/V1/COMPLETIONS"]
PATHS += ["/v1/completions?x=1&y=%zz", "/v1/chat/completions?stream=true#f", "/admin/../health"]
PATHS += ["/health?x", "/metrics", "/v1/models", "/%00", "/v1/%2e%2e/health", "*"]
PIPELINE_TAILS = [b"", b"GET /health HTTP/1.1\r\n\r\n", b"\x00garbage", b"POST /v1/completions"]
H2C = (b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAAQCAAAA")


def header_case(rng: random.Random) -> Case:
    body, path = valid(rng)
    kind = rng.randrange(11)
    head = False
    if kind == 0:
        auth = rng.choice(AUTHS)
        data, desc = http(body, path, auth=auth), f"auth {auth!r:.40}"
    elif kind == 1:
        extra = (b"Authorization: " + rng.choice(AUTHS[1:]),)
        data, desc = http(body, path, headers=extra), "duplicate Authorization"
    elif kind == 2:
        ctype = rng.choice([None, b"text/plain", b"multipart/form-data; boundary=x", b"\xff/\xfe"])
        data, desc = http(body, path, ctype=ctype), f"content type {ctype!r}"
    elif kind == 3:
        data, desc = http(body, path, headers=(b"Expect: 100-continue",)), "expect 100-continue"
    elif kind == 4:
        target = rng.choice([path, "/health", "/v1/models"])
        method = "POST" if target == path else "GET"
        data = http(body if method == "POST" else b"", target, method, H2C)
        desc = f"h2c upgrade {method} {target}"
    elif kind == 5:
        size = rng.choice([17000, 40000, 16000])
        data, desc = http(body, path, headers=(b"X-Big: " + b"b" * size,)), f"header of {size}"
    elif kind == 6:
        n = rng.choice([100, 300, 1000])
        extra = tuple(b"X-H%d: %d" % (i, i) for i in range(n))
        data, desc = http(body, path, headers=extra), f"{n} headers"
    elif kind == 7:
        target = rng.choice(PATHS + [path + "?" + "q" * rng.choice([3000, 4100, 9000])])
        method = rng.choice(["GET", "POST"])
        data, desc = http(body, target, method), f"{method} {target[:60]}"
    elif kind == 8:
        method = rng.choice(["GET", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD", "FOO", "post"])
        head = method == "HEAD"
        data, desc = http(body, path, method), f"{method} {path}"
    elif kind == 9:
        version = rng.choice(["HTTP/1.0", "HTTP/1.0", "HTTP/1.2", "HTTP/2.0", "HTTP/0.9", "HTTP/x"])
        alive = (b"Connection: keep-alive",) if rng.random() < 0.5 else ()
        data, desc = http(body, path, version=version, headers=alive), f"{version} {alive}"
    else:
        target = rng.choice(["/admin/workers", "/admin/mode", "/admin/tenants", "/admin/route"])
        target = rng.choice([target, "/admin/invalidate", "/admin/workers/w0", "/admin/nope"])
        key = rng.choice([b"Bearer admin", b"Bearer admin-secret\xff", b"Bearer \xc3\xa9", None])
        if target in ("/admin/route", "/admin/workers", "/admin/tenants", "/admin/mode"):
            key = rng.choice([key, b"Bearer admin-secret"])  # harmless with the right key
        safe_post = target == "/admin/route" or key != b"Bearer admin-secret"
        method = rng.choice(["GET", "POST", "DELETE"]) if safe_post else "GET"
        fuzzed = fuzz_body(rng, rng.random() < 0.5)[0] if method != "GET" else b""
        data, desc = http(fuzzed, target, method, auth=key), f"admin {method} {target} {key!r}"
    return Case("header: " + desc, [(0.0, data)], head=head)


def framing_case(rng: random.Random) -> Case:
    body, path = valid(rng)
    kind = rng.randrange(10)
    if kind == 0:  # a body longer than its Content-Length: the rest is a request of its own
        cut = rng.randrange(1, len(body))
        data = http(body, path).replace(
            b"Content-Length: %d" % len(body), b"Content-Length: %d" % cut
        )
        return Case(f"framing: Content-Length {cut} of {len(body)}", [(0.0, data)], expect=2)
    if kind in (1, 2):
        chunks, pos = [], 0
        while pos < len(body):
            step = rng.randint(1, 40)
            ext = rng.choice([b"", b"", b";ext=1"])
            chunks.append(
                b"%x%s\r\n%s\r\n" % (len(body[pos : pos + step]), ext, body[pos : pos + step])
            )
            pos += step
        chunks.append(rng.choice([b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n"]))
        te = (b"Transfer-Encoding: chunked",)
        if kind == 2:  # broken
            bad = rng.choice(
                [b"zz\r\n", b"-5\r\n", b"ffffffffffffffffffff\r\n", b"5\r\nabcdefgh\r\n"]
            )
            chunks.insert(rng.randrange(len(chunks)), bad)
            te += (rng.choice([b"", b"Content-Length: 5"]),) if rng.random() < 0.5 else ()
        data = http(b"".join(chunks), path, headers=tuple(h for h in te if h), length=kind == 2)
        return Case(f"framing: chunked {'broken' if kind == 2 else 'valid'}", [(0.0, data)])
    if kind == 3:
        both = rng.choice(
            [b"Transfer-Encoding: chunked", b"Content-Length: 3", b"Content-Length: x"]
        )
        both = rng.choice([both, b"Content-Length: -1", b"Content-Length: 99999999999999999999"])
        return Case(f"framing: also {both!r}", [(0.0, http(body, path, headers=(both,)))])
    if kind == 4:
        n = rng.choice([2, 3, 5, 8, 12])
        reqs = [http(*valid(rng)) for _ in range(n)]
        if rng.random() < 0.3:
            reqs.append(http(b"", "/health", "GET"))
        return Case(f"framing: {len(reqs)} pipelined", [(0.0, b"".join(reqs))], expect=len(reqs))
    if kind == 5:
        data = http(body, path)
        return Case("framing: 1-byte pieces", [(0.001, data[i : i + 1]) for i in range(len(data))])
    if kind == 6:  # answered, then closed: what follows is not read
        data = http(body, path, headers=(b"Connection: close",)) + rng.choice(PIPELINE_TAILS)
        return Case("framing: Connection: close, then more", [(0.0, data)])
    if kind == 7:
        noise = bytes(rng.randrange(33, 256) for _ in range(1)) + rng.randbytes(rng.randint(0, 300))
        noise = rng.choice([noise, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + noise])
        return Case(f"framing: garbage {noise[:24]!r}", [(0.0, noise + b"\r\n\r\n")])
    if kind == 8:
        weird = [
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"GET /\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\n\r\n",
        ]
        weird += [b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: x\r\n\r\n", http(body, "http://h" + path)]
        weird += [
            http(body, path).replace(b"\r\n", b"\n"),
            http(body, path, headers=(b"X: a\r\n b",)),
        ]
        weird += [http(body, path, headers=(b"NoColon",)), http(body, path, headers=(b"X : y",))]
        weird += [http(body, path, headers=(b"X-Nul: a\x00b",)), http(b"{}", path, "GET")]
        data = rng.choice(weird)
        return Case(f"framing: odd message {data[:30]!r}", [(0.0, data)])
    size = rng.choice([1048577, 1048576, 2 * 2**20])  # over or at the body limit
    filler = b'{"model":"emulated","prompt":"' + b"y" * (size - 35) + b'"}'
    return Case(f"framing: body of {len(filler)}", [(0.0, http(filler[:size], path))])


def slow_cases(rng: random.Random) -> Iterator[Case]:
    for i in range(24):
        body, path = valid(rng)
        data = http(body, rng.choice([path, "/admin/route", "/health"]))
        head_end = data.index(b"\r\n\r\n") + 4
        if i % 3 == 0:  # headers trickled, slower than the header timeout
            pieces = [(0.4, data[j : j + 4]) for j in range(5, head_end, 4)][:25]
            yield Case("slow: headers trickled", [(0.0, data[:5]), *pieces], slow=True)
        elif i % 3 == 1:  # a body stalled half way (or Content-Length over the body sent)
            stall = head_end + max(1, (len(data) - head_end) // 2)
            yield Case("slow: body stalled", [(0.0, data[:stall]), (8.0, data[stall:])], slow=True)
        else:
            data = data[: data.index(b"\r\n") + 2] + b"X-Unfinished: 1"
            yield Case("slow: headers never end", [(0.0, data)], slow=True)


def cases(seed: int) -> list[Case]:
    rng = random.Random(seed)
    out = [Case(f"body: {d}", [(0.0, http(b, p))]) for b, d, p in bodies(rng, 1500)]
    out += [header_case(rng) for _ in range(700)]
    out += [framing_case(rng) for _ in range(800)]
    out += list(slow_cases(rng))
    rng.shuffle(out)
    return out


def bodies(rng: random.Random, n: int) -> Iterator[tuple[bytes, str, str]]:
    for _ in range(n):
        chat = rng.random() < 0.5
        body, desc = fuzz_body(rng, chat)
        yield body, desc, "/v1/chat/completions" if chat else "/v1/completions"


# -- the client -------------------------------------------------------------------------------


def take(buf: bytes, eof: bool, head: bool) -> tuple[int, bytes] | None:
    """The first whole response in `buf`: its status and what follows; None if not all in."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if buf and not b"HTTP/".startswith(buf[:5]):
            raise ValueError("not HTTP")
        return None
    lines = buf[:end].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    # HTTP/0.9 too: aiohttp answers a request line without a version so
    if version not in (b"HTTP/1.1", b"HTTP/1.0", b"HTTP/0.9") or not rest[:3].isdigit():
        raise ValueError("not HTTP")
    status, after = int(rest[:3]), buf[end + 4 :]
    fields = dict(line.lower().partition(b":")[::2] for line in lines[1:])
    if status < 200 or status in (204, 304) or head:
        return status, after
    if b"chunked" in fields.get(b"transfer-encoding", b""):
        pos = 0
        while (nl := after.find(b"\r\n", pos)) >= 0:
            size = int(after[pos:nl].split(b";")[0], 16)
            pos = nl + 2 + size + 2
            if size == 0:
                return (status, after[pos:]) if len(after) >= pos else None
        return None
    if b"content-length" in fields:
        size = int(fields[b"content-length"])
        return (status, after[size:]) if len(after) >= size else None
    return (status, b"") if eof else None


async def exchange(port: int, case: Case, timeout_s: float = 15.0) -> Outcome:
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            for pause, data in case.parts:
                if pause:
                    await asyncio.sleep(pause)
                writer.write(data)
                await writer.drain()
            if case.half_close:
                writer.write_eof()

    sender = asyncio.create_task(send())
    statuses: list[int] = []
    buf, end = b"", "timeout"
    try:
        while len(statuses) < case.expect:
            left = t0 + timeout_s - time.monotonic()
            try:
                data = await asyncio.wait_for(reader.read(1 << 16), max(left, 0.01))
            except TimeoutError:
                break
            except ConnectionError:
                end = "reset"
                break
            buf += data
            try:
                while (got := take(buf, not data, case.head)) is not None:
                    status, buf = got
                    statuses += [status] if status >= 200 else []
            except ValueError:
                end = "garbled"
                break
            if not data:
                end = "eof"
                break
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        writer.transport.abort()
    return Outcome(statuses, "done" if len(statuses) >= case.expect else end, time.monotonic() - t0)


def verdict(case: Case, out: Outcome) -> str:
    """What is wrong with the outcome ('' when nothing)."""
    if any(s >= 500 for s in out.statuses):
        return f"status {out.statuses}"
    if not out.statuses:
        return {"timeout": "hang: no answer in 15 s"}.get(out.end, f"dropped ({out.end})")
    if out.end in ("timeout", "garbled"):
        return f"{out.end} after {out.statuses}"
    if out.end != "done" and out.statuses[-1] < 400:  # closed with requests left unanswered
        return f"closed after {out.statuses} of {case.expect}"
    if case.slow and out.seconds > TIMEOUT_S + 4:
        return f"answered late: {out.seconds:.1f} s"
    return ""


async def run_all(port: int, batch: list[Case], width: int = 32) -> list[Outcome]:
    gate = asyncio.Semaphore(width)

    async def one(case: Case) -> Outcome:
        async with gate:
            try:
                return await exchange(port, case)
            except OSError as exc:  # could not connect
                return Outcome([], f"connect: {exc}", 0.0)

    return await asyncio.gather(*(one(c) for c in batch))


# -- the tests --------------------------------------------------------------------------------


def completion(url: str, key: str) -> httpx.Response:
    body = {"model": "emulated", "prompt": "warm up the gateway", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)


def up(url: str) -> bool:
    try:
        r = httpx.get(f"{url}/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"})
    except httpx.HTTPError:
        return False
    return sum(w["up"] and w["mode"] == "exact" for w in r.json()["workers"]) == 2


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    workers = [start_worker(*FAST) for _ in range(2)]
    gateway = None
    try:
        gateway = start_gateway([w.url for w in workers], *KEYS, *LIMITS)
        assert wait_for(lambda: up(gateway.url), 30), gateway.lines[-20:]
        for i in range(50):
            assert completion(gateway.url, ("key-acme", "key-beta")[i % 2]).status_code == 200
        time.sleep(1.0)
        port = int(gateway.url.rsplit(":", 1)[1])
        yield Fleet(gateway, port, rss_kb(gateway.popen.pid))
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def settled_rss(fleet: Fleet) -> int:
    """The gateway's RSS once it is back within 20 % of its start (or after 10 s)."""
    wait_for(lambda: rss_kb(fleet.gateway.popen.pid) <= 1.2 * fleet.start_rss_kb, 10, 0.25)
    return rss_kb(fleet.gateway.popen.pid)


def assert_healthy(fleet: Fleet) -> None:
    assert fleet.gateway.popen.poll() is None, fleet.gateway.lines[-30:]
    url = fleet.gateway.url
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    for key in ("key-acme", "key-beta"):
        response = completion(url, key)
        assert response.status_code == 200, response.text


def test_fuzzed_requests_get_answers_below_500(fleet: Fleet) -> None:
    batch = cases(SEED)
    t0 = time.monotonic()
    outcomes = asyncio.run(run_all(fleet.port, batch))
    took = time.monotonic() - t0
    histogram = Counter(s for o in outcomes for s in o.statuses)
    slow = Counter(s for c, o in zip(batch, outcomes, strict=True) if c.slow for s in o.statuses)
    failures = [(c, o, v) for c, o in zip(batch, outcomes, strict=True) if (v := verdict(c, o))]
    dropped = sum(not o.statuses and o.end != "timeout" for o in outcomes)
    rss = settled_rss(fleet)
    print(f"\nfuzz: {len(batch)} cases in {took:.1f} s; statuses {sorted(histogram.items())}")
    print(f"slow cases: {sorted(slow.items())}; dropped {dropped}; failures {len(failures)}")
    print(f"gateway RSS: start {fleet.start_rss_kb} kB, after {rss} kB")
    report = "\n".join(
        f"{v} <- {c.desc[:100]} | {b''.join(p for _, p in c.parts)[:200]!r}"
        for c, _, v in failures[:20]
    )
    assert not failures, f"{len(failures)} of {len(batch)} cases failed:\n{report}"
    assert sum(slow.values()) == sum(c.slow for c in batch) and set(slow) == {408}, slow
    assert_healthy(fleet)
    assert rss <= 1.2 * fleet.start_rss_kb, (fleet.start_rss_kb, rss)


def test_unfinished_large_bodies_are_reaped(fleet: Fleet) -> None:
    head = http(b"x" * 1_000_000).split(b"\r\n\r\n")[0] + b"\r\n\r\n"
    body = b'{"model":"emulated","prompt":"' + b"z" * 900_000
    batch = [Case("memory: unfinished 1 MB body", [(0.0, head), (0.0, body)], slow=True)] * 20
    peak = 0

    async def watch() -> list[Outcome]:
        nonlocal peak
        task = asyncio.ensure_future(run_all(fleet.port, batch))
        while not task.done():
            peak = max(peak, rss_kb(fleet.gateway.popen.pid))
            await asyncio.sleep(0.1)
        return await task

    outcomes = asyncio.run(watch())
    failures = [v for c, o in zip(batch, outcomes, strict=True) if (v := verdict(c, o))]
    assert not failures, failures
    assert {s for o in outcomes for s in o.statuses} == {408}
    rss = settled_rss(fleet)
    print(f"\nmemory: RSS start {fleet.start_rss_kb} kB, peak {peak} kB, after {rss} kB")
    assert_healthy(fleet)
    assert rss <= 1.2 * fleet.start_rss_kb, (fleet.start_rss_kb, peak, rss)


@pytest.mark.parametrize("pause_s", [0.0, 0.2])
def test_a_half_close_after_a_whole_request_is_answered(fleet: Fleet, pause_s: float) -> None:
    """shutdown(SHUT_WR) right after a whole request (`nc -N`, some HTTP/1.0 clients): the
    request was complete, so it is answered before the connection closes."""
    body, path = valid(random.Random(SEED))
    requests = [http(body, path), http(b"", "/health", "GET"), http(b"{", path)]
    batch = [
        c
        for r in requests
        for c in [Case(f"half-close {r[:30]!r}", [(0.0, r), (pause_s, b"")], half_close=True)] * 5
    ]
    outcomes = asyncio.run(run_all(fleet.port, batch))
    failures = [
        f"{c.desc}: {v}" for c, o in zip(batch, outcomes, strict=True) if (v := verdict(c, o))
    ]
    assert not failures, failures
    assert_healthy(fleet)
