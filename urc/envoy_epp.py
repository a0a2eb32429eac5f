"""An Envoy config in front of workers with `urc epp` choosing the endpoint, as the Gateway
API Inference Extension's reference gateways wire it (docs/epp.md): the `ext_proc` filter
asks the EPP, then the upstream is the endpoint it named."""

from __future__ import annotations

from collections.abc import Sequence

from router.epp import protocol
from urc.envoy import RETRY_HEADROOM, address, front_listener, static_endpoints

_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_H2 = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_OVERRIDE = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3"
_RR = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
DESTINATION = protocol.DESTINATION


def epp_envoy_config(
    port: int,
    admin_port: int,
    epp_port: int,
    workers: Sequence[int] = (),
    body_mode: str = "FULL_DUPLEX_STREAMED",
    response_headers: bool = False,
) -> dict:
    """No `workers`: an ORIGINAL_DST cluster that connects wherever the EPP's header says
    (GIE's simplest wiring; no fallback on failure). With `workers` (their ports): a STATIC
    cluster under Envoy's `override_host` load balancer, which takes the EPP's endpoint list
    from the `envoy.lb` metadata and tries the next one on a retry (the failover).
    `body_mode`: the request body's (FULL_DUPLEX_STREAMED or BUFFERED); `response_headers`:
    the EPP answers the response's headers itself, else Envoy adds its headers (docs/epp.md,
    "Envoy")."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": _ext_proc(body_mode, response_headers),
    }
    retry = {"retry_on": "connect-failure,refused-stream,reset", "num_retries": 3}
    route = {"cluster": "workers", "timeout": "600s", "retry_policy": retry}
    epp = {
        "name": "epp",
        "connect_timeout": "1s",
        "type": "STATIC",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _H2,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": static_endpoints("epp", [epp_port]),
    }
    upstream = _workers_cluster(workers)
    upstream["circuit_breakers"] = RETRY_HEADROOM
    return {
        "admin": {"address": address(admin_port)},
        "static_resources": {
            "listeners": [front_listener(port, route, [ext_proc], _answer(response_headers))],
            "clusters": [epp, upstream],
        },
    }


def _ext_proc(body_mode: str, response_headers: bool) -> dict:
    """The ext_proc filter's config: the EPP sees the request's headers and body (`body_mode`)
    and the answer's body (and headers: `response_headers`). FULL_DUPLEX_STREAMED: the request's
    headers and body go out together, and the EPP answers both once it has the body."""
    duplex = body_mode == "FULL_DUPLEX_STREAMED"
    # the response's headers answered by the EPP: its body streams through it as the request's
    both_ways = duplex and response_headers
    return {
        "@type": _EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
        "failure_mode_allow": False,
        "message_timeout": "5s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": body_mode,
            "request_trailer_mode": "SEND" if duplex else "SKIP",
            "response_header_mode": "SEND" if response_headers else "SKIP",
            # usage (cached_tokens) is read from the answer as it passes
            "response_body_mode": "FULL_DUPLEX_STREAMED" if both_ways else "STREAMED",
            "response_trailer_mode": "SEND" if both_ways else "SKIP",
        },
        "metadata_options": {
            "receiving_namespaces": {"untyped": [protocol.LB_NAMESPACE, protocol.ANSWER_NAMESPACE]}
        },
        # only the request headers the EPP reads: fewer to encode, send and parse
        "forward_rules": {
            "allowed_headers": {"patterns": [{"exact": h} for h in protocol.READ_HEADERS]}
        },
        # the response's headers skipped: its status comes with its first body message
        "response_attributes": [] if response_headers else [protocol.STATUS_ATTRIBUTE],
        # the response's first body chunk goes out with its headers, not after their answer
        "send_body_without_waiting_for_header_response": True,
    }


def _answer(response_headers: bool) -> list[dict]:
    """The EPP's headers for the response (x-urc-route, x-ratelimit-*), from the dynamic
    metadata it set with its pick, when it does not answer the response's headers itself (an
    absent value adds no header)."""
    if response_headers:
        return []
    namespace = protocol.ANSWER_NAMESPACE
    return [
        {
            "header": {"key": name, "value": f"%DYNAMIC_METADATA({namespace}:{name})%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
        for name in protocol.ANSWER_HEADERS
    ]


def _workers_cluster(workers: Sequence[int]) -> dict:
    """The upstream the EPP's endpoint names: ORIGINAL_DST, or `workers` under override_host."""
    if not workers:
        return {
            "name": "workers",
            "connect_timeout": "1s",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    source = {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}}
    rr = {"typed_extension_config": {"name": "rr", "typed_config": {"@type": _RR}}}
    override = {
        "@type": f"{_OVERRIDE}.OverrideHost",
        "override_host_sources": [source, {"header": DESTINATION}],
        "fallback_policy": {"policies": [rr]},
    }
    policy = {"typed_extension_config": {"name": "override_host", "typed_config": override}}
    return {
        "name": "workers",
        "connect_timeout": "1s",
        "type": "STATIC",
        "load_balancing_policy": {"policies": [policy]},
        "load_assignment": static_endpoints("workers", workers),
    }
