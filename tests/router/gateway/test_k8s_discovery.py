"""`urc gateway --discover k8s` against a stand-in API server (tests/k8s_api.py): pods appear,
become ready, terminate and are deleted while requests stream through; the watch drops and
resumes; a 410 Gone forces a relist. The gateway and the workers are real processes; each step
must show in /admin/workers and in the routing within 2 s."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from router.gateway.config import load_config
from router.gateway.discovery import gone, is_ready, worker_config
from tests.gateway import ADMIN, admin_workers, route
from tests.k8s_api import StandInAPI, pod
from tests.processes import wait_for
from urc.cli import main
from urc.processes import Child, start_gateway, start_worker

FOLLOW_S = 2.0  # the gateway follows each change of the pods within this


def test_a_pod_is_a_worker_while_ready() -> None:
    ready = pod("a", 9001, ready=True)
    config = worker_config(ready, 8000)
    assert config is not None
    assert (config.name, config.url, config.models, config.engine) == (
        "a",
        "http://127.0.0.1:9001",
        None,  # ours: /urc/info says
        "urc",
    )
    assert worker_config(pod("a", 9001, ready=False), 8000) is None
    terminating = pod("a", 9001, ready=True)
    terminating["metadata"]["deletionTimestamp"] = "2025-01-01T00:01:00Z"
    assert not is_ready(terminating) and worker_config(terminating, 8000) is None
    no_ip = pod("a", 9001, ready=True)
    del no_ip["status"]["podIP"]
    assert worker_config(no_ip, 8000) is None


def test_ports_and_engine_annotations() -> None:
    named = pod("a", 1, ready=True, ip="10.1.2.3")
    del named["metadata"]["annotations"]["urc.dev/port"]
    named["spec"]["containers"][0]["ports"] = [
        {"name": "metrics", "containerPort": 9100},
        {"name": "http", "containerPort": 8080},
    ]
    assert worker_config(named, 8000).url == "http://10.1.2.3:8080"  # type: ignore[union-attr]
    del named["spec"]["containers"][0]["ports"]
    assert worker_config(named, 7000).url == "http://10.1.2.3:7000"  # type: ignore[union-attr]
    vllm = pod(
        "v",
        8000,
        ready=True,
        ip="10.0.0.9",
        annotations={
            "urc.dev/engine": "vllm",
            "urc.dev/models": "llama, llama-chat",
            "urc.dev/kv-events": "tcp://*:5557",
            "urc.dev/kv-replay": "tcp://0.0.0.0:5558",
            "urc.dev/kv-topic": "kv",
            "urc.dev/block-size": "32",
        },
    )
    config = worker_config(vllm, 8000)
    assert config is not None and config.engine == "vllm"
    assert config.models == ["llama", "llama-chat"]
    assert (config.kv_events, config.kv_replay) == ("tcp://10.0.0.9:5557", "tcp://10.0.0.9:5558")
    assert (config.kv_topic, config.block_size) == ("kv", 32)
    ipv6 = pod("six", 8000, ready=True, ip="fd00::7")
    assert worker_config(ipv6, 8000).url == "http://[fd00::7]:8000"  # type: ignore[union-attr]
    for bad in (
        {"urc.dev/engine": "sglang"},  # no models: an SGLang pod cannot be asked
        {"urc.dev/engine": "trt"},
        {"urc.dev/port": "http"},
        {"urc.dev/block-size": "0"},
    ):
        with pytest.raises(ValueError):
            worker_config(pod("x", 8000, ready=True, annotations=bad), 8000)


def test_gone_reads_both_forms_of_410() -> None:
    from lightkube.core.exceptions import ApiError
    from lightkube.models.meta_v1 import Status

    assert gone(ApiError(status=Status(code=410, message="too old")))
    assert not gone(ApiError(status=Status(code=500, message="oops")))
    assert not gone(ConnectionError("reset"))


def test_discovery_settings_are_checked(tmp_path, capsys) -> None:
    assert main(["gateway", "--discover", "k8s"]) == 2
    assert "--discover-selector" in capsys.readouterr().err
    assert main(["gateway", "--discover", "consul", "--discover-selector", "app=x"]) == 2
    missing = str(tmp_path / "nope.yaml")
    args = ["gateway", "--discover", "k8s", "--discover-selector", "a=b"]
    assert main([*args, "--discover-kubeconfig", missing]) == 2
    assert "no kubeconfig" in capsys.readouterr().err
    toml = tmp_path / "gateway.toml"
    toml.write_text('[gateway]\ndiscover = "k8s"\ndiscover_selector = "app=vllm"\n')
    config = load_config(toml)
    assert (config.discover, config.discover_selector, config.discover_port) == (
        "k8s",
        "app=vllm",
        8000,
    )


class _Load:
    """Streamed chat requests through the gateway from a few threads until stopped: each
    answer's worker and start time, and every failure."""

    def __init__(self, gateway: str, clients: int = 4) -> None:
        self.gateway = gateway
        self.served: list[tuple[float, str]] = []  # (when it was sent, its worker)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self, client: int) -> None:
        with httpx.Client(base_url=self.gateway, timeout=20) as http:
            n = 0
            while not self._stop.is_set() and n < 2000:
                n += 1
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"client {client} turn {n}"}],
                    "max_tokens": 8,
                    "stream": True,
                }
                sent = time.monotonic()
                try:
                    with http.stream("POST", "/v1/chat/completions", json=body) as response:
                        text = "".join(response.iter_text())
                        if response.status_code != 200 or "[DONE]" not in text:
                            self.failures.append(f"{response.status_code}: {text[-200:]}")
                        else:
                            self.served.append((sent, route(response)["worker"]))
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def workers_since(self, t: float) -> set[str]:
        return {worker for sent, worker in list(self.served) if sent >= t}


