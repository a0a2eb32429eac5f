"""Workers and gateways as child processes on 127.0.0.1, for `urc cluster`, the end-to-end tests
and the benchmarks: started, announced, stopped (every one still running at exit)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from core import lifeline

ROOT = Path(__file__).resolve().parents[1]
JSON_HEADERS = {"Content-Type": "application/json"}
_started: list[Child] = []  # a caller that failed before its own cleanup leaves none running


class Child:
    """A child process in its own session (Ctrl-C reaches only us) that dies with us (SIGTERM
    even when we are killed: core/lifeline.py), its output kept for errors; `url` from its
    `ready_prefix` line. `console` (urc cluster): our cwd, its stderr ours."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ready_prefix: str | None,
        url: str = "",
        console: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.popen = lifeline.popen(
            argv,
            cwd=None if console else ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None if console else subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        _started.append(self)
        threading.Thread(target=self._pump, args=(ready_prefix,), daemon=True).start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _pump(self, prefix: str | None) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            if len(self.lines) > 4000:  # a long benchmark's log: the tail is what explains
                del self.lines[:2000]
            if prefix and not self._ready.is_set() and line.startswith(prefix):
                self.url = line[len(prefix) :].strip()
                self._ready.set()
        self._ready.set()  # it exited

    def fail(self, why: str) -> RuntimeError:
        tail = "\n".join(f"    {line}" for line in self.lines[-30:])
        return RuntimeError(f"{self.name} {why}; its last output:\n{tail}")

    def wait_announced(self, timeout_s: float = 60.0) -> Child:
        if not self._ready.wait(timeout_s) or not self.url or self.popen.poll() is not None:
            self.stop()
            raise self.fail("did not start")
        return self

    def wait_serving(self, path: str, body: bytes, timeout_s: float) -> None:
        """Until a real request through it answers 200 (a router may register workers late)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise self.fail(f"exited with {self.popen.returncode}")
            req = urllib.request.Request(self.url + path, data=body, headers=JSON_HEADERS)
            # a refusal, a reset or an HTTP error (URLError is an OSError): not yet
            with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=2.0) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise self.fail(f"did not serve within {timeout_s:.0f} s")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Send `sig` (if it still runs), then its exit code; killed after 10 s."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode


@atexit.register
def _stop_all() -> None:
    for child in _started:
        child.stop()


def start_worker(*extra: str, port: int = 0, module: str = "backends.emulated.server") -> Child:
    """Port 0: the worker binds one of its own and announces it (no race for a free one)."""
    argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *extra]
    return Child(f"worker {module}", argv, "ready: ").wait_announced()


def start_gateway(
    workers: Sequence[str],
    *extra: str,
    port: int = 0,
    env: dict[str, str] | None = None,
    launch: Sequence[str] = ("-m", "urc.cli"),
    wrapper: Sequence[str] = (),
    timeout_s: float = 60.0,
) -> Child:
    """`launch`: how the Python child runs `urc` (a bench's variant runs a `-c` of its own);
    `wrapper`: what runs the Python (a bench's valgrind), which may take `timeout_s` to start."""
    argv = [*wrapper, sys.executable, *launch, "gateway", "--port", str(port)]
    for url in workers:
        argv += ["--worker", url]
    child = Child("urc gateway", [*argv, *extra], "gateway: ", env=env)
    return child.wait_announced(timeout_s)
