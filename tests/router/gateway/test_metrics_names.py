"""The gateway's and a worker's /metrics (docs/metrics.md): no `_created` series, the process
and platform collectors on both, no name that both export with different meanings (the workers'
own metrics are `urc_engine_*`, the gateway's view of them `urc_worker_*`), every `urc_` metric
documented. Real processes on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.exposition import Scrapes, families, sample_names, scrape_fleet

DOCS = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
PROCESS = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
    "python_info",
    "python_gc_collections_total",
)


@pytest.fixture(scope="module")
def scrapes() -> Scrapes:
    return scrape_fleet()


def test_no_created_series(scrapes: Scrapes) -> None:
    for text in scrapes:
        assert not [name for name in sample_names(text) if name.endswith("_created")]
        assert "_created" not in text


def test_process_and_platform_collectors_on_both(scrapes: Scrapes) -> None:
    for text in scrapes:
        assert set(PROCESS) <= sample_names(text)


def test_no_name_means_two_things(scrapes: Scrapes) -> None:
    gateway, worker = families(scrapes.gateway), families(scrapes.worker)
    shared = set(gateway) & set(worker)
    assert shared and all(name.startswith(("process_", "python_")) for name in shared)
    assert {name: gateway[name] for name in shared} == {name: worker[name] for name in shared}
    assert [n for n in worker if n.startswith("urc_") and not n.startswith("urc_engine_")] == []
    assert [n for n in gateway if n.startswith("urc_engine_")] == []


def test_every_urc_metric_is_documented(scrapes: Scrapes) -> None:
    docs = DOCS.read_text()
    names = {name for text in scrapes for name in families(text) if name.startswith("urc_")}
    assert sorted(name for name in names if f"`{name}`" not in docs) == []
