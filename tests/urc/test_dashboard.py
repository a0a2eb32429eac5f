"""deploy/monitoring (docs/metrics.md): every metric the Grafana dashboard queries is exported by
the job it names (a real gateway and worker, scraped after a few requests), its datasource is
the provisioned one, its panel ids are unique, Prometheus scrapes the jobs it queries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from tests.exposition import Scrapes, sample_names, scrape_fleet

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "urc.json"
DATASOURCES = MONITORING / "grafana" / "provisioning" / "datasources" / "prometheus.yml"

# words of PromQL that are not metric names: aggregations, set and vector-matching operators
_AGGREGATIONS = ("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values")
_MORE = ("bottomk", "topk", "quantile", "limitk", "limit_ratio", "and", "or", "unless", "bool")
KEYWORDS = frozenset((*_AGGREGATIONS, *_MORE, "offset", "atan2", "inf", "nan"))
LABEL_LISTS = frozenset(("by", "without", "on", "ignoring", "group_left", "group_right"))
_TOKEN = re.compile(
    r'(?P<string>"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')'
    r"|(?P<braces>\{[^}]*\})"
    r"|(?P<range>\[[^\]]*\])"
    r"|(?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)"
    r"|(?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)"
    r"|(?P<other>\S)"
)
_JOB = re.compile(r'\bjob\s*=\s*"([^"]*)"')


class Selector(NamedTuple):
    metric: str
    job: str | None  # the job its `job="..."` matcher names, if any


def selectors(expr: str) -> list[Selector]:
    """The metric names a PromQL expression selects: names not followed by `(` and not PromQL
    keywords; a `by (...)`-like label list is skipped; the braces after a name give its job."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    found: list[Selector] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        if kind == "name" and text in LABEL_LISTS and following and following[1] == "(":
            while i < len(tokens) and tokens[i][1] != ")":  # past the label list
                i += 1
            i += 1
            continue
        is_call = following is not None and following[1] == "("
        if kind == "name" and text not in KEYWORDS and text not in LABEL_LISTS and not is_call:
            braces = following[1] if following and following[0] == "braces" else ""
            job = _JOB.search(braces)
            found.append(Selector(text, job.group(1) if job else None))
        i += 1
    return found


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside a collapsed row too."""
    top = dashboard["panels"]
    return [*top, *(inner for p in top for inner in p.get("panels", []))]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def jobs() -> set[str]:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    return {job["job_name"] for job in config["scrape_configs"]}


@pytest.fixture(scope="module")
def scrapes() -> Scrapes:
    return scrape_fleet()


def test_selectors_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, worker) (rate(a_seconds_bucket{job="g",x!~"2.."}'
        '[$__rate_interval]))) / on (worker) group_left max(b_total{job="w"} offset 5m) '
        "and sum without (replica) (c) > bool 1e-3"
    )
    assert selectors(expr) == [
        Selector("a_seconds_bucket", "g"),
        Selector("b_total", "w"),
        Selector("c", None),
    ]


def test_every_queried_metric_is_exported(scrapes: Scrapes) -> None:
    by_job = {
        "urc-gateway": sample_names(scrapes.gateway),
        "urc-worker": sample_names(scrapes.worker),
    }
    assert set(by_job) == jobs()
    either = set().union(*by_job.values())
    queried, missing = set(), []
    for panel in panels(dashboard()):
        for target in panel.get("targets", []):
            for metric, job in selectors(target["expr"]):
                queried.add(metric)
                if metric not in (by_job[job] if job is not None else either):
                    missing.append((panel["title"], job, metric))
    assert missing == []
    # the areas the dashboard is for
    for metric in (
        "urc_predicted_cached_tokens_total",
        "urc_predicted_host_cached_tokens_total",
        "urc_actual_cached_tokens_total",
        "urc_worker_host_cached_blocks",
        "urc_engine_cached_tokens_total",
        "urc_ttft_seconds_bucket",
        "urc_requests_total",
        "urc_worker_in_flight",
        "urc_worker_queued_prefill_tokens",
        "urc_kv_event_lag_seconds",
        "urc_kv_event_batches_total",
        "urc_kv_event_replays_total",
        "urc_routing_degraded",
        "urc_index_blocks",
        "urc_decision_seconds_bucket",
    ):
        assert metric in queried, metric


def test_datasource_and_panel_ids() -> None:
    provisioned = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    uids = {source["uid"] for source in provisioned}
    board = dashboard()
    assert board["schemaVersion"] >= 39 and board["uid"]
    every = panels(board)
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids))
    for panel in every:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] in uids
            assert target["expr"] and target["refId"]
