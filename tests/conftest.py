"""Fixtures every test package shares: a gateway in front of emulated workers, on real
processes bound to 127.0.0.1, stopped when the test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from tests.gateway import all_exact
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

Fleet = tuple[Child, list[Child]]


@pytest.fixture
def start_fleet() -> Iterator[Callable[..., Fleet]]:
    """`start_fleet(n, *worker_args, gateway_args=...)`: n workers and a gateway over them,
    returned once the gateway sees all n exact (it needs `--admin-key admin-secret` for that,
    added unless `gateway_args` names an admin key)."""
    fleets: list[tuple[Child | None, list[Child]]] = []

    def start(n: int, *worker_args: str, gateway_args: Sequence[str] = ()) -> Fleet:
        workers: list[Child] = []
        fleets.append((None, workers))  # stopped even if the gateway does not come up
        workers += [start_worker(*worker_args) for _ in range(n)]
        admin = () if "--admin-key" in gateway_args else ("--admin-key", "admin-secret")
        gateway = start_gateway([w.url for w in workers], *admin, *gateway_args)
        fleets[-1] = (gateway, workers)
        assert wait_for(lambda: all_exact(gateway.url, n), 20), gateway.lines[-20:]
        return gateway, workers

    yield start
    # the workers' list as the test left it: a worker it replaced is the one stopped
    for gateway, workers in fleets:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()