@pytest.fixture
def api() -> Iterator[StandInAPI]:
    server = StandInAPI()
    yield server
    server.close()


@pytest.fixture
def engines() -> Iterator[list[Child]]:
    children = [start_worker("--model", "m", "--decode-base-ms", "5") for _ in range(5)]
    yield children
    for child in children:
        child.stop()


def _port(child: Child) -> int:
    return int(child.url.rsplit(":", 1)[1])


def _up(gateway: str) -> set[str]:
    try:
        return {w["name"] for w in admin_workers(gateway) if w["up"]}
    except httpx.HTTPError:
        return set()


def _listed(gateway: str) -> set[str]:
    return {w["name"] for w in admin_workers(gateway)}


def _candidates(gateway: str) -> set[str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "where to?"}]}
    plan = httpx.post(f"{gateway}/admin/route", json=body, headers=ADMIN, timeout=5).json()
    return {c["worker"] for c in plan.get("candidates", [])}


def test_gateway_follows_the_pods(tmp_path, api: StandInAPI, engines: list[Child]) -> None:
    gateway = start_gateway(
        [],
        "--discover",
        "k8s",
        "--discover-selector",
        "app=engine",
        "--discover-kubeconfig",
        str(api.kubeconfig(tmp_path)),
        "--admin-key",
        "admin-secret",
        "--policy",
        "round_robin",
    )
    try:
        url = gateway.url
        assert wait_for(lambda: api.watch_versions, 10), gateway.lines[-20:]
        a, b, c, d, e = (_port(w) for w in engines)

        # a pod not ready is no worker; once ready, it is, and requests reach it
        api.put(pod("a", a, ready=False))
        api.put(pod("other", e, ready=True, labels={"app": "db"}))  # not selected
        time.sleep(0.5)
        assert _listed(url) == set()
        api.put(pod("a", a, ready=True))
        assert wait_for(lambda: _up(url) == {"a"}, FOLLOW_S), gateway.lines[-20:]
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=10,
        )
        assert answer.status_code == 200 and route(answer)["worker"] == "a"
        api.put(pod("b", b, ready=True))
        assert wait_for(lambda: _up(url) == {"a", "b"}, FOLLOW_S), gateway.lines[-20:]
        assert _candidates(url) == {"a", "b"}

        # pods leave while requests stream through: none fails
        load = _Load(url)
        try:
            assert wait_for(lambda: load.workers_since(0) == {"a", "b"}, 10), load.failures
            terminating = pod("a", a, ready=True)
            terminating["metadata"]["deletionTimestamp"] = "2025-01-01T00:01:00Z"
            api.put(terminating)
            assert wait_for(lambda: _listed(url) == {"b"}, FOLLOW_S), gateway.lines[-20:]
            left_a = time.monotonic()
            api.put(pod("c", c, ready=True))
            assert wait_for(lambda: _up(url) == {"b", "c"}, FOLLOW_S), gateway.lines[-20:]
            time.sleep(0.3)  # a request under way on `a` when it left finishes there
            engines[0].stop()
            api.delete("a")
            assert wait_for(lambda: "c" in load.workers_since(time.monotonic() - 0.5), 10)
            api.delete("b")  # DELETED with no terminating step before it
            assert wait_for(lambda: _listed(url) == {"c"}, FOLLOW_S), gateway.lines[-20:]
            left_b = time.monotonic()
            time.sleep(0.3)
            engines[1].stop()
            assert wait_for(lambda: len(load.workers_since(left_b + 0.3)) > 0, 10)
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]
        assert "a" not in load.workers_since(left_a) and "b" not in load.workers_since(left_b)
        assert _candidates(url) == {"c"}

        # a bookmark moves the version on: after compaction the watch still resumes from it
        lists = api.lists
        api.put(pod("other", e, ready=True, labels={"app": "db", "rev": "2"}))  # unseen change
        api.bookmark()
        time.sleep(0.5)
        asked = len(api.watch_versions)
        api.compact()
        api.hold()  # the watch breaks mid-stream
        api.put(pod("d", d, ready=True))  # added while no watch runs
        api.release()
        assert wait_for(lambda: _up(url) == {"c", "d"}, FOLLOW_S), gateway.lines[-20:]
        assert api.watch_versions[asked] == str(api.oldest)  # resumed at the bookmark's version
        assert api.lists == lists and api.gones == 0  # resumed, not relisted

        # 410 Gone as an ERROR event: relist; a pod deleted meanwhile (never seen DELETED) goes
        api.hold()
        api.delete("c")
        api.compact()
        api.release()
        assert wait_for(lambda: _listed(url) == {"d"}, FOLLOW_S), gateway.lines[-20:]
        assert api.gones == 1 and api.lists == lists + 1
        assert _candidates(url) == {"d"}

        # 410 Gone as the HTTP status: the same
        api.gone_as_http = True
        api.hold()
        api.put(pod("e", e, ready=True))
        api.delete("d")
        api.compact()
        api.release()
        assert wait_for(lambda: _up(url) == {"e"}, FOLLOW_S), gateway.lines[-20:]
        assert _listed(url) == {"e"} and api.gones == 2 and api.lists == lists + 2
    finally:
        gateway.stop()
