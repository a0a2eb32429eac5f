"""A response to a request routed before an admin invalidation does not bring back the
approximate residency that the invalidation dropped (workers without KV events)."""

from __future__ import annotations

from types import SimpleNamespace

from router.gateway.app import Gateway
from router.gateway.config import GatewayConfig

KEYS = [11, 12, 13]


def served(gateway: Gateway, arrived: float) -> None:
    model = SimpleNamespace(name="m", kv_group="m")
    plan = SimpleNamespace(model=model, keys=KEYS, arrived=arrived)
    worker = SimpleNamespace(name="w", models={"m": "m"}, exact=lambda _group: False)
    gateway._served(plan, worker, None, "default")  # type: ignore[arg-type]


async def test_a_response_in_flight_during_an_invalidation_records_nothing():
    gateway = Gateway(GatewayConfig())
    gateway.invalidated_at = 100.0  # an invalidation began at 100 s (monotonic)
    served(gateway, 99.0)  # routed before it, answered after
    assert gateway.index.match(KEYS, "m") == {}
    served(gateway, 101.0)  # routed after it: recorded as usual
    assert gateway.index.match(KEYS, "m") == {"w": 3}
