"""A response to a request routed before an admin invalidation does not bring back the
approximate residency that the invalidation dropped (workers without KV events)."""

from __future__ import annotations

from core.tokenizer import ByteTokenizer
from router.gateway.app import Gateway
from router.gateway.config import GatewayConfig, WorkerConfig
from router.gateway.fleet import Model, Worker
from router.gateway.proxy import Usage
from router.gateway.routing import Plan
from router.gateway.upstream import UpstreamPool
from router.policies import Candidate, Decision, RouteRequest

KEYS = [11, 12, 13]


def served(gateway: Gateway, arrived: float) -> None:
    model = Model("m", "m", ByteTokenizer(), 16)
    url = "http://127.0.0.1:1"
    pool = UpstreamPool("127.0.0.1", 1)
    worker = Worker("w", url, WorkerConfig(url=url), pool, models={"m": "m"})  # no KV events
    request = RouteRequest(KEYS, 48, 16, "m", "m")
    decision = Decision("w", "cache_hit", request, [Candidate("w", 0)], [0.0])
    plan = Plan(model, decision, [worker], 0.0, arrived, "test")
    gateway._served(plan, worker, Usage(None, None), "default")


async def test_a_response_in_flight_during_an_invalidation_records_nothing():
    gateway = Gateway(GatewayConfig())
    gateway.residency.invalidated_at = 100.0  # an invalidation began at 100 s (monotonic)
    served(gateway, 99.0)  # routed before it, answered after
    assert gateway.index.match(KEYS, "m") == {}
    served(gateway, 101.0)  # routed after it: recorded as usual
    assert gateway.index.match(KEYS, "m") == {"w": 3}
