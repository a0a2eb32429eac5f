"""`urc epp` behind a real Envoy in front of two real vLLM CPU engines (`make test-vllm`;
skipped without URC_VLLM_PYTHON), driven by the official `openai` client: a shared prefix
comes back to the engine that computed it and vLLM reuses it, and the EPP's predicted cached
tokens (its `/metrics`, and each answer's `x-urc-route`) match vLLM's to 2 % of the prompt."""

from __future__ import annotations

import re
import time
from typing import NamedTuple

import httpx
import openai
import pytest

from backends.tiny_checkpoint import write_checkpoint
from core.text import filler
from tests.backends.vllm_fleet import BLOCK, MODEL, VLLM_PYTHON, attach_args, start_vllm_engines
from tests.processes import wait_for
from tests.router.epp.test_epp_envoy import port_of, start_epp
from urc.envoy import Envoy
from urc.envoy_epp import epp_envoy_config

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON, reason="URC_VLLM_PYTHON unset (make test-vllm)"),
    pytest.mark.timeout(900),
]
NUM_BLOCKS = 64  # per engine: 2,048 tokens, room for the 4 prefixes below with no eviction
GROUPS, REPEATS = 4, 2  # prefixes, and the requests after each one's first
COUNTERS = ("urc_prompt_tokens", "urc_predicted_cached_tokens", "urc_actual_cached_tokens")


class Stack(NamedTuple):
    url: str  # Envoy's
    metrics: str  # the EPP's /metrics


class Answer(NamedTuple):
    group: int
    worker: str  # x-urc-route's
    matched: int  # x-urc-route's: the EPP's prediction on that worker
    prompt: int  # vLLM's usage
    cached: int


def scrape(metrics: str) -> str:
    return httpx.get(metrics, timeout=10).text


def samples(text: str, name: str) -> list[float]:
    """Every sample of `name` (a gauge, or a counter's `_total`), over all label sets."""
    pattern = rf"^{name}(?:_total)?(?:\{{[^}}]*\}})? (\S+)$"
    return [float(v) for v in re.findall(pattern, text, re.M)]


def counters(metrics: str) -> dict[str, float]:
    text = scrape(metrics)
    return {name: sum(samples(text, name)) for name in COUNTERS}


def settle(metrics: str, quiet_s: float = 0.4, timeout_s: float = 10.0) -> None:
    """Until the EPP's mirror of the engines' caches has not moved for `quiet_s` (the KV
    events of the last request are in), as vllm_fleet.settle does with /admin/workers."""

    def mirror() -> list[float]:
        text = scrape(metrics)
        names = ("urc_worker_cached_blocks", "urc_index_blocks", "urc_index_evicted_blocks")
        return [v for name in names for v in samples(text, name)]

    deadline = time.monotonic() + timeout_s
    last = mirror()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = mirror()
        if now == last:
            return
        last = now


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm-epp")
    model_dir = write_checkpoint(root / "model")
    engines = start_vllm_engines(model_dir, root, 2, NUM_BLOCKS)
    epp = envoy = None
    try:
        epp = start_epp(
            [],
            *attach_args(engines),
            "--model-tokenizer",
            f"{MODEL}={model_dir}",
            "--metrics-port",
            "0",
        )
        metrics = next(x for x in epp.lines if x.startswith("metrics: ")).split(" ", 1)[1]

        def exact() -> bool:  # both engines up, their KV events mirrored
            text = scrape(metrics)
            return (
                samples(text, "urc_worker_exact")
                == samples(text, "urc_worker_healthy")
                == [
                    1.0,
                    1.0,
                ]
            )

        assert wait_for(exact, 60), scrape(metrics)
        epp_port = port_of(epp)
        envoy = Envoy([], config_for=lambda port, admin: epp_envoy_config(port, admin, epp_port))
        warm = {"model": MODEL, "prompt": "warm up", "max_tokens": 1}

        def serving() -> bool:
            try:
                return httpx.post(f"{envoy.url}/v1/completions", json=warm, timeout=30).is_success
            except httpx.HTTPError:
                return False

        assert wait_for(serving, 60), "Envoy + urc epp never served a request"
        yield Stack(envoy.url, metrics)
    finally:
        for child in (envoy, epp):
            if child is not None:
                child.stop()
        for engine in engines:
            engine.stop()


def ask(client: openai.OpenAI, group: int, prefix: str, question: str) -> Answer:
    messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4
    )
    route = dict(p.strip().split("=", 1) for p in raw.headers["x-urc-route"].split(";"))
    usage = raw.parse().usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return Answer(group, route["worker"], int(route["matched_tokens"]), usage.prompt_tokens, cached)


class Run(NamedTuple):
    first: list[Answer]  # each group's first request
    later: list[Answer]  # the REPEATS after each
    before: dict[str, float]  # the EPP's counters before the run
    after: dict[str, float]


@pytest.fixture(scope="module")
def run(stack: Stack) -> Run:
    """Each group's first request (settled: its blocks are in the index), then REPEATS more
    questions on each prefix, through Envoy."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    prefixes = [f"Team {g}. " + filler(600, f"epp-prefix-{g}") for g in range(GROUPS)]
    before = counters(stack.metrics)
    first, later = [], []
    for g, prefix in enumerate(prefixes):
        first.append(ask(client, g, prefix, f"first {g}?"))
        settle(stack.metrics)
    for g, prefix in enumerate(prefixes):
        for i in range(REPEATS):
            later.append(ask(client, g, prefix, f"question {i} of {g}?"))
            settle(stack.metrics)
    return Run(first, later, before, counters(stack.metrics))


def test_a_shared_prefix_returns_to_its_engine_and_vllm_reuses_it(run: Run) -> None:
    assert len({a.worker for a in run.first}) == 2, run.first  # new prefixes spread over both
    assert all(a.cached == 0 for a in run.first), run.first
    owner = {a.group: a.worker for a in run.first}
    for answer in run.later:
        assert answer.worker == owner[answer.group], answer
        assert answer.cached >= 5 * BLOCK, answer  # the prefix's blocks, by vLLM's count


def test_predicted_cached_tokens_match_vllms_within_2_percent(run: Run) -> None:
    answers = run.first + run.later
    for a in answers:  # per request: x-urc-route's prediction against vLLM's usage
        assert abs(a.matched - a.cached) <= 0.02 * a.prompt, a
    delta = {name: run.after[name] - run.before[name] for name in COUNTERS}
    # the EPP's own accounting (read from the answers as they passed through Envoy)
    assert delta["urc_prompt_tokens"] == sum(a.prompt for a in answers), delta
    assert delta["urc_actual_cached_tokens"] == sum(a.cached for a in answers), delta
    assert delta["urc_predicted_cached_tokens"] == sum(a.matched for a in answers), delta
    error = abs(delta["urc_predicted_cached_tokens"] - delta["urc_actual_cached_tokens"])
    print(f"urc epp + Envoy + vLLM: {delta}, |predicted - actual| = {error}")  # docs/epp.md
    assert error <= 0.02 * delta["urc_prompt_tokens"], delta
