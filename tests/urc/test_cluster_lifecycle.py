"""`urc cluster` on real processes: a taken port is one line naming it, and no worker outlives
the cluster, however it dies (SIGKILL: core/lifeline.py) or stops (SIGTERM)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.processes import wait_for
from urc.processes import ROOT, Child

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _marked() -> tuple[str, dict[str, str]]:
    """A mark in the environment that every process the cluster starts inherits."""
    mark = f"URC_TEST_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    return mark, {key: value, "PYTHONWARNINGS": "ignore"}  # a stale build warns on stderr


def _running_with(mark: str) -> list[int]:
    """Pids of live (not zombie) processes whose environment holds `mark`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours
            continue
        if mark.encode() in environ and state not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


def _cluster(*flags: str, env: dict[str, str]) -> Child:
    argv = [sys.executable, "-m", "urc.cli", "cluster", "--port", "0", *flags]
    return Child("urc cluster", argv, "gateway: ", env=env).wait_announced(120)


def test_a_taken_port_is_one_line_naming_it_and_nothing_runs():
    mark, env = _marked()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "urc.cli", "cluster", "--workers", "2", "--port", str(port)]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **env}
        )
    lines = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], done.stderr
    assert _running_with(mark) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_worker_outlives_the_cluster(sig: signal.Signals):
    mark, env = _marked()
    cluster = _cluster("--workers", "2", env=env)
    try:
        workers = [pid for pid in _running_with(mark) if pid != cluster.pid]
        assert len(workers) == 2
        code = cluster.stop(sig)
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        assert wait_for(lambda: not _running_with(mark), timeout_s=15.0), _running_with(mark)
    finally:
        for pid in _running_with(mark):  # a failed test leaves nothing behind
            os.kill(pid, signal.SIGKILL)
