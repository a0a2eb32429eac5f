"""A stand-in for the Kubernetes API server's Pods of one namespace, for the discovery tests (no
real API server runs here): LIST and WATCH in the API's wire format (PodList, chunked JSON-line
events ADDED / MODIFIED / DELETED / BOOKMARK / ERROR, a Status with code 410 for a version too
old), label selectors of `key=value` terms, bearer-token auth. It serves on 127.0.0.1 from a
thread of its own; the test steers it with plain calls."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

TOKEN = "stand-in-token"
_DROP = b""  # queued to a watch: cut its connection mid-stream


def pod(
    name: str,
    port: int,
    ready: bool,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ip: str = "127.0.0.1",
) -> dict[str, Any]:
    """A Pod as the API returns it (the fields discovery reads, and the usual others)."""
    state = "True" if ready else "False"
    conditions = [
        {"type": "Initialized", "status": "True"},
        {"type": "Ready", "status": state},
        {"type": "ContainersReady", "status": state},
        {"type": "PodScheduled", "status": "True"},
    ]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "engines",
            "uid": f"uid-{name}",
            "labels": {"app": "engine"} if labels is None else labels,
            "annotations": {"urc.dev/port": str(port), **(annotations or {})},
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {"containers": [{"name": "engine", "image": "urc:test"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": conditions,
        },
    }


def _selected(selector: dict[str, str], obj: dict[str, Any]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class _Watch:
    def __init__(self, selector: dict[str, str], bookmarks: bool) -> None:
        self.selector = selector
        self.bookmarks = bookmarks
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    def send(self, kind: str, obj: dict[str, Any]) -> None:
        self.queue.put_nowait(json.dumps({"type": kind, "object": obj}).encode() + b"\n")


class StandInAPI:
    """`put`, `delete`, `bookmark`, `hold` (cut every watch, keep new ones waiting), `release`,
    `compact` (a watch from an older version gets 410 Gone); counters of what was asked."""

    def __init__(self, namespace: str = "engines") -> None:
        self.namespace = namespace
        self.version = 1
        self.pods: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, pod)
        self.oldest = 0  # a watch resuming from before this version gets 410 Gone
        self.gone_as_http = False  # 410 as the HTTP status (else: an ERROR event)
        self.lists = 0
        self.watch_versions: list[str | None] = []  # the resourceVersion of each watch asked
        self.gones = 0
        self._watches: list[_Watch] = []
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the stand-in API server did not start")
        assert self._runner is not None
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig.yaml"
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: stand-in\n  cluster:\n    server: {self.url}\n"
            f"users:\n- name: gateway\n  user:\n    token: {TOKEN}\n"
            "contexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n"
            f"    user: gateway\n    namespace: {self.namespace}\n"
            "current-context: stand-in\n"
        )
        return path

    # --- steering, from the test's thread ---

    def put(self, obj: dict[str, Any]) -> None:
        """Create or change a pod: ADDED or MODIFIED to the watches it matches."""
        self._call(lambda: self._change("", obj))

    def delete(self, name: str) -> None:
        self._call(lambda: self._change("DELETED", self.pods[name]))

    def bookmark(self) -> None:
        """A BOOKMARK at the current version to every watch that allowed them."""
        self._call(self._bookmark)

    def hold(self) -> None:
        """Cut every watch mid-stream; new ones wait until `release`."""
        self._call(self._hold)

    def release(self) -> None:
        self._call(lambda: self._open.set())  # type: ignore[union-attr]

    def compact(self) -> None:
        """Forget the history: only a watch from the current version on can resume."""
        self._call(self._compact)

    def close(self) -> None:
        async def stop() -> None:
            assert self._runner is not None
            for watch in self._watches:
                watch.queue.put_nowait(_DROP)
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, fn: Callable[[], None]) -> None:
        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(5)

    # --- on the server's loop ---

    def _change(self, kind: str, obj: dict[str, Any]) -> None:
        """`kind` DELETED, or "": ADDED or MODIFIED as the pod is new or not."""
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        name = obj["metadata"]["name"]
        kind = kind or ("MODIFIED" if name in self.pods else "ADDED")
        if kind == "DELETED":
            del self.pods[name]
        else:
            self.pods[name] = obj
        self.history.append((self.version, kind, obj))
        for watch in self._watches:
            if _selected(watch.selector, obj):
                watch.send(kind, obj)

    def _bookmark(self) -> None:
        mark = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.version)},
        }
        for watch in self._watches:
            if watch.bookmarks:
                watch.send("BOOKMARK", mark)

    def _hold(self) -> None:
        assert self._open is not None
        self._open.clear()
        for watch in self._watches:
            watch.queue.put_nowait(_DROP)

    def _compact(self) -> None:
        self.oldest = self.version
        self.history.clear()

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._open = asyncio.Event()
        self._open.set()
        app = web.Application()
        app.router.add_get(f"/api/v1/namespaces/{self.namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        started.set()
        self._loop.run_forever()

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return _status(401, "Unauthorized", "Unauthorized")
        selector: dict[str, str] = {}
        for term in filter(None, request.query.get("labelSelector", "").split(",")):
            key, _, value = term.partition("=")
            selector[key.strip()] = value.strip()
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, selector)
        self.lists += 1
        items = [p for p in self.pods.values() if _selected(selector, p)]
        body = {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.version)},
            "items": items,
        }
        return web.json_response(body)

    async def _watch(self, request: web.Request, selector: dict[str, str]) -> web.StreamResponse:
        assert self._open is not None
        await self._open.wait()
        version = request.query.get("resourceVersion")
        self.watch_versions.append(version)
        since = int(version) if version and version != "0" else None
        too_old = since is not None and since < self.oldest
        if too_old and self.gone_as_http:
            self.gones += 1
            return _status(410, f"too old resource version: {since} ({self.oldest})", "Expired")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        watch = _Watch(selector, request.query.get("allowWatchBookmarks") == "true")
        if too_old:
            self.gones += 1
            message = f"too old resource version: {since} ({self.oldest})"
            watch.send("ERROR", _status_object(410, message, "Expired"))
        elif since is None:  # no version: the current state as ADDED events
            for obj in self.pods.values():
                if _selected(selector, obj):
                    watch.send("ADDED", obj)
        else:
            for changed, kind, obj in self.history:
                if changed > since and _selected(selector, obj):
                    watch.send(kind, obj)
        self._watches.append(watch)
        try:
            while (line := await watch.queue.get()) != _DROP:
                await response.write(line)
                if too_old:
                    return response  # the API server ends a watch after its ERROR
            assert request.transport is not None
            request.transport.abort()  # mid-stream: the client sees a broken chunked body
        except ConnectionError:
            pass
        finally:
            self._watches.remove(watch)
        return response


def _status_object(code: int, message: str, reason: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _status(code: int, message: str, reason: str) -> web.Response:
    return web.json_response(_status_object(code, message, reason), status=code)
