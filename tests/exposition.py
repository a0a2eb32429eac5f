"""What the metrics tests read: a gateway and one of its two emulated workers scraped after a
few requests (streamed and not), and the names an exposition exports."""

from __future__ import annotations

from typing import NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway import all_exact
from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

# the sample names of a family, by its type (the parser drops a counter's `_total`)
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


class Scrapes(NamedTuple):
    gateway: str
    worker: str


class Family(NamedTuple):
    type: str
    help: str


def families(text: str) -> dict[str, Family]:
    """Family name as exposed (a counter with `_total`) -> its type and HELP."""
    found = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        found[name] = Family(family.type, family.documentation)
    return found


def sample_names(text: str) -> set[str]:
    """Every sample name a query may select, a family with no samples yet included."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def _send(gateway: str, model: str) -> None:
    prompt = "a prefix both requests share " * 20
    with httpx.Client(base_url=gateway, timeout=30) as client:
        for i in range(2):  # the second finds the first's blocks cached
            body = {"model": model, "prompt": f"{prompt} {i}", "max_tokens": 4}
            assert client.post("/v1/completions", json=body).status_code == 200
            chat = {
                "model": model,
                "messages": [{"role": "user", "content": f"{prompt} {i}"}],
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with client.stream("POST", "/v1/chat/completions", json=chat) as streamed:
                assert streamed.status_code == 200 and b"[DONE]" in streamed.read()


def scrape_fleet() -> Scrapes:
    """A gateway over two emulated workers, a few requests, one scrape of each side."""
    children: list[Child] = []
    try:
        children += [start_worker() for _ in range(2)]
        workers = [w.url for w in children]
        # flow control on (an unsaturated pool: it changes no answer) for its metrics too
        gateway = start_gateway(workers, "--admin-key", "admin-secret", "--flow-control")
        children.append(gateway)
        assert wait_for(lambda: all_exact(gateway.url, 2), 20), gateway.lines[-20:]
        model = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()["data"][0]["id"]
        _send(gateway.url, model)
        scrape = httpx.get(f"{gateway.url}/metrics", timeout=5)
        worker = httpx.get(f"{workers[0]}/metrics", timeout=5)
        assert scrape.status_code == worker.status_code == 200
        return Scrapes(scrape.text, worker.text)
    finally:
        for child in reversed(children):
            child.stop()
