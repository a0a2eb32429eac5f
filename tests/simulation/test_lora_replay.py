"""The replay of many LoRA adapters (docs/adapters.md): the emulated engines' slots, loads
counted in TTFT, exact keys per adapter, adapter-aware placement against the same policy blind
to adapters."""

from backends.emulated.config import EngineConfig
from backends.emulated.request import tail_keys
from core.blocks import DEFAULT_BLOCK_SIZE, block_keys
from router.adapters import adapter_group
from router.policies import RouteRequest, make_policy
from simulation.compare import build_params, run_policy
from simulation.replay import FleetConfig
from simulation.requests import SimRequest, cache_salt
from simulation.workloads import workload_requests


def _run(aware: bool, requests, fleet):
    params = build_params("cache_aware", {}, fleet, 0)
    policy = make_policy("cache_aware", params, adapter_aware=aware)
    return run_policy("cache_aware", requests, policy, fleet).result


def test_adapter_aware_placement_loads_less_and_answers_sooner():
    requests = workload_requests(
        "lora", 1500, models=["emulated"], rate=20.0, params={"adapters": 40, "prefix_tokens": 500}
    )
    assert {r.route.kv_group.partition("+lora:")[0] for r in requests} == {"emulated"}
    assert len({r.route.adapter for r in requests}) > 20
    engine = EngineConfig(max_loras=4, lora_load_gbps=1.0)  # an activation: 84 ms
    fleet = FleetConfig(workers=4, engine=engine)
    aware, blind = _run(True, requests, fleet), _run(False, requests, fleet)
    for result in (aware, blind):
        assert all(result.ok)
        # exact keys per adapter: predictions are the cached tokens the engine reports, but
        # for a few prompts another request cached while they waited for their adapter's load
        pairs = zip(result.predicted_tokens, result.cached_tokens, strict=True)
        assert sum(p != c for p, c in pairs) <= len(requests) // 100
        assert result.adapters["loads"] >= len({r.route.adapter for r in requests}) // 4
    assert aware.adapters["loads"] < blind.adapters["loads"]
    p99 = [sorted(r.ttft_s)[int(0.99 * len(r.ttft_s))] for r in (aware, blind)]
    assert p99[0] < p99[1]  # virtual time: each load counts in its request's TTFT


def _request(i: int, tokens: list[int], adapter: str, at: float) -> SimRequest:
    group = adapter_group("emulated", adapter)
    salt = cache_salt(None, "emulated", True)
    keys = block_keys(tokens, DEFAULT_BLOCK_SIZE, salt, lora=adapter)
    tail = tail_keys(tokens, keys, 4, DEFAULT_BLOCK_SIZE, salt, adapter)
    route = RouteRequest(keys, len(tokens), DEFAULT_BLOCK_SIZE, group, adapter, adapter)
    return SimRequest(i, at, tokens, 4, keys, tail, route, salt)


def test_a_prompt_under_one_adapter_is_no_hit_for_another():
    """The same prompt under adapters x, y, then x again: only x's second request hits."""
    tokens = list(range(40, 40 + 10 * DEFAULT_BLOCK_SIZE))
    requests = [_request(i, tokens, a, i * 1.0) for i, a in enumerate(("x", "y", "x", "y"))]
    result = _run(True, requests, FleetConfig(workers=2, engine=EngineConfig(max_loras=2)))
    assert result.predicted_tokens == result.cached_tokens
    assert result.cached_tokens[:2] == [0, 0]
    assert result.cached_tokens[2] == result.cached_tokens[3] == 9 * DEFAULT_BLOCK_SIZE
    assert result.adapters == {"loads": 2, "evictions": 0, "unloads": 0}  # once each, kept
