"""A rollout on real processes (docs/rollouts.md): emulated workers and gateways on 127.0.0.1,
multi-turn conversations with their session header. Three replicas choose the arm the pure
function chooses for every session, every turn on one arm, named in `x-urc-route`; round robin
against cache_aware rolls back at its first step and an equal candidate advances to 100 % (the
plans of tests/simulation/test_rollout_replay.py, whose replay decides the same); a model alias
at 90/10 keeps the fleet's hit rate within 2 points; the shared trace sent live rolls round robin
back as its replay does. Waits are bounded; nothing is timed."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from backends.emulated.config import EngineConfig
from router.rollout import ARMS, Rollout, conversation_key
from router.rollout_plan import RolloutPlan
from simulation.replay import FleetConfig
from simulation.rollout import replay_rollout
from simulation.traces import read_trace, trace_requests
from tests.gateway import ADMIN, all_exact, route
from tests.processes import wait_for
from urc.processes import ROOT, Child, start_gateway, start_worker

pytestmark = pytest.mark.timeout(600)
SYSTEM = "You answer questions about the fleet. " * 8  # ~300 byte tokens, shared by all
PLAN = ["--rollout-steps", "20,50,100", "--rollout-dwell", "2", "--rollout-min-requests", "60"]
PLAN += ["--rollout-error-rate-margin", "0.05"]  # 60 requests without an error pass 5 points


# the shared trace at 10x its speed on 4 workers with room for its prefixes and 10x the prefill
# speed (so the speed-up does not saturate them): the same settings live and in the replay
TRACE = ROOT / "traces" / "mooncake_synthetic_trace.jsonl"
TRACE_SPEED = 0.1
# its first 73 s at TRACE_SPEED: the replay rolls back at 48 s, the rest only takes time
TRACE_REQUESTS = 2800
TRACE_ENGINE = {"prefill_tokens_per_s": 150_000.0, "capacity_tokens": 4_000_000}
TRACE_PLAN = {"steps": "25,100", "dwell_s": 12.0, "min_requests": 100, "hit_rate_margin": 0.15}
TRACE_PLAN |= {"ttft_p50_margin": 2.0, "ttft_p99_margin": 2.0}


def rollout_state(url: str) -> dict:
    return httpx.get(f"{url}/admin/rollout", headers=ADMIN, timeout=5).json()


class Conversations:
    """Sessions of chat turns, each turn the history + the answer + a new question, sent with
    `x-urc-session`; `urls` take turns by session and turn (several replicas: each turn of a
    session may reach another one)."""

    def __init__(self, urls: list[str], model: str = "emulated", tag: str = "") -> None:
        self.urls = urls
        self.model = model
        self.tag = tag
        self.arms: dict[str, set[str]] = {}
        self.tokens = [0, 0]  # prompt, cached (the workers' usage)
        self.statuses: list[int] = []
        self.lock = threading.Lock()

    def session(self, s: int, turns: int, client: httpx.Client) -> None:
        sid = f"{self.tag}s{s}"
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(turns):
            question = f"{self.tag} question {turn} of session {s}: " + "what next? " * 4
            messages.append({"role": "user", "content": question})
            url = self.urls[(s + turn) % len(self.urls)]
            body = {"model": self.model, "messages": messages, "max_tokens": 8}
            r = client.post(f"{url}/v1/chat/completions", json=body, headers={"x-urc-session": sid})
            with self.lock:
                self.statuses.append(r.status_code)
            if r.status_code != 200:
                return
            usage = r.json()["usage"]
            with self.lock:
                self.arms.setdefault(sid, set()).add(route(r).get("arm", "-"))
                self.tokens[0] += usage["prompt_tokens"]
                self.tokens[1] += usage["prompt_tokens_details"]["cached_tokens"]
            answer = r.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})

    def run(self, sessions: range, turns: int, until: Callable[[], bool] | None = None) -> None:
        """`sessions`, 8 at a time, until they are done or `until()` says so."""
        with httpx.Client(timeout=30) as client, cf.ThreadPoolExecutor(8) as pool:
            futures = []
            for s in sessions:
                if until is not None and until():
                    break
                futures.append(pool.submit(self.session, s, turns, client))
                if len(futures) >= 8:
                    futures.pop(0).result()
            for f in futures:
                f.result()

    @property
    def hit_rate(self) -> float:
        return self.tokens[1] / self.tokens[0]


def fleet(n: int, *gateway_args: str, replicas: int = 1) -> tuple[list[Child], list[Child]]:
    workers = [start_worker() for _ in range(n)]
    urls = [w.url for w in workers]
    args = ("--admin-key", "admin-secret", *gateway_args)
    gateways = [start_gateway(urls, *args) for _ in range(replicas)]
    for g in gateways:
        assert wait_for(lambda g=g: all_exact(g.url, n), 20), g.lines[-20:]
    return workers, gateways


def stop(*groups: list[Child]) -> None:
    for group in groups:
        for child in group:
            child.stop()


def test_three_replicas_put_every_turn_of_a_session_on_the_arm_the_hash_says():
    plan = ["--rollout-policy", "round_robin", "--rollout-steps", "10,100"]
    workers, gateways = fleet(2, *plan, "--rollout-dwell", "3600", replicas=3)
    try:
        talk = Conversations([g.url for g in gateways])
        talk.run(range(150), turns=3)  # each turn of a session on the next replica
        assert talk.statuses.count(200) == len(talk.statuses) == 450
        assert all(len(arms) == 1 for arms in talk.arms.values())
        expected = Rollout(RolloutPlan(policy="round_robin", steps="10,100"), 0.0)
        for sid, arms in talk.arms.items():
            arm = expected.place(conversation_key("default", sid, None, b"")).arm
            assert arms == {ARMS[arm]}, sid
        candidates = sum(arms == {"candidate"} for arms in talk.arms.values())
        assert 5 <= candidates <= 30  # 10 % of 150 (the share itself: 2,000 ids, unit tests)
        states = [rollout_state(g.url) for g in gateways]
        assert all(s["state"] == "running" and s["share_percent"] == 10 for s in states)
    finally:
        stop(gateways, workers)


def test_round_robin_rolls_back_at_its_first_step_with_the_reason_logged_and_counted():
    workers, gateways = fleet(3, "--rollout-policy", "round_robin", *PLAN)
    url = gateways[0].url
    try:
        talk = Conversations([url])
        ended = lambda: rollout_state(url)["state"] != "running"  # noqa: E731
        talk.run(range(400), turns=5, until=ended)
        assert wait_for(ended, 10)
        state = rollout_state(url)
        assert state["state"] == "rolled_back" and state["share_percent"] == 0
        rollback = state["events"][-1]
        assert rollback["kind"] == "rolled_back" and rollback["step"] == 0
        assert "worse" in rollback["reason"]
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'urc_rollout_events_total{kind="rolled_back"} 1.0' in metrics
        assert 'urc_rollout_state{state="rolled_back"} 1.0' in metrics
        assert any("rolled_back at step 0" in line for line in gateways[0].lines)
        after = Conversations([url], tag="after")
        after.run(range(8), turns=1)
        assert after.arms and all(a == {"-"} for a in after.arms.values())  # no arm any more
    finally:
        stop(gateways, workers)


def test_an_equal_candidate_advances_through_every_step_to_100_percent():
    margins = ["--rollout-ttft-p50-margin", "3", "--rollout-ttft-p99-margin", "5"]
    workers, gateways = fleet(3, "--rollout-policy", "cache_aware", *PLAN, *margins)
    url = gateways[0].url
    try:
        talk = Conversations([url])
        done = lambda: rollout_state(url)["state"] != "running"  # noqa: E731
        talk.run(range(3000), turns=4, until=done)
        state = rollout_state(url)
        assert state["state"] == "complete", (state["holding"], state["guardrails"])
        assert [e["share"] for e in state["events"]] == [20, 50, 100]
        assert set(talk.statuses) == {200}
    finally:
        stop(gateways, workers)


def test_a_model_alias_at_90_10_keeps_the_hit_rate_within_2_points(tmp_path: Path):
    v1 = [start_worker("--model", "chat-v1") for _ in range(2)]
    v2 = [start_worker("--model", "chat-v2")]
    config = tmp_path / "gateway.toml"
    config.write_text('[[models]]\nname = "chat-v1"\naliases = ["chat"]\n')
    urls = [w.url for w in v1 + v2]
    rates = {}
    try:
        # the same traffic to chat-v1 alone, then to the alias split 90/10 (each arm's worker
        # is asked for its own model: ours do not know the alias)
        for tag, extra in (("plain", ()), ("split", ("--rollout-model", "chat-v2"))):
            args = ["--config", str(config), "--admin-key", "admin-secret", *extra]
            if extra:
                args += ["--rollout-alias", "chat", "--rollout-steps", "10"]
            gateway = start_gateway(urls, *args)
            try:
                assert wait_for(lambda g=gateway: all_exact(g.url, 3), 20)
                talk = Conversations([gateway.url], "chat" if extra else "chat-v1", tag)
                talk.run(range(120), turns=4)
                assert set(talk.statuses) == {200}
                rates[tag] = talk.hit_rate
                if extra:
                    candidates = sum(a == {"candidate"} for a in talk.arms.values())
                    assert 4 <= candidates <= 24  # 10 % of 120 sessions
            finally:
                gateway.stop()
        assert abs(rates["split"] - rates["plain"]) <= 0.02, rates
    finally:
        stop(v1, v2)


def flags(settings: dict, prefix: str = "") -> list[str]:
    """The flags of `settings` (`prefix` "rollout-": the gateway's --rollout-*)."""
    out = []
    for name, value in settings.items():
        flag = name.removesuffix("_s") if name == "dwell_s" else name
        out += [f"--{prefix}{flag.replace('_', '-')}", str(value)]
    return out


def test_the_replay_of_the_shared_trace_decides_as_the_live_run():
    """Round robin against cache_aware under one plan: rolled back at its first step, live (the
    trace sent by `urc bench` at its timestamps) and in the replay (virtual time)."""
    trace = read_trace(TRACE)
    engine = EngineConfig(block_size=trace.block_size, **TRACE_ENGINE)  # type: ignore[arg-type]
    plan = RolloutPlan(policy="round_robin", **TRACE_PLAN)  # type: ignore[arg-type]
    requests = trace_requests(trace, time_scale=TRACE_SPEED)[:TRACE_REQUESTS]
    _, replayed = replay_rollout(requests, "cache_aware", plan, FleetConfig(4, engine=engine), {})
    workers = [start_worker(*flags(TRACE_ENGINE)) for _ in range(4)]
    gateway = start_gateway(
        [w.url for w in workers],
        "--admin-key",
        "admin-secret",
        *flags(TRACE_PLAN, "rollout-"),
        "--rollout-policy",
        "round_robin",
    )
    try:
        assert wait_for(lambda: all_exact(gateway.url, 4), 20)
        bench = [sys.executable, "-m", "urc.cli", "bench", "--target", gateway.url, "--trace"]
        bench += [str(TRACE), "--time-scale", str(TRACE_SPEED), "--requests", str(TRACE_REQUESTS)]
        bench += ["--no-progress"]
        done = subprocess.run(bench, capture_output=True, text=True, timeout=400, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        live = rollout_state(gateway.url)
    finally:
        stop([gateway], workers)
    decided = [(e["kind"], e["step"], e["share"]) for e in replayed["events"]]
    assert decided == [("started", 0, 25), ("rolled_back", 0, 0)]
    assert [(e["kind"], e["step"], e["share"]) for e in live["events"]] == decided
    assert live["events"][-1]["reason"].startswith("hit_rate worse")
    assert replayed["events"][-1]["reason"].startswith("hit_rate worse")


def test_the_admin_api_starts_pauses_promotes_and_aborts_with_4xx_for_what_it_cannot():
    workers, gateways = fleet(1)
    url = gateways[0].url
    act = lambda body, **kw: httpx.post(f"{url}/admin/rollout", json=body, timeout=5, **kw)  # noqa: E731
    try:
        assert rollout_state(url) == {"state": "none"}
        assert act({"action": "pause"}, headers=ADMIN).status_code == 409
        assert act({"action": "start", "policy": "round_robin"}).status_code == 401
        bad = act({"action": "start", "policy": "round_robin", "steps": "50,10"}, headers=ADMIN)
        assert bad.status_code == 400 and "rise" in bad.json()["error"]["message"]
        typo = act({"action": "start", "policy": "round_robin", "stepz": "5"}, headers=ADMIN)
        assert typo.status_code == 400 and "stepz" in typo.json()["error"]["message"]
        assert act({"action": "jump"}, headers=ADMIN).status_code == 400
        started = act({"action": "start", "policy": "round_robin", "steps": "5,100"}, headers=ADMIN)
        assert started.status_code == 200 and started.json()["share_percent"] == 5
        assert act({"action": "pause"}, headers=ADMIN).json()["state"] == "paused"
        assert act({"action": "resume"}, headers=ADMIN).json()["state"] == "running"
        promoted = act({"action": "promote"}, headers=ADMIN).json()
        assert promoted["state"] == "complete" and promoted["share_percent"] == 100
        talk = Conversations([url])
        talk.run(range(4), turns=1)
        assert all(a == {"candidate"} for a in talk.arms.values())  # complete: all candidate
        assert act({"action": "abort"}, headers=ADMIN).status_code == 409  # it has ended
        act({"action": "start", "policy": "least_load", "steps": "50,100"}, headers=ADMIN)
        aborted = act({"action": "abort"}, headers=ADMIN).json()
        assert aborted["state"] == "aborted" and aborted["share_percent"] == 0
        kinds = [e["kind"] for e in rollout_state(url)["events"]]
        assert kinds == ["started", "aborted"]
    finally:
        stop(gateways, workers)
