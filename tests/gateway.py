"""What the tests ask a running gateway: its workers, its route header, its plan."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai

from tests.processes import wait_for
from urc.processes import Child, start_gateway, start_worker

ADMIN = {"Authorization": "Bearer admin-secret"}


def admin_workers(gateway: str) -> list[dict]:
    return httpx.get(f"{gateway}/admin/workers", headers=ADMIN, timeout=5).json()["workers"]


def all_exact(gateway: str, n: int) -> bool:
    try:
        workers = admin_workers(gateway)
    except httpx.HTTPError:
        return False
    return sum(w["up"] and w["mode"] == "exact" for w in workers) == n


def route(response: httpx.Response) -> dict[str, str]:
    header = response.headers["x-urc-route"]
    return dict(part.strip().split("=", 1) for part in header.split(";"))


def best_match(gateway: str, body: dict) -> int:
    plan = httpx.post(f"{gateway}/admin/route", json=body, headers=ADMIN, timeout=5).json()
    return max(c["matched_tokens"] for c in plan["candidates"])


@contextlib.contextmanager
def gateway_fleet(n: int, *gateway_args: str) -> Iterator[tuple[str, list[Child]]]:
    """A gateway in front of `n` emulated workers, once it follows every worker's KV events."""
    workers = [start_worker() for _ in range(n)]
    gateway = None
    try:
        gateway = start_gateway([w.url for w in workers], *gateway_args)
        assert wait_for(lambda: all_exact(gateway.url, n), 20)
        yield gateway.url, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def assert_400s(base: str, path: str, cases: list[tuple[dict, str]], worker: bool) -> None:
    """Each (body, param) of `cases` POSTed to `base` is a 400 naming `param` (a worker, which
    serves its first model when none is named, skips the 'model' cases)."""
    for body, param in cases:
        if worker and param == "model":
            continue
        answer = httpx.post(f"{base}{path}", json=body, timeout=10)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["param"] == param, (body, answer.text)
