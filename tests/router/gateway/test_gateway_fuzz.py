"""Fuzzing the gateway's front door: real worker and gateway processes on 127.0.0.1, raw sockets.

A seeded generator (deterministic: SEED) writes a few thousand requests over the request's
grammar (bodies, headers, framing) and a few slow ones (headers trickled past the header
timeout, bodies stalled past the body timeout: 408). Every case must get an answer below 500
within 15 s; no connection may close without one; after the run the gateway must be healthy,
serve both tenants, and hold within 20 % of the memory it held after warm-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

SEED = 20_250_611
ADMIN = "admin-secret"
TIMEOUT_S = 2.0  # the gateway's header and body timeouts
LIMITS = ("--header-timeout", "2", "--body-timeout", "2", "--max-header-bytes", "16384")
LIMITS += ("--max-request-line-bytes", "4096", "--max-body-bytes", "1048576")
KEYS = ("--admin-key", ADMIN, "--api-key", "acme:key-acme", "--api-key", "beta:key-beta")
FAST = ("--decode-base-ms", "1", "--decode-per-request-ms", "0")
FAST += ("--prefill-tokens-per-s", "10000000")
FAST += ("--max-model-len", "8192", "--default-max-tokens", "4")  # no output runs long


@dataclass(slots=True)
class Case:
    desc: str
    parts: list[tuple[float, bytes]]  # (seconds to wait, then bytes to send)
    expect: int = 1  # requests in it: answers wanted at most
    half_close: bool = False  # shutdown(SHUT_WR) after the last part
    slow: bool = False  # unfinished on purpose: a 408 is the answer
    head: bool = False  # a HEAD request: its answer has no body
    lockstep: bool = False  # part i is sent once i answers are in (a kept-alive client)


@dataclass(slots=True)
class Outcome:
    statuses: list[int]  # final ones (1xx left out)
    end: str  # done, eof, reset, timeout, garbled
    seconds: float


@dataclass(slots=True)
class Fleet:
    gateway: Child
    port: int
    start_rss_kb: int


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# -- the grammar: bodies ----------------------------------------------------------------------

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
COUNTS = ["0", "-1", "1", "2", "4", "8192", "1000000000", "2147483648", "9223372036854775807"]
COUNTS += ["18446744073709551616", "1.0", "1e2", '"4"', "null", "true", "[4]", "-5"]
SURROGATE = ['"\\ud800"', '"x\\udc00y"', '"\\ud83d\\ude00"', '"\udcc3\udca8"']
STREAMS = ["true", "false", '"true"', "1", "null", "{}", "[]", '"x"']
OPTIONS = ["{}", "[]", '"x"', "null", '{"include_usage":true}', '{"include_usage":"yes"}']
SAMPLING = ["-1", "3", "2.0000001", "1e308", '"hot"', "NaN", "-0.0", "0", "0.5"]
USER = '[{"role":"user","content":%s}]'
TOOL_CALL = '[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":'
TOOL_CALL += '[{"id":"c1","type":"function","function":{"name":"f","arguments":%s}}]}]'
TOOLS = '[{"type":"function","function":{"name":"f","parameters":%s}}]'


def q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def nested(rng: random.Random) -> str:
    depth = rng.choice([10, 63, 64, 65, 100, 1000, rng.randint(10, 5000), 5000])
    return rng.choice(["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth])


def base_fields(rng: random.Random, chat: bool) -> list[tuple[str, str]]:
    words = q(" ".join(rng.choices(["hello", "fuzz", "cache", "token", "\u00e9t\u00e9"], k=3)))
    ids = "[" + ",".join(str(rng.randint(0, 255)) for _ in "abcd") + "]"
    prompt = ('"messages"', USER % words) if chat else ('"prompt"', rng.choice([words, ids]))
    fields = [('"model"', '"emulated"'), prompt, ('"max_tokens"', str(rng.randint(1, 4)))]
    return fields + ([('"stream"', rng.choice(["true", "false"]))] if rng.random() < 0.3 else [])


def mutation(rng: random.Random) -> tuple[str, str]:
    """A field to set: its key and its value, both as raw JSON text."""
    pick, sizes = rng.choice, [10**3, 10**4, 10**5, 5 * 10**5]
    makers: list[Callable[[], tuple[str, str]]] = [
        lambda: (q(pick(FIELDS)), pick(VALUES)),
        lambda: ('"prompt"', "[" + ",".join(rng.choices(TOKENS, k=rng.randint(1, 6))) + "]"),
        lambda: (q(f"extra{rng.randrange(9)}"), nested(rng)),
        lambda: ('"messages"', USER % nested(rng)),
        lambda: ('"messages"', TOOL_CALL % pick([nested(rng), '"{}"', "null", "[]"])),
        lambda: ('"tools"', TOOLS % nested(rng)),
        lambda: (pick(ESCAPED), pick(["5", '"salt"', "-1", "[]", "1e999", '"\\ud800"'])),
        lambda: (pick(['"prompt"', '"model"', '"user"', '"\\ud800"']), pick(SURROGATE)),
        lambda: ('"messages"', USER % pick(SURROGATE)),
        lambda: (pick(['"user"', '"prompt"', '"stop"', q("k" * 5000)]), q("\u00e9" * pick(sizes))),
        lambda: ('"stream"', pick(STREAMS)),
        lambda: ('"stream_options"', pick(OPTIONS)),
        lambda: (pick(['"max_tokens"', '"max_completion_tokens"', '"n"']), pick(COUNTS)),
        lambda: (pick(['"temperature"', '"top_p"', '"top_k"', '"seed"']), pick(SAMPLING)),
        lambda: (q(f"unknown_{rng.randrange(10**6)}"), pick(VALUES)),
    ]
    return pick(makers)()


def fuzz_body(rng: random.Random, chat: bool) -> tuple[bytes, str]:
    fields, what = base_fields(rng, chat), []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.1:
            what.append(f"without {fields.pop(rng.randrange(len(fields)))[0]}")
        elif kind < 0.2 and fields:  # a duplicate key
            fields.append((rng.choice(fields)[0], rng.choice(VALUES)))
            what.append(f"duplicate {fields[-1][0]}")
        else:
            key, value = mutation(rng)
            fields = [f for f in fields if f[0] != key]
            fields.insert(rng.randrange(len(fields) + 1), (key, value))
            what.append(f"{key}={value[:40]}")
    text = "{" + ",".join(f"{k}:{v}" for k, v in fields) + "}"
    whole = rng.randrange(14)
    if whole == 0:
        text, what = text[: rng.randrange(len(text))], ["truncated"]
    elif whole == 1:
        text = rng.choice(["", " ", "\r\n", "null", "1", '"s"', "[]", f"[{text}]", "\ufeff" + text])
        what = [f"top level {text[:20]!r}"]
    elif whole == 2:
        text = rng.choice([text + " xyz", text + text, text + "}", "{" + text, "not json"])
        what = ["trailing or not JSON"]
    return text.encode("utf-8", "surrogateescape"), "; ".join(what)


# -- the grammar: headers and framing ---------------------------------------------------------


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
CTYPES = [None, b"text/plain", b"multipart/form-data; boundary=x", b"\xff/\xfe", b"application/x"]
PATHS = ["/", "/v1", "/v1/foo", "//v1/completions", "/v1/completions/", "/V1/COMPLETIONS"]
PATHS += ["/v1/completions?x=1&y=%zz", "/v1/chat/completions?stream=true#f", "/admin/../health"]
PATHS += ["/health?x", "/metrics", "/v1/models", "/%00", "/v1/%2e%2e/health", "*"]
METHODS = ["GET", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD", "FOO", "post"]
VERSIONS = ["HTTP/1.0", "HTTP/1.0", "HTTP/1.2", "HTTP/2.0", "HTTP/0.9", "HTTP/x"]
H2C = (b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAAQCAAAA")
EXPECT = (b"Expect: 100-continue",)
ADMIN_PATHS = ["/admin/workers", "/admin/mode", "/admin/tenants", "/admin/route"]
ODD = [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET /\r\n\r\n", b"OPTIONS * HTTP/1.1\r\n\r\n"]
ODD += [b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /health HTTP/1.1\n\n"]
ODD_HEADERS = [b"X: a\r\n b", b"NoColon", b"X : y", b"X-Nul: a\x00b", b"\x80\xff: v", b": v"]
BAD_CHUNKS = [b"zz\r\n", b"-5\r\n", b"ffffffffffffffffffff\r\n", b"5\r\nabcdefgh\r\n", b"5 \r\n"]
FRAMING = [b"Transfer-Encoding: chunked", b"Content-Length: 3", b"Content-Length: x"]
FRAMING += [b"Content-Length: -1", b"Content-Length: 99999999999999999999", b"Content-Length: +5"]
FRAMING += [b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked, identity"]


def header_case(rng: random.Random) -> Case:
    body, path = valid(rng)
    pick = rng.choice
    method = pick(METHODS)
    key = pick([b"Bearer admin", b"Bearer admin-secret\xff", b"Bearer \xc3\xa9", None])
    target = pick([*ADMIN_PATHS, "/admin/invalidate", "/admin/workers/w0", "/admin/nope"])
    if target in ADMIN_PATHS:
        key = pick([key, b"Bearer admin-secret"])  # the right key: only what changes nothing
    verb = pick(["GET", "POST", "DELETE"])
    if key == b"Bearer admin-secret" and target != "/admin/route":
        verb = "GET"
    admin_body = fuzz_body(rng, pick([True, False]))[0] if verb != "GET" else b""
    n, url = pick([100, 300, 1000]), pick([*PATHS, path + "?" + "q" * pick([3000, 4100, 9000])])
    auth, ctype, version = pick(AUTHS), pick(CTYPES), pick(VERSIONS)
    big, dup = pick([16000, 17000, 40000]), (b"Authorization: " + pick(AUTHS[1:]),)
    alive = pick([(b"Connection: keep-alive",), ()])
    upgrade_target, odd, aim = (
        pick([path, "/health", "/v1/models"]),
        pick(ODD_HEADERS),
        pick([path, target]),
    )
    makers: list[Callable[[], tuple[str, bytes]]] = [
        lambda: (f"auth {auth!r:.40}", http(body, path, auth=auth)),
        lambda: ("two Authorization", http(body, path, headers=dup)),
        lambda: (f"content type {ctype!r}", http(body, path, ctype=ctype)),
        lambda: (f"Expect: 100-continue {aim}", http(body, aim, headers=EXPECT)),
        lambda: (f"h2c upgrade {upgrade_target}", http(body, upgrade_target, headers=H2C)),
        lambda: (f"h2c upgrade GET {upgrade_target}", http(b"", upgrade_target, "GET", H2C)),
        lambda: (f"header of {big}", http(body, path, headers=(b"X-Big: " + b"b" * big,))),
        lambda: (f"{n} headers", http(body, path, headers=tuple(b"X-%d: v" % i for i in range(n)))),
        lambda: (f"target {url[:60]}", http(body, url, pick(["GET", "POST"]))),
        lambda: (f"{method} {path}", http(body, path, method)),
        lambda: (f"{version} {alive}", http(body, path, version=version, headers=alive)),
        lambda: (f"admin {verb} {target} {key!r}", http(admin_body, target, verb, auth=key)),
        lambda: (f"header {odd!r}", http(body, path, headers=(odd,))),
    ]
    desc, data = pick(makers)()
    parts = [(0.0, data)]
    if desc.startswith("Expect"):  # the body after a wait for the 100
        split = data.index(b"\r\n\r\n") + 4
        parts = [(0.0, data[:split]), (0.3, data[split:])]
    return Case("header: " + desc, parts, head=desc.startswith("HEAD"))


def chunked(rng: random.Random, body: bytes, broken: bool) -> bytes:
    sizes = [rng.randint(1, 40) for _ in range(len(body))]
    starts = [sum(sizes[:i]) for i in range(len(sizes)) if sum(sizes[:i]) < len(body)]
    chunks = [body[s : s + n] for s, n in zip(starts, sizes, strict=False)]
    ext = rng.choice([b"", b";ext=1", b";a=b;c"])
    out = [b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in chunks]
    out.append(rng.choice([b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n"]))
    if broken:
        out.insert(rng.randrange(len(out)), rng.choice(BAD_CHUNKS))
    return b"".join(out)


def framing_case(rng: random.Random) -> Case:
    body, path = valid(rng)
    data, pick = http(body, path), rng.choice
    cut, n = rng.randrange(1, len(body)), pick([2, 3, 5, 8, 12])
    te, frame, odd = b"Transfer-Encoding: chunked", pick(FRAMING), pick(ODD)
    size = pick([1048577, 1048576, 2 * 2**20])  # over or at the body limit
    filler = b'{"model":"emulated","prompt":"' + b"y" * (size - 32) + b'"}'  # 1-2 MiB
    noise = bytes([rng.randrange(33, 256)]) + rng.randbytes(rng.randint(0, 300))
    tails = [b"", b"GET /health HTTP/1.1\r\n\r\n", b"\x00garbage", b"POST /v1/completions"]
    close = http(body, path, headers=(b"Connection: close",)) + pick(tails)
    streamed = body[:-1] + b',"stream":true,"max_tokens":64}'  # ~64 ms of stream
    short = data.replace(b"th: %d" % len(body), b"th: %d" % cut)  # the rest: a 2nd message

    def chunks(broken: bool, length: bool = False) -> bytes:
        return http(chunked(rng, body, broken), path, headers=(te,), length=length)

    makers: list[Callable[[], tuple[str, bytes, int]]] = [
        lambda: (f"Content-Length {cut} of {len(body)}", short, 2),
        lambda: ("chunked", chunks(False), 1),
        lambda: ("chunked, broken", chunks(True), 1),
        lambda: ("chunked and Content-Length", chunks(False, True), 1),
        lambda: (f"{frame!r}", http(body, path, headers=(frame,)), 1),
        lambda: (f"{n} pipelined", b"".join(http(*valid(rng)) for _ in range(n)), n),
        lambda: ("pipelined, then GET", data * (n - 1) + http(b"", "/health", "GET"), n),
        lambda: ("1-byte pieces", data, 1),
        lambda: ("Connection: close, then more", close, 1),
        lambda: (f"garbage {noise[:24]!r}", noise + b"\r\n\r\n", 1),
        lambda: ("TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + noise, 1),
        lambda: (f"odd message {odd!r}", odd, 1),
        lambda: ("bare LF", data.replace(b"\r\n", b"\n"), 1),
        lambda: ("absolute URL", http(body, "http://127.0.0.1" + path), 1),
        lambda: (f"body of {size}", http(filler[:size], path), 1),
        lambda: ("gone: after the request", http(streamed, path), 0),  # no answer wanted
        lambda: ("gone: mid-body", data[: rng.randrange(len(data))], 0),
        lambda: ("gone: before a byte", b"", 0),
    ]
    desc, raw, expect = pick(makers)()
    pause = 0.001 if desc == "1-byte pieces" else 0.0
    step = 1 if pause else len(raw) or 1
    parts = [(pause, raw[i : i + step]) for i in range(0, len(raw), step)]
    if not expect:  # the client leaves (mid-stream, mid-body) after a moment
        parts.append((rng.choice([0.0, 0.005, 0.02]), b""))
    return Case("framing: " + desc, parts, expect=expect)


def slow_cases(rng: random.Random, n: int) -> Iterator[Case]:
    for i in range(n):
        body, path = valid(rng)
        data = http(body, rng.choice([path, path, "/admin/route", "/health"]))
        head_end = data.index(b"\r\n\r\n") + 4
        stall = head_end + (len(data) - head_end) // 2
        if i % 3 == 0:  # headers trickled slower than the header timeout allows
            trickle = [(0.4, data[j : j + 4]) for j in range(0, head_end, 4)][:25]
            yield Case("slow: headers trickled", trickle, slow=True)
        elif i % 3 == 1:  # the body stalls half way (the rest comes much too late)
            yield Case("slow: body stalled", [(0.0, data[:stall]), (8.0, data[stall:])], slow=True)
        else:
            unfinished = data[: data.index(b"\r\n") + 2] + b"X-Unfinished: 1"
            yield Case("slow: headers never end", [(0.0, unfinished)], slow=True)


def sequence_case(rng: random.Random) -> Case:
    """Requests one after another on a kept-alive connection, each once the last is answered:
    hot ones, ones for aiohttp (which keeps the connection from then on), bad ones."""
    admin = b"Bearer admin-secret"
    stream = valid(rng)[0][:-1] + b',"stream":true}'
    menu = [
        http(*valid(rng)),
        http(stream),
        http(b"", "/health", "GET"),
        http(b"{", "/v1/completions"),
    ]
    menu += [http(b"", "/v1/models", "GET"), http(b"", "/metrics", "GET", auth=admin)]
    menu += [http(b"", "/nope", "GET"), http(fuzz_body(rng, False)[0])]
    reqs = rng.choices(menu, k=rng.randint(2, 6))
    return Case("sequence: kept alive", [(0.0, r) for r in reqs], len(reqs), lockstep=True)


def h2c_cases() -> list[Case]:
    """What `curl --http2` sends with a body: an h2c upgrade, the body in a later packet."""
    body = b'{"model":"emulated","prompt":"h2c","max_tokens":1}'
    head = http(body, headers=H2C)[: -len(body)]
    chunked_head = head.replace(b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked")
    expect = head[:-2] + b"Expect: 100-continue\r\n\r\n"
    return [
        Case("h2c: the body 50 ms after the head", [(0.0, head), (0.05, body)]),
        Case(
            "h2c: chunked, the body after",
            [(0.0, chunked_head), (0.05, b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))],
        ),
        Case("h2c: Expect: 100-continue, the body after", [(0.0, expect), (0.3, body)]),
        Case("h2c: in 1-byte pieces", [(0.001, bytes([b])) for b in head + body]),
    ]


def split(rng: random.Random, case: Case) -> Case:
    """The same bytes in 2 to 6 writes a moment apart: the answer must not change."""
    raw = b"".join(p for _, p in case.parts)
    cuts = sorted({0, len(raw), *(rng.randrange(len(raw) + 1) for _ in range(rng.randint(1, 5)))})
    case.parts = [(0.002, raw[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    case.desc += " (split)"
    return case


def cases(seed: int) -> list[Case]:
    rng = random.Random(seed)
    out = []
    for _ in range(1500):
        chat = rng.random() < 0.5
        body, desc = fuzz_body(rng, chat)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        out.append(Case(f"body: {desc}", [(0.0, http(body, path))]))
    out += [header_case(rng) for _ in range(700)]
    out += [framing_case(rng) for _ in range(700)]
    out += [sequence_case(rng) for _ in range(100)]
    out = [split(rng, c) if len(c.parts) == 1 and rng.random() < 0.25 else c for c in out]
    out += list(slow_cases(rng, 24)) + h2c_cases() + h2c_cases()
    rng.shuffle(out)
    return out


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
    statuses: list[int] = []

    async def send() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            for i, (pause, data) in enumerate(case.parts):
                while case.lockstep and len(statuses) < i:
                    await asyncio.sleep(0.002)
                if pause:
                    await asyncio.sleep(pause)
                writer.write(data)
                await writer.drain()
            if case.half_close:
                writer.write_eof()

    sender = asyncio.create_task(send())
    buf, end = b"", "timeout"
    try:
        while len(statuses) < case.expect:
            try:
                left = max(t0 + timeout_s - time.monotonic(), 0.01)
                data = await asyncio.wait_for(reader.read(1 << 16), left)
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
    end = "done" if len(statuses) >= case.expect else end
    return Outcome(statuses, end, time.monotonic() - t0)


def verdict(case: Case, out: Outcome) -> str:
    """What is wrong with the outcome ('' when nothing)."""
    if not case.expect:  # left before any answer: the gateway's health tells
        return ""
    if any(s >= 500 for s in out.statuses):
        return f"status {out.statuses}"
    if not out.statuses:
        return "hang: no answer in 15 s" if out.end == "timeout" else f"dropped ({out.end})"
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


def failures(batch: list[Case], outcomes: list[Outcome]) -> list[str]:
    wrong = [(c, v) for c, o in zip(batch, outcomes, strict=True) if (v := verdict(c, o))]
    return [f"{v} <- {c.desc[:100]} | {b''.join(p for _, p in c.parts)[:200]!r}" for c, v in wrong]


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


# a leak grows with the cases; glibc's arenas keep 5-12 MB of a 3k-case fuzz on a busy machine
RSS_BOUND = 1.3


def settled_rss(fleet: Fleet) -> int:
    """The gateway's RSS once back within RSS_BOUND of its start (or as it is after 10 s)."""
    wait_for(lambda: rss_kb(fleet.gateway.popen.pid) <= RSS_BOUND * fleet.start_rss_kb, 10)
    return rss_kb(fleet.gateway.popen.pid)


