"""Workers discovered from the engine pods of a Kubernetes namespace (docs/kubernetes.md,
"Discovery"): a pod that is Ready is a worker, one that is not (or terminates, or is gone) leaves
the fleet. LIST gives the complete truth and a resourceVersion; WATCH from it follows each
change; a broken watch resumes from the last version seen, a 410 Gone relists."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod
from lightkube.types import on_error_raise

from router.gateway.config import GatewayConfig, WorkerConfig
from router.gateway.config_schema import ENGINES
from router.gateway.event_streams import reachable
from router.gateway.fleet import Fleet

log = logging.getLogger(__name__)
PREFIX = "urc.dev/"  # the annotations a pod describes itself with
_BACKOFF_S = (0.2, 5.0)  # a failed watch or list is retried after this, doubling to the cap
_WATCH_S = 290  # the server ends each watch after this; lightkube re-issues it at once


def is_ready(pod: dict[str, Any]) -> bool:
    """An IP, the Ready condition True and no deletion under way: the pod takes requests."""
    status = pod.get("status") or {}
    if not status.get("podIP") or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_port(pod: dict[str, Any], default: int) -> int:
    """The `urc.dev/port` annotation, else the container port named `http`, else `default`."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if (value := annotations.get(PREFIX + "port")) is not None:
        return _integer(value, "port")
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def worker_config(pod: dict[str, Any], default_port: int) -> WorkerConfig | None:
    """The worker a pod is, or None while it is not ready. ValueError: its annotations are bad.
    Our workers (`urc.dev/engine: urc`, the default) describe themselves at /urc/info; a vLLM
    or SGLang pod names its models and KV-event endpoints in annotations."""
    if not is_ready(pod):
        return None
    meta = pod["metadata"]
    annotations = meta.get("annotations") or {}
    ip: str = pod["status"]["podIP"]
    engine = annotations.get(PREFIX + "engine", "urc")
    if engine not in ENGINES:
        raise ValueError(f"{PREFIX}engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    listed = annotations.get(PREFIX + "models")
    models = [m.strip() for m in listed.split(",") if m.strip()] if listed else None
    if engine != "urc" and not models:
        raise ValueError(f"a {engine} pod names its models in {PREFIX}models (it has no /urc/info)")
    host = f"[{ip}]" if ":" in ip else ip
    block_size = annotations.get(PREFIX + "block-size")
    return WorkerConfig(
        url=f"http://{host}:{pod_port(pod, default_port)}",
        name=meta["name"],  # stable across gateway replicas and restarts of the gateway
        models=models,
        kv_events=reachable(annotations.get(PREFIX + "kv-events"), host),
        kv_replay=reachable(annotations.get(PREFIX + "kv-replay"), host),
        kv_topic=annotations.get(PREFIX + "kv-topic", ""),
        block_size=_integer(block_size, "block-size") if block_size is not None else None,
        engine=engine,
    )


def _integer(value: str, key: str) -> int:
    if not str(value).isdigit() or int(value) <= 0:
        raise ValueError(f"{PREFIX}{key} must be a positive integer, not {value!r}")
    return int(value)


def gone(exc: BaseException) -> bool:
    """410 Gone, the version too old to resume from: an ERROR event's Status or the HTTP status."""
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code == 410:
        return True
    response = getattr(exc, "response", None)  # lightkube's httpx HTTPStatusError
    return getattr(response, "status_code", None) == 410


class PodDiscovery:
    """Keeps the fleet's discovered workers equal to the ready pods that `selector` matches."""

    def __init__(self, fleet: Fleet, config: GatewayConfig) -> None:
        self.fleet = fleet
        self.selector = config.discover_selector
        self.default_port = config.discover_port
        self.kubeconfig = config.discover_kubeconfig
        self.namespace = config.discover_namespace
        self.pods: dict[str, WorkerConfig] = {}  # pod name -> the worker it was added as
        self.version: str | None = None  # the last resourceVersion seen (None: relist)
        self.relists = 0
        self._client: AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._refused: set[tuple[str, str]] = set()  # (pod, why) warned about once

    async def start(self) -> None:
        path = self.kubeconfig
        kubeconfig = KubeConfig.from_file(path) if path else KubeConfig.from_env()
        self._client = AsyncClient(config=kubeconfig, namespace=self.namespace or None)
        self.namespace = self._client.namespace  # default: the service account's, else context's
        self._task = asyncio.get_running_loop().create_task(self.run())
        log.info("discovering workers: pods %r in namespace %s", self.selector, self.namespace)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.close()

    async def run(self) -> None:
        """List, then watch; forever, backing off after failures (the fleet keeps its workers)."""
        backoff = _BACKOFF_S[0]
        listed: str | None = None  # the version of the last relist
        while True:
            try:
                if self.version is None:
                    await self.relist()
                    listed = self.version
                async for _ in self.watch():
                    backoff = _BACKOFF_S[0]  # the watch works again
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if gone(exc):
                    log.info("pod watch: version %s too old, relisting", self.version)
                    fresh = self.version == listed  # gone straight after a list: back off
                    self.version = None
                    if not fresh:
                        continue
                why = f"{type(exc).__name__}: {exc}"
                log.warning("pod watch failed (%s); resuming in %.1f s", why, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_S[1])

    def _request(self, watch: bool, params: dict[str, str | None]) -> Any:
        """lightkube's own request for Pods, taking the selector as a string (its public list and
        watch want a dict) and, for a watch, allowWatchBookmarks (its public watch cannot ask)."""
        assert self._client is not None
        params = {"labelSelector": self.selector, **params}
        generic = self._client._client
        namespace = self.namespace
        return generic.prepare_request("list", Pod, namespace=namespace, watch=watch, params=params)

    async def relist(self) -> None:
        """The pods listed are the whole truth: a worker discovered before and not among them
        leaves (nothing stale survives a relist)."""
        assert self._client is not None
        listing = self._client._client.list(self._request(False, {}))
        pods = [pod.to_dict() async for pod in listing]
        self.relists += 1
        names = {pod["metadata"]["name"] for pod in pods}
        for name in [n for n in self.pods if n not in names]:
            await self._retire(name, "not listed")
        for pod in pods:
            await self.apply(pod, deleted=False)
        self.version = listing.resourceVersion

    async def watch(self) -> Any:
        """Apply each change from `version` on, yielding after each (errors raise: see `run`)."""
        assert self._client is not None
        params = {
            "resourceVersion": self.version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(_WATCH_S),
        }
        events = self._client._client.watch(self._request(True, params), on_error=on_error_raise)
        async for kind, obj in events:
            pod = obj.to_dict()
            if kind != "BOOKMARK":  # a bookmark only moves the version on
                await self.apply(pod, deleted=kind == "DELETED")
            self.version = pod["metadata"]["resourceVersion"]
            yield kind

    async def apply(self, pod: dict[str, Any], deleted: bool) -> None:
        """One pod's state: in the fleet while ready, as it now describes itself."""
        name = pod["metadata"]["name"]
        try:
            wanted = None if deleted else worker_config(pod, self.default_port)
        except ValueError as exc:
            if (name, str(exc)) not in self._refused:
                self._refused.add((name, str(exc)))
                log.warning("pod %s is not taken as a worker: %s", name, exc)
            wanted = None
        current = self.pods.get(name)
        if wanted == current:
            return
        if current is not None:
            why = "deleted" if deleted else "not ready" if wanted is None else "changed"
            await self._retire(name, why)
        if wanted is not None:
            await self._admit(wanted)

    async def _admit(self, config: WorkerConfig) -> None:
        assert config.name is not None
        try:
            worker = await self.fleet.add(config)
        except ValueError as exc:  # a configured worker has its name
            log.warning("pod %s is not taken as a worker: %s", config.name, exc)
            return
        self.pods[config.name] = config
        state = "up" if worker.up else "not answering yet"
        message = "pod %s added as worker %s (%s, %s)"
        log.info(message, config.name, config.url, config.engine, state)

    async def _retire(self, name: str, why: str) -> None:
        del self.pods[name]
        await self.fleet.remove(name, drain=True)
        log.info("pod %s removed (%s): requests under way finish on it", name, why)
