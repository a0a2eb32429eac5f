"""urc bench end to end: whole runs over HTTP against a small OpenAI-compatible endpoint on
127.0.0.1. The endpoint (the *target*) is the test double; the load generator is real: its runner,
client, session chaining, report and CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
from itertools import islice
from pathlib import Path

import pytest
from aiohttp import web

from core.tokenizer import ByteTokenizer
from loadgen.cli import main
from loadgen.mooncake import parse_trace, trace_requests
from loadgen.report import summarize
from loadgen.runner import BenchConfig, run_bench
from loadgen.workloads import iter_requests

TRACE = Path(__file__).resolve().parents[2] / "traces/mooncake_synthetic_trace.jsonl"
TOK = ByteTokenizer()

FIRST_TOKEN_DELAY = 0.03


class FakeEndpoint:
    """An OpenAI-compatible streaming server: a deterministic reply per prompt, a prefix cache
    (longest prefix shared with any earlier prompt, in 16-token blocks) reported as
    cached_tokens and in x-urc-route, and scripted failures by arrival number."""

    def __init__(self, failures: dict[int, str] | None = None) -> None:
        self.failures = failures or {}
        self.arrivals = 0
        self.prompts: list[list[int]] = []  # token ids under the byte tokenizer
        self.continuations: list[str] = []  # prompt + reply as the next chat turn will render it
        self.extended = 0  # chat prompts that extend an earlier prompt + its reply
        self.keys: list[str | None] = []  # the Authorization headers

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        n = self.arrivals
        self.arrivals += 1
        body = await request.json()
        failure = self.failures.get(n)
        if failure in ("500", "503"):
            return web.Response(status=int(failure), text="scripted failure")
        if failure == "hang":
            await asyncio.sleep(30)
        chat = "messages" in body
        prompt = TOK.render_chat(body["messages"]) if chat else body["prompt"]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        self.keys.append(request.headers.get("Authorization"))
        ids = TOK.encode(prompt)
        cached = max((len(os.path.commonprefix([ids, p])) for p in self.prompts), default=0)
        cached = cached // 16 * 16
        self.extended += any(prompt.startswith(c) for c in self.continuations)
        self.prompts.append(ids)
        reply = hashlib.sha256(prompt.encode()).hexdigest()[: 4 * body["max_tokens"]]
        self.continuations.append(prompt + reply + "<|im_end|>\n")
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "x-urc-route": f"worker=w{n % 2}; matched_tokens={cached}; reason=test",
                "x-urc-cached-tokens": str(cached),
            }
        )
        await resp.prepare(request)
        if failure == "garbage":
            await resp.write(b"data: {this is not json\n\n")
            return resp
        key = "delta" if chat else "text"
        await resp.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        await asyncio.sleep(FIRST_TOKEN_DELAY)
        pieces = [reply[i : i + 4] for i in range(0, len(reply), 4)]
        for piece in pieces:
            content = {"content": piece} if chat else piece
            await resp.write(sse({"choices": [{"index": 0, key: content}]}))
            await asyncio.sleep(0.001)
        if failure == "truncated":
            return resp
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(pieces),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await resp.write(sse({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


@pytest.fixture
async def serve():
    runners: list[web.AppRunner] = []

    async def start(fake: FakeEndpoint) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", fake.models)
        app.router.add_post("/v1/chat/completions", fake.complete)
        app.router.add_post("/v1/completions", fake.complete)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_closed_loop_counts_ttft_errors_and_cache(serve):
    fake = FakeEndpoint({2: "500", 5: "503", 7: "garbage", 9: "truncated"})
    url = await serve(fake)
    specs = iter_requests("system-prompts", groups=3, prefix_tokens=256, max_tokens=4)
    config = BenchConfig(url + "/v1/", concurrency=4, max_requests=30)
    run = await run_bench(specs, config)
    s = summarize(run.results, run.wall_s)
    assert s["counts"] == {"sent": 30, "ok": 26, "failed": 4, "cancelled": 0, "dropped": 0}
    assert s["errors"] == {"http_500": 1, "http_503": 1, "protocol": 1, "truncated": 1}
    ok = [r for r in run.results if r.ok]
    assert all(FIRST_TOKEN_DELAY - 0.001 <= r.ttft_s < r.latency_s for r in ok)
    assert all(r.output_tokens == 4 and r.prompt_tokens > 256 for r in ok)
    assert s["hit_rate"] > 0.5  # three groups of a 256-token prefix, 30 requests
    assert s["prediction"] == {"compared": 26, "mae_pct": 0.0, "bias_pct": 0.0}
    assert sum(w["ok"] for w in s["workers"].values()) == 26 and set(s["workers"]) == {"w0", "w1"}
    assert fake.arrivals == 30


async def test_sessions_chain_on_the_actual_replies(serve):
    fake = FakeEndpoint()
    url = await serve(fake)
    specs = iter_requests("multi-turn", sessions=4, turns=3, system_tokens=64, max_tokens=3)
    run = await run_bench(specs, BenchConfig(url, concurrency=8, max_requests=12))
    assert all(r.ok for r in run.results) and len(run.results) == 12
    assert fake.extended == 8  # every turn after the first extends its previous prompt + reply
    later_turns = [r for r in run.results if r.index >= 4]  # turn-major: 4 sessions per turn
    assert all(r.cached_tokens > 64 for r in later_turns)  # the system prompt and more


async def test_open_loop_poisson_and_trace_replay(serve):
    fake = FakeEndpoint()
    url = await serve(fake)
    specs = iter_requests("system-prompts", prefix_tokens=32, max_tokens=2)
    run = await run_bench(specs, BenchConfig(url, rate=400.0, max_requests=20, seed=1))
    assert len(run.results) == 20 and all(r.ok for r in run.results)

    with TRACE.open() as f:
        first, _ = parse_trace(islice(f, 100))
    records = first[:6] + [r for r in first if r.hash_ids[0] == 708]  # three share a prefix
    replay = list(trace_requests(records, "fake-model", time_scale=0.0005, max_output_tokens=3))
    run = await run_bench(replay, BenchConfig(url, replay_arrivals=True))
    assert [r.prompt_tokens for r in run.results] == [
        s.input_length for s in sorted(records, key=lambda r: r.timestamp_ms)
    ]
    assert all(
        r.start_s >= spec.arrival_s - 0.005 for r, spec in zip(run.results, replay, strict=True)
    )
    assert any(r.cached_tokens for r in run.results)  # lines that share hash ids hit


async def test_failures_of_every_kind_never_crash_the_run(serve):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    specs = iter_requests("system-prompts", prefix_tokens=16)
    run = await run_bench(specs, BenchConfig(dead, concurrency=2, max_requests=4))
    assert [r.error for r in run.results] == ["connection"] * 4

    url = await serve(FakeEndpoint({0: "hang"}))
    run = await run_bench(specs, BenchConfig(url, concurrency=2, max_requests=3, timeout_s=0.3))
    assert sorted(r.error or "ok" for r in run.results) == ["ok", "ok", "timeout"]

    url = await serve(FakeEndpoint(dict.fromkeys(range(100), "hang")))
    config = BenchConfig(url, concurrency=3, duration_s=0.2, grace_s=0.1)
    run = await run_bench(specs, config)
    assert [r.error for r in run.results] == ["cancelled"] * 3 and run.wall_s < 2


async def test_cli_writes_the_table_and_the_json_summary(serve, tmp_path, capsys):
    fake = FakeEndpoint({3: "503"})
    url = await serve(fake)
    out = tmp_path / "bench.json"
    argv = (
        f"--target {url} --workload two-tenants -p prefix_tokens=64 --requests 10"
        f" --concurrency 2 --api-key key-a --api-key key-b --json {out} --json-requests"
        " --no-progress"
    ).split()
    assert await asyncio.to_thread(main, argv) == 0
    assert "hit rate" in capsys.readouterr().out
    s = json.loads(out.read_text())
    assert set(s) == {
        *("schema", "config", "duration_s", "counts", "errors", "error_examples", "ttft_s"),
        "latency_s",
        *("throughput", "tokens", "hit_rate", "prediction", "workers", "requests"),
    }
    assert s["schema"] == "urc.bench/1" and s["config"]["models"] == ["fake-model"]
    assert s["config"]["mode"] == "closed" and s["config"]["workload"] == "two-tenants"
    assert s["counts"]["sent"] == 10 and s["errors"] == {"http_503": 1}
    assert s["error_examples"] == {"http_503": "scripted failure"}
    assert len(s["requests"]) == 10 and s["requests"][0]["tenant"] == "tenant-a"
    assert set(fake.keys) == {"Bearer key-a", "Bearer key-b"}

    assert await asyncio.to_thread(main, ["--target", url, "--workload", "nope"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}\n{')
    assert await asyncio.to_thread(main, ["--target", url, "--trace", str(bad)]) == 2
    assert "line 2: not JSON" in capsys.readouterr().err
