"""`urc gateway --processes N` (docs/scale-out.md): N forked gateway processes on one port
(SO_REUSEPORT: the kernel spreads connections over them), each a full replica, kept running by
this parent. The parent serves nothing: it holds the ports, forwards signals, restarts a child
that dies and prints the one `gateway: URL` line once every child listens."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import NoReturn

from router.gateway.config import GatewayConfig
from router.gateway.siblings import Siblings

log = logging.getLogger(__name__)

_RESTART_BACKOFF_S = 1.0  # a child that dies is restarted after this, doubling up to 30 s
_READY_TIMEOUT_S = 120.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # forwarded to the children


@dataclass(slots=True)
class _Child:
    index: int
    pid: int = 0
    started_at: float = 0.0
    backoff_s: float = _RESTART_BACKOFF_S


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, never listening SO_REUSEPORT socket: it fixes the port (0: one the system
    chooses) for every child and keeps it ours across their restarts; it gets no connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_processes(config: GatewayConfig, config_path: str | None) -> int:
    """Fork `config.processes` gateways on one port; return when they have all exited."""
    from router.gateway.serve import run_gateway

    n = config.processes
    reserved: list[socket.socket] = []
    try:
        config = _reserve_ports(config, reserved)
    except OSError as exc:  # taken by a process that did not set SO_REUSEPORT, or no such host
        for sock in reserved:
            sock.close()
        print(f"urc gateway: cannot listen on {config.host}: {exc}", file=sys.stderr)
        return 1
    config = _shared_salt_secret(config)
    directory = tempfile.mkdtemp(prefix="urc-gateway-")  # 0700: only this user reaches it
    token = os.urandom(16).hex()
    ready_r, ready_w = os.pipe()
    children = [_Child(i) for i in range(n)]
    stopping: list[int] = []  # the signal that stops us, once one came

    def start(child: _Child) -> None:
        pid = os.fork()
        if pid == 0:  # the child: a full gateway, told who its siblings are
            siblings = Siblings(child.index, n, directory, token)
            _child_main(partial(run_gateway, config, config_path, siblings, ready_w), ready_r)
        child.pid, child.started_at = pid, time.monotonic()

    def forward(sig: int, _frame: object) -> None:
        if sig != signal.SIGHUP:
            stopping.append(sig)
        for child in children:
            if child.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, sig)

    for sig in _SIGNALS:
        signal.signal(sig, forward)
    try:
        for child in children:
            start(child)
        if not _await_ready(ready_r, n, children):
            forward(signal.SIGTERM, None)
            print("urc gateway: a process did not start", file=sys.stderr)
        else:
            print(f"gateway: http://{config.host}:{config.port}", flush=True)
            if config.metrics_port is not None:
                host = config.metrics_host or config.host
                print(f"metrics: http://{host}:{config.metrics_port}/metrics", flush=True)
        return _supervise(children, start, stopping)
    finally:
        for sock in reserved:
            sock.close()
        shutil.rmtree(directory, ignore_errors=True)


def _reserve_ports(config: GatewayConfig, reserved: list[socket.socket]) -> GatewayConfig:
    """`config` with its port (and metrics port) reserved for every child, appended to
    `reserved`: a port 0 becomes the one the system chose."""
    reserved.append(reserve_port(config.host, config.port))
    config = replace(config, port=reserved[-1].getsockname()[1])
    if config.metrics_port is not None:
        reserved.append(reserve_port(config.metrics_host or config.host, config.metrics_port))
        config = replace(config, metrics_port=reserved[-1].getsockname()[1])
    return config


def _child_main(serve: Callable[[], None], ready_r: int) -> NoReturn:
    """A forked child's life: `serve` with the default signal handlers, dying with the parent;
    it exits, never returning into the parent's code."""
    code = 1
    try:
        os.close(ready_r)
        _die_with_parent()
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        serve()
        code = 0
    except BaseException:  # noqa: B036 - a forked child must never return into main
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _shared_salt_secret(config: GatewayConfig) -> GatewayConfig:
    """With tenants and no salt_secret, one random secret for every process: each drawing its
    own would salt a tenant's prompts differently per process and split the workers' caches."""
    if config.salt_secret or not config.tenants:
        return config
    log.warning(
        "no salt_secret set: tenants' cache salts are keyed with a random secret shared by this "
        "gateway's %d processes (replicas in front of one fleet must share one: --salt-secret)",
        config.processes,
    )
    return replace(config, salt_secret=secrets.token_hex(32))


def _await_ready(ready_r: int, n: int, children: list[_Child]) -> bool:
    """Until each child has written its byte (it listens), or one exited, or the timeout."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    seen = 0
    while seen < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        readable, _, _ = select.select([ready_r], [], [], min(left, 0.5))
        if readable:
            seen += len(os.read(ready_r, n))
        for child in children:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(child.pid, os.WNOHANG)[0]:
                    child.pid = 0
                    return False
    return True


def _supervise(children: list[_Child], start: Callable[[_Child], None], stopping: list[int]) -> int:
    """Reap children; restart one that died on its own (after a backoff); exit once all have
    exited after a stop signal, with the first failure's code."""
    code = 0
    while any(c.pid for c in children):
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        child = next((c for c in children if c.pid == pid), None)
        if child is None:
            continue
        child.pid = 0
        exit_code = os.waitstatus_to_exitcode(status)
        if stopping:
            code = code or (exit_code if exit_code > 0 else 0)
            continue
        print(f"urc gateway: process {child.index} exited ({exit_code}); restarting", flush=True)
        if time.monotonic() - child.started_at > 60:
            child.backoff_s = _RESTART_BACKOFF_S
        time.sleep(child.backoff_s)
        child.backoff_s = min(child.backoff_s * 2, 30.0)
        if not stopping:
            start(child)
    return code


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the parent dies (a SIGKILLed parent leaves none)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
