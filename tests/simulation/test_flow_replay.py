"""Flow control in the replay (docs/flow-control.md, "In the replay"): the gateway's admission on
the virtual clock. Virtual time is deterministic, so the replay's TTFTs compare exactly."""

import json
import math
from dataclasses import replace

import pytest

from router.admission import FlowSettings
from simulation.cli import main
from simulation.compare import compare
from simulation.flow import FlowConfig, parse_tenant_flow
from simulation.replay import FleetConfig
from simulation.requests import SimRequest
from simulation.workloads import workload_requests


def _summary(
    requests: list[SimRequest], flow: FlowConfig | None, workers: int = 2, concurrency=None
) -> dict:
    fleet = FleetConfig(workers=workers, concurrency=concurrency)
    return compare(requests, ["cache_aware"], fleet, flow=flow).runs["cache_aware"].summary


@pytest.fixture(scope="module")
def flood() -> list[SimRequest]:
    """The quiet tenant (15 %) beside a flood of 5k-token prompts at twice two workers'
    prefill capacity (12 requests/s of which ~10 are 5k tokens; two workers prefill ~6/s)."""
    return workload_requests("noisy-neighbour", 600, rate=12)


def test_the_quiet_tenant_is_served_ahead_of_the_flood(flood):
    off = _summary(flood, None)
    on = _summary(flood, FlowConfig())
    quiet = [r for r in flood if r.tenant == "quiet"]
    alone = _summary([replace(r, index=j) for j, r in enumerate(quiet)], None)
    alone = alone["tenants"]["quiet"]
    quiet_off, quiet_on = off["tenants"]["quiet"], on["tenants"]["quiet"]
    assert alone["ttft_p99_s"] < 0.05  # its prompts hit the cache: a short prefill
    assert quiet_off["ttft_p99_s"] > 20.0  # behind every worker's FIFO queue of the flood
    # queued in the gateway while the pool is saturated, the flood charged its uncached work:
    # the quiet tenant waits for one engine step or two (8,192-token chunks at 15k tokens/s)
    assert quiet_on["ttft_p99_s"] < 1.5
    assert quiet_on["ttft_p99_s"] < quiet_off["ttft_p99_s"] / 20
    assert quiet_on["completed"] == quiet_on["requests"] and quiet_on["refused"] == 0
    # the flood keeps most of the capacity: it waits in the gateway, what waits 30 s is refused,
    # and on the worker the quiet tenant uses its steps stay short (the step budget's price)
    flood_on = on["tenants"]["flood"]
    assert flood_on["completed"] > 0.6 * flood_on["requests"]
    assert on["refused"] == {"queue_timeout": flood_on["refused"]}
    assert flood_on["ttft_p99_s"] <= 30.0 + 2.0


def test_the_protect_hint_leaves_only_the_floods_start_in_the_quiet_tail(flood):
    """Without the hint, a quiet request after a gap longer than its worker's 1 s window meets
    a full 8,192-token chunk (0.55 s); with it, only the flood's first second does (its requests
    at priority 0 before it is ahead of its share)."""

    def slow(window_s: float) -> list[float]:
        flow = FlowConfig(FlowSettings(enabled=True, protect_window_s=window_s))
        fleet = FleetConfig(workers=2)
        result = compare(flood, ["cache_aware"], fleet, flow=flow).runs["cache_aware"].result
        return [
            result.sent_s[i]
            for i, r in enumerate(flood)
            if r.tenant == "quiet" and result.ttft_s[i] > 0.25
        ]

    without, with_hint = slow(0.0), slow(10.0)
    assert len(without) > len(with_hint) and max(without) > 5.0
    assert with_hint and max(with_hint) < 2.0


def test_no_request_is_lost(flood):
    """Every request completes or is refused, by reason: queue timeouts and a full queue."""
    settings = FlowSettings(enabled=True, queue_max=50, queue_timeout_s=4.0)
    on = _summary(flood, FlowConfig(settings))
    refused = on["refused"]
    assert set(refused) == {"queue_full", "queue_timeout"}
    assert on["completed"] + sum(refused.values()) == on["requests"] == len(flood)
    assert on["rejected"] == on["dropped"] == 0
    rows = on["tenants"].values()
    assert sum(r["completed"] + r["refused"] for r in rows) == len(flood)


