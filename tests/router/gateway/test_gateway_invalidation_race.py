"""A response to a request routed before an admin invalidation does not bring back the
approximate residency that the invalidation dropped (workers without KV events)."""

from __future__ import annotations

from router.gateway.app import Gateway
from router.gateway.config import GatewayConfig
from router.policies import Candidate, Decision, RouteRequest
from router.route import Route

KEYS = [11, 12, 13]


def served(gateway: Gateway, arrived: float) -> None:
    """A request routed at `arrived` answered by "w", a worker without KV events."""
    request = RouteRequest(KEYS, 48, 16, "m", "m")
    decision = Decision("w", "cache_hit", request, [Candidate("w", 0)], [0.0])
    Route(gateway.routing, decision, arrived).done("w", "m", False, arrived + 1.0)


async def test_a_response_in_flight_during_an_invalidation_records_nothing():
    gateway = Gateway(GatewayConfig())
    gateway.routing.invalidated_at = 100.0  # an invalidation began at 100 s (monotonic)
    served(gateway, 99.0)  # routed before it, answered after
    assert gateway.index.match(KEYS, "m") == {}
    served(gateway, 101.0)  # routed after it: recorded as usual
    assert gateway.index.match(KEYS, "m") == {"w": 3}