def unhealthy(fleet: Fleet) -> list[str]:
    """What is wrong with the gateway now: exited, /health not 200, a tenant not served."""
    if fleet.gateway.popen.poll() is not None:
        return ["the gateway exited:", *fleet.gateway.lines[-30:]]
    try:
        health = httpx.get(f"{fleet.gateway.url}/health", timeout=5)
        served = [completion(fleet.gateway.url, key) for key in ("key-acme", "key-beta")]
    except httpx.HTTPError as exc:
        return [f"the gateway does not answer: {exc!r}"]
    wrong = [] if health.status_code == 200 else [f"/health: {health.status_code} {health.text}"]
    return wrong + [f"completion: {r.status_code} {r.text}" for r in served if r.status_code != 200]


def memory(fleet: Fleet, rss: int) -> list[str]:
    if rss <= RSS_BOUND * fleet.start_rss_kb:
        return []
    return [f"gateway RSS {rss} kB: over {RSS_BOUND} x its {fleet.start_rss_kb} kB after warm-up"]


def test_fuzzed_requests_get_answers_below_500(fleet: Fleet) -> None:
    batch = cases(SEED)
    t0 = time.monotonic()
    outcomes = asyncio.run(run_all(fleet.port, batch))
    took = time.monotonic() - t0
    statuses = Counter(s for o in outcomes for s in o.statuses)
    pairs = list(zip(batch, outcomes, strict=True))
    slow = Counter(s for c, o in pairs if c.slow for s in o.statuses)
    dropped = sum(c.expect > 0 and not o.statuses and o.end != "timeout" for c, o in pairs)
    gone = sum(not c.expect for c in batch)
    wrong = failures(batch, outcomes)
    rss = settled_rss(fleet)
    print(f"\nfuzz: {len(batch)} cases in {took:.1f} s; statuses {sorted(statuses.items())}")
    print(
        f"slow: {sorted(slow.items())}; client gone: {gone}; dropped {dropped}; failed {len(wrong)}"
    )
    print(f"gateway RSS: {fleet.start_rss_kb} kB after warm-up, {rss} kB after the fuzz")
    problems = [f"{len(wrong)} of {len(batch)} cases failed", *wrong[:20]] if wrong else []
    if slow != {408: sum(c.slow for c in batch)}:
        problems.append(f"the slow cases were answered {dict(slow)}, not all 408")
    problems += unhealthy(fleet) + memory(fleet, rss)
    assert not problems, "\n".join(problems)


