"""What the benchmarks share: child processes on 127.0.0.1, CPU accounting from /proc,
percentiles."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON_HEADERS = {"Content-Type": "application/json"}
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Child:
    """A child process in its own session (Ctrl-C reaches only us; we stop it), its last output
    lines kept for the error message; `url` comes from its `ready_prefix` line, if it has one."""

    def __init__(self, name: str, argv: list[str], ready_prefix: str | None, url: str = "") -> None:
        self.name = name
        self.url = url
        self.lines: deque[str] = deque(maxlen=60)
        self._ready = threading.Event()
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(ready_prefix,), daemon=True).start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _pump(self, prefix: str | None) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            if prefix and not self._ready.is_set() and line.startswith(prefix):
                self.url = line[len(prefix) :].strip()
                self._ready.set()
        self._ready.set()  # it exited

    def fail(self, why: str) -> RuntimeError:
        tail = "\n".join(f"    {line}" for line in list(self.lines)[-20:])
        return RuntimeError(f"{self.name} {why}; its last output:\n{tail}")

    def wait_announced(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s) or not self.url or self.popen.poll() is not None:
            raise self.fail("did not start")

    def wait_serving(self, path: str, body: bytes, timeout_s: float) -> None:
        """Until a real request through it answers 200 (a router may register workers late)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise self.fail(f"exited with {self.popen.returncode}")
            req = urllib.request.Request(self.url + path, data=body, headers=JSON_HEADERS)
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(req, timeout=2.0) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise self.fail(f"did not serve within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (every process, ours and others')."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) * TICK_S


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
