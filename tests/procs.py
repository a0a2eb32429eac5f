"""Real processes on 127.0.0.1 for end-to-end tests: workers and gateways, started and stopped."""

from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

_started: list[Proc] = []  # stopped when the test run ends: a test that failed before its own
# cleanup (a gateway that did not start, say) must not leave its workers running


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Proc:
    """A child process that announces its URL on stdout (`ready: URL`, `gateway: URL`)."""

    def __init__(self, args: Sequence[str], ready_prefix: str, timeout_s: float = 60.0) -> None:
        self.args = list(args)
        self.lines: list[str] = []
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        _started.append(self)
        ready = threading.Event()
        self.url = ""

        def pump() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                self.lines.append(line.rstrip())
                if not ready.is_set() and line.startswith(ready_prefix):
                    self.url = line[len(ready_prefix) :].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout_s) or not self.url:
            self.stop()
            raise RuntimeError(f"{args} did not start:\n" + "\n".join(self.lines[-30:]))

    def kill(self) -> None:
        """SIGKILL: the process dies without any goodbye, as a crashed worker does."""
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


@atexit.register
def _stop_all() -> None:
    for proc in _started:
        proc.stop()


def start_worker(*extra: str, port: int = 0) -> Proc:
    """Port 0: the worker binds one of its own and announces it (no race for a free one)."""
    args = ["-m", "backends.emulated.server", "--host", "127.0.0.1", "--port", str(port), *extra]
    return Proc(args, "ready: ")


def start_gateway(workers: Sequence[str], *extra: str, port: int = 0) -> Proc:
    args = ["-m", "urc.cli", "gateway", "--port", str(port)]
    for url in workers:
        args += ["--worker", url]
    return Proc([*args, *extra], "gateway: ")


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


@dataclass(slots=True)
class Worker:
    url: str
    proc: subprocess.Popen[str]


@contextmanager
def running_worker(
    module: str, *args: str, stop: signal.Signals = signal.SIGTERM, ready_timeout_s: float = 60.0
) -> Iterator[Worker]:
    """`python -m MODULE --port 0 ARGS`, until it announces `ready: URL`; on leaving, send
    `stop` and require a clean exit (code 0): a worker must shut down, not be killed."""
    cmd = [sys.executable, "-m", module, "--port", "0", *args]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            ready, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
            line = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
            if not line.startswith("ready: http://127.0.0.1:"):
                err.seek(0)
                raise AssertionError(f"worker did not start: {line!r} {err.read()[-2000:]}")
            yield Worker(line.split()[1], proc)
        finally:
            if proc.poll() is None:
                proc.send_signal(stop)
            try:
                code = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
                raise
            err.seek(0)
            assert code == 0, err.read()[-2000:]
