"""LoRA adapters in the pure core (docs/adapters.md): slots, loads, prices, exact keys."""

import pytest

from core.blocks import block_keys
from router.adapters import Adapters, adapter_group, base_group
from router.index import UnifiedIndex
from router.policies import CacheAwarePolicy, RouteRequest, WorkerLoad
from router.route import Routing

BS = 16


def test_groups_of_an_adapter():
    assert adapter_group("tiny", "sql") == "tiny+lora:sql"
    assert base_group("tiny+lora:sql") == "tiny"
    assert base_group("tiny") == "tiny"


def test_prices_active_loaded_and_not_loaded():
    adapters = Adapters(load_mb_per_s=100.0, load_s=0.5, max_loras=2, sizes={"a": 10.0})
    assert adapters.price("w0", "a", 0.0) == (0.5 + 0.1, 0.0)  # load + activation
    use = adapters.use("w0", "a", 0.0)
    assert use.started and use.ready_at == pytest.approx(0.6) and use.unloaded is None
    # while it loads, the next request for it waits for the same load
    assert adapters.price("w0", "a", 0.2).load_s == pytest.approx(0.4)
    assert adapters.use("w0", "a", 0.2).ready_at == pytest.approx(0.6)
    assert adapters.price("w0", "a", 1.0) == (0.0, 0.0)  # active
    adapters.observe("w1", ["a"], [], 2)  # loaded, not active: activation only
    assert adapters.price("w1", "a", 0.0).load_s == pytest.approx(0.1)


def test_a_full_slot_set_unloads_the_least_recently_used_idle_adapter():
    adapters = Adapters(load_mb_per_s=1000.0, load_s=0.0, max_loras=2)
    adapters.use("w0", "a", 0.0)
    adapters.use("w0", "b", 1.0)
    adapters.finish("w0", "b")  # a still has a request in flight, b has none
    price = adapters.price("w0", "c", 2.0)
    assert price.evict_s > 0  # b was asked for lately: its reload is priced
    use = adapters.use("w0", "c", 2.0)
    assert use.unloaded == "b"
    state = adapters.worker("w0")
    assert set(state.loaded) == set(state.active) == {"a", "c"}
    assert (state.loads, state.unloads) == (3, 1)
    adapters.observe("w0", ["c"], None, 4)  # what the worker says wins
    assert set(state.loaded) == {"c"} and state.max_loras == 4


def test_an_adapter_is_matched_only_against_its_own_group():
    """A prompt cached under adapter x is no hit for adapter y or the base."""
    index = UnifiedIndex()
    tokens = list(range(100, 100 + 8 * BS))
    keys = block_keys(tokens, BS)
    index.insert(keys, "w0", adapter_group("tiny", "x"), 0.0)
    routing = Routing(index, Adapters())
    loads = [WorkerLoad("w0"), WorkerLoad("w1")]
    policy = CacheAwarePolicy()
    for group, adapter, hit in (
        (adapter_group("tiny", "x"), "x", 7 * BS),
        (adapter_group("tiny", "y"), "y", 0),
        ("tiny", "", 0),
    ):
        request = RouteRequest(keys, len(tokens), BS, group, adapter or "tiny", adapter)
        route = routing.route(request, loads, policy, 1.0)
        assert route.matched("w0") == hit


def test_the_policy_prices_the_adapter_unless_blind():
    """Two idle workers, neither holding the prompt: the one with the adapter active wins;
    blind to adapters, the policy does not see the difference."""
    adapters = Adapters(load_mb_per_s=10.0, load_s=0.5)
    adapters.use("w1", "x", 0.0)
    adapters.finish("w1", "x")
    index = UnifiedIndex()
    tokens = list(range(4 * BS + 3))
    request = RouteRequest(block_keys(tokens, BS), len(tokens), BS, "tiny+lora:x", "x", "x")
    loads = [WorkerLoad("w0"), WorkerLoad("w1")]
    aware = Routing(index, adapters).route(request, loads, CacheAwarePolicy(), 100.0)
    assert aware.worker == "w1"
    costs = aware.decision.costs
    assert costs[0] - costs[1] == pytest.approx(0.5 + 64.0 / 10.0)
    blind = CacheAwarePolicy(adapter_aware=False)
    chosen = {
        Routing(index, adapters)
        .route(
            RouteRequest(
                block_keys(list(range(s, s + 4 * BS + 3)), BS),
                4 * BS + 3,
                BS,
                "tiny+lora:x",
                "x",
                "x",
            ),
            loads,
            blind,
            100.0,
        )
        .worker
        for s in range(0, 4000, 100)
    }
    assert chosen == {"w0", "w1"}  # it spreads new prompts as if loads cost nothing
