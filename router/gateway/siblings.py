"""The other processes of one `urc gateway --processes N` (docs/scale-out.md): each process also
serves its app on a Unix socket in a private directory, so that an admin change made on one
reaches all of them and one scrape of `/metrics` covers all of them (a `replica` label each)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

HEADER = "x-urc-sibling"  # carries the parent's per-run token: the request comes from a sibling
_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# what a sibling's answer keeps of the request's headers
_FORWARDED = ("authorization", "content-type")


class Siblings:
    """Process `index` of `count`; `token` (random, per run) marks requests between them."""

    def __init__(self, index: int, count: int, directory: str, token: str) -> None:
        self.index = index
        self.count = count
        self.directory = directory
        self.token = token
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def path(self, index: int) -> str:
        return os.path.join(self.directory, f"gateway-{index}.sock")

    def sent_by_sibling(self, headers: Mapping[str, str]) -> bool:
        given = headers.get(HEADER, "")
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    async def start(self, runner: web.AppRunner) -> None:
        """Serve `runner`'s app on this process's socket (a restarted process takes it over)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(self.index))
        await web.UnixSite(runner, self.path(self.index)).start()

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    def _session(self, index: int) -> aiohttp.ClientSession:
        session = self._sessions.get(index)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=self.path(index))
            session = self._sessions[index] = aiohttp.ClientSession(connector=connector)
        return session

    async def _send(
        self, index: int, method: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes]:
        """One request to sibling `index`: (status, body); status 0 when it did not answer."""
        sent = {k: v for k, v in headers.items() if k.lower() in _FORWARDED}
        sent[HEADER] = self.token
        url = f"http://gateway-{index}{path}"  # the host is ignored on a Unix socket
        try:
            async with self._session(index).request(
                method, url, data=body, headers=sent, timeout=_TIMEOUT
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0, b""

    def _others(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    async def fan_out(self, request: web.Request, body: bytes) -> dict[str, int]:
        """The same admin request on every other process: their HTTP statuses (0: no answer)."""
        others = self._others()
        method, path, headers = request.method, request.path_qs, request.headers
        sends = (self._send(i, method, path, body, headers) for i in others)
        answers = await asyncio.gather(*sends)
        return {str(i): status for i, (status, _) in zip(others, answers, strict=True)}

    async def scrape_all(self, own: bytes, headers: Mapping[str, str]) -> bytes:
        """`own` exposition plus every other process's, each sample labelled `replica`."""
        others = self._others()
        scrapes = (self._send(i, "GET", "/metrics", b"", headers) for i in others)
        answers = await asyncio.gather(*scrapes)
        texts = {str(self.index): own}
        for i, (status, text) in zip(others, answers, strict=True):
            if status == 200:
                texts[str(i)] = text
        return merge_expositions(texts)


def merge_expositions(texts: Mapping[str, bytes]) -> bytes:
    """One exposition of several processes' (by replica): a family once, samples labelled."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def scoped(answer: dict[str, Any], replica: str, processes: dict[str, int] | None) -> bytes:
    """An admin answer that says what it changed: this replica (and its processes) only."""
    reached = {"replica": replica, "processes": processes or {"0": 200}}
    reached["note"] = (
        "admin changes reach the processes of this replica only; other gateway replicas "
        "keep their own (docs/scale-out.md, 'What each replica keeps')"
    )
    return json.dumps({**answer, "applied_to": reached}).encode()