def test_no_request_is_lost_in_a_closed_loop():
    """Closed loop: a refused request frees its client's slot at the virtual time it ends."""
    requests = workload_requests("noisy-neighbour", 300)
    settings = FlowSettings(enabled=True, queue_timeout_s=1.0, saturation_ms=200.0)
    on = _summary(requests, FlowConfig(settings), concurrency=32)
    assert on["refused"]["queue_timeout"] > 0
    assert on["completed"] + on["refused"]["queue_timeout"] == len(requests)


def test_a_tokens_per_minute_budget_limits_its_tenant_in_virtual_time():
    """The flood sends about twice its budget (3.4 requests/s of 5k tokens, ~1M tokens a
    minute, against 500k): it gets its budget in each minute, the quiet tenant all it asks."""
    requests = workload_requests("noisy-neighbour", 720, rate=4)
    tpm = 500_000
    flow = FlowConfig(tenants=[parse_tenant_flow(f"flood:tokens_per_minute={tpm}")])
    on = _summary(requests, flow)
    assert set(on["refused"]) == {"tokens_per_minute"}
    quiet = on["tenants"]["quiet"]
    assert quiet["completed"] == quiet["requests"] and quiet["refused"] == 0
    minutes = max(r.arrival_s or 0.0 for r in requests) / 60  # the arrivals span ~3 minutes
    sizes = [len(r.prompt) + r.max_tokens for r in requests if r.tenant == "flood"]
    assert len(set(sizes)) == 1  # its prompt (5k tokens and the chat template), its output
    assert sum(sizes) / minutes > 1.8 * tpm  # it asks for twice its budget
    granted = on["tenants"]["flood"]["completed"] * sizes[0]
    assert 0.9 * tpm * math.floor(minutes) < granted <= tpm * math.ceil(minutes)


def test_flow_control_that_never_binds_changes_nothing():
    """No budget, a threshold no queue reaches: every request goes at once, at priority 0, so
    the replay is the one without flow control, request by request."""
    requests = workload_requests("system-prompts", 300, rate=40)
    fleet = FleetConfig(workers=4)
    settings = FlowSettings(enabled=True, saturation_ms=1e9)
    off = compare(requests, ["cache_aware"], fleet).runs["cache_aware"]
    on = compare(requests, ["cache_aware"], fleet, flow=FlowConfig(settings)).runs["cache_aware"]
    assert on.result.ttft_s == off.result.ttft_s
    assert on.result.worker == off.result.worker
    assert on.result.cached_tokens == off.result.cached_tokens
    assert on.summary == off.summary


def test_the_cli_reports_per_tenant_numbers(tmp_path):
    out = tmp_path / "report.json"
    args = ["--workload", "noisy-neighbour", "--rate", "12", "--workers", "2"]
    args += ["--requests", "200", "--policy", "round_robin", "--json", str(out)]
    args += ["--flow-control", "--flow-queue-timeout", "4"]
    args += ["--tenant-flow", "flood:weight=0.5,priority=0,max_concurrent_requests=64"]
    assert main(args) == 0
    report = json.loads(out.read_text())
    flow = report["config"]["flow"]
    assert flow["queue_timeout_s"] == 4.0
    assert flow["tenants"]["flood"]["weight"] == 0.5
    run = report["policies"]["round_robin"]
    assert set(run["tenants"]) == {"quiet", "flood"}
    refused = sum(run["refused"].values())
    assert run["completed"] + refused == 200


def test_bad_tenant_flow_flags_are_refused(capsys):
    base = ["--workload", "noisy-neighbour", "--requests", "10"]
    assert main([*base, "--tenant-flow", "flood:weight=2"]) == 2
    assert "--tenant-flow needs --flow-control" in capsys.readouterr().err
    assert main([*base, "--flow-control", "--tenant-flow", "flood:rpm=2"]) == 2
    assert "requests_per_minute" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positive"):
        parse_tenant_flow("flood:weight=0")