def test_unfinished_large_bodies_are_reaped(fleet: Fleet) -> None:
    """20 connections, each 900 kB into a body of 1 MB, then silent: the body timeout reaps
    them (408), and the memory they held goes back."""
    head = http(b"x" * 1_000_000).split(b"\r\n\r\n")[0] + b"\r\n\r\n"
    body = b'{"model":"emulated","prompt":"' + b"z" * 900_000
    batch = [Case("memory: 900 kB of 1 MB", [(0.0, head), (0.0, body)], slow=True)] * 20
    peak = 0

    async def watched() -> list[Outcome]:
        nonlocal peak
        task = asyncio.ensure_future(run_all(fleet.port, batch))
        while not task.done():
            peak = max(peak, rss_kb(fleet.gateway.popen.pid))
            await asyncio.sleep(0.1)
        return await task

    outcomes = asyncio.run(watched())
    rss = settled_rss(fleet)
    print(f"\nmemory: RSS {fleet.start_rss_kb} kB after warm-up, peak {peak} kB, after {rss} kB")
    problems = failures(batch, outcomes)
    if (answers := {s for o in outcomes for s in o.statuses}) != {408}:
        problems.append(f"answered {answers}, not all 408")
    problems += unhealthy(fleet) + memory(fleet, rss)
    assert not problems, "\n".join(problems)


