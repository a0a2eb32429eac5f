"""Child processes that die with their parent: `urc cluster`'s workers and engines must not
outlive it, even when it is killed with SIGKILL (or by the OOM killer) and runs no cleanup.

Linux: the child asks the kernel for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG),
between fork and exec, and then checks that its parent is still the one that started it (it
may have died before the request). The kernel sends that signal when the *thread* that forked
the child ends, so every child is forked by one thread that lives as long as the process.
Elsewhere: the child's environment names its parent (PARENT_ENV), and a child that runs
`urc` (`watch_parent`) polls its parent's pid from a thread and stops itself when it changes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

PARENT_ENV = "URC_PARENT_PID"  # the pid of the process a child must not outlive
SIGNAL = signal.SIGTERM  # a graceful stop: engines take their own children down with them
WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved here so that a forked child only calls it (no dlopen after fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_prctl = _load_prctl()
_spawns: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _set_pdeathsig(parent: int) -> None:
    """In the forked child, before exec (the setting survives exec)."""
    assert _prctl is not None
    _prctl(_PR_SET_PDEATHSIG, int(SIGNAL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before we asked: nobody would tell us
        os._exit(1)


def _spawn_forever() -> None:
    while True:
        call, future = _spawns.get()
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the caller's thread
            future.set_exception(exc)


def _on_spawner(call: Callable[[], subprocess.Popen[Any]]) -> subprocess.Popen[Any]:
    """Run `call` on the one long-lived thread (a daemon: it ends only with the process)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawn_forever, name="urc-spawner", daemon=True)
            _spawner.start()
    if threading.current_thread() is _spawner:
        return call()
    future: Future[subprocess.Popen[Any]] = Future()
    _spawns.put((call, future))
    return future.result()


def popen(
    argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, env=env, **kwargs)` (env None: ours), the child tied to this
    process: it gets SIGTERM when this process dies, however it dies (Linux; elsewhere only a
    child that runs `watch_parent`). Returns the `subprocess.Popen`."""
    parent = os.getpid()
    child_env = {**(os.environ if env is None else env), PARENT_ENV: str(parent)}
    preexec = (lambda: _set_pdeathsig(parent)) if _prctl is not None else None
    return _on_spawner(lambda: subprocess.Popen(argv, env=child_env, preexec_fn=preexec, **kwargs))


def watch_parent() -> None:
    """In a child started by `popen`: where the kernel cannot signal us when the parent dies
    (no prctl), a daemon thread checks the parent's pid every WATCH_INTERVAL_S and sends us
    SIGNAL once it changes. Forgets PARENT_ENV, so our own children do not inherit it (on Linux
    too: there the kernel watches)."""
    parent = os.environ.pop(PARENT_ENV, "")
    if _prctl is not None or not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(WATCH_INTERVAL_S)
        os.kill(os.getpid(), SIGNAL)

    threading.Thread(target=watch, name="urc-parent-watch", daemon=True).start()
