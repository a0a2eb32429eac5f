"""How a worker describes its KV-event streams in /urc/info."""

from __future__ import annotations

from aiohttp import web

from core.kv_publisher import KVEventPublisher

KV_TOPIC = "kv"
_ANY_HOST = ("0.0.0.0", "::", "*", "")


def reachable_endpoint(endpoint: str | None, request: web.Request) -> str | None:
    """A bound ZMQ endpoint as a client can reach it (a wildcard host: the one it asked)."""
    if endpoint is None:
        return None
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host.strip("[]") in _ANY_HOST:
        host = request.url.host or "127.0.0.1"
    return f"{scheme}://{host}:{port}"


def events_document(publisher: KVEventPublisher, request: web.Request) -> dict[str, str | None]:
    return {
        "endpoint": reachable_endpoint(publisher.endpoint, request),
        "replay_endpoint": reachable_endpoint(publisher.replay_endpoint, request),
        "topic": KV_TOPIC,
    }