def test_a_half_close_is_a_client_that_left(fleet: Fleet) -> None:
    """shutdown(SHUT_WR) after a whole request: the gateway takes the EOF for a client that
    gave up, as nginx does (its request and the worker's generation are cancelled), so the
    connection closes, answered or not; nothing hangs, nothing is a 5xx."""
    body, path = valid(random.Random(SEED))
    requests = [http(body, path), http(b"", "/health", "GET"), http(b"{", path)]
    batch = [
        Case(f"half-close {r[:30]!r}", [(0.0, r), (0.0, b"")], half_close=True)
        for r in requests
        for _ in range(5)
    ]
    outcomes = asyncio.run(run_all(fleet.port, batch))
    problems = [
        f"{o} <- {c.desc}"
        for c, o in zip(batch, outcomes, strict=True)
        if o.end in ("timeout", "garbled") or any(s >= 500 for s in o.statuses)
    ]
    assert not problems + unhealthy(fleet), "\n".join(problems + unhealthy(fleet))


def test_a_refusal_reaches_a_client_still_sending() -> None:
    """A request refused mid-way (bare LF line ends: 400) while its client still writes the
    rest: the gateway reads on until the client is done (a lingering close), so the client's
    writes do not fail (a client that stops at a failed write never reads the 400) and its
    400 comes."""
    worker = start_worker("--kv-events-port", "0")
    gateway = start_gateway([worker.url], "--api-key", "acme:key-acme")
    try:
        port = int(gateway.url.rsplit(":", 1)[1])
        body = '{"model":"emulated","messages":[{"role":"user","content":"été été"}]}'.encode()
        head = "POST /v1/chat/completions HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer "
        head += f"key-acme\nContent-Type: application/json\nContent-Length: {len(body)}\n\n"
        raw = head.encode() + body
        rng = random.Random(1)
        answered = 0
        for _ in range(100):
            cuts = {rng.randrange(len(raw) + 1) for _ in range(rng.randint(1, 5))}
            cuts = sorted({0, len(raw), *cuts})
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
                contextlib.suppress(ConnectionResetError, BrokenPipeError),  # not answered
            ):
                for a, b in zip(cuts, cuts[1:], strict=False):
                    sock.sendall(raw[a:b])
                    time.sleep(0.002)
                answered += sock.recv(4096).startswith(b"HTTP/1.1 400")
        assert answered == 100
    finally:
        gateway.stop()
        worker.stop()
