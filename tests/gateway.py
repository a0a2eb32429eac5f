"""What the tests ask a running gateway: its workers, its route header, its plan."""

from __future__ import annotations

import httpx

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
