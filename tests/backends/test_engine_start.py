"""Starting engines on free ports (backends/real/process.py) with a stand-in engine, a few lines
of Python: one that loses a port between our draw and its bind is started again on fresh
ports; one that fails for any other reason is not, and none is left running."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from backends.real.process import EngineEndpoints, EngineLaunch, start_ready_engines

ENGINE = """
import http.server, pathlib, sys
port, marker, failure = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
if failure == "always" or not marker.exists():
    marker.write_text("")
    sys.exit("zmq.error.ZMQError: Address already in use" if failure != "always" else "bad model")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def launcher(tmp_path: Path, failure: str, ports_seen: list[list[int]]):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)

    def launch_on(ports: list[int]) -> EngineLaunch:
        ports_seen.append(ports)
        http, events, replay = ports
        argv = [sys.executable, str(script), str(http), str(tmp_path / "failed-once"), failure]
        endpoints = EngineEndpoints(
            f"http://127.0.0.1:{http}",
            ["m"],
            16,
            f"tcp://127.0.0.1:{events}",
            f"tcp://127.0.0.1:{replay}",
        )
        return EngineLaunch(argv, {}, endpoints)

    return launch_on


def test_an_engine_that_lost_a_port_starts_again_on_fresh_ones(tmp_path):
    ports_seen: list[list[int]] = []
    engines = start_ready_engines(launcher(tmp_path, "once", ports_seen), 2, tmp_path, timeout_s=60)
    try:
        assert len(engines) == 2 and all(e.popen.poll() is None for e in engines)
        assert 3 <= len(ports_seen) <= 4  # the first to start failed (both, if at once)
        every = [port for ports in ports_seen for port in ports]
        assert len(set(every)) == len(every)  # each start drew fresh ports
    finally:
        for engine in engines:
            engine.stop()


def test_any_other_failure_is_not_retried_and_nothing_is_left(tmp_path):
    ports_seen: list[list[int]] = []
    started: list = []
    with pytest.raises(RuntimeError, match="bad model"):
        start_ready_engines(
            launcher(tmp_path, "always", ports_seen), 2, tmp_path, timeout_s=60, started=started
        )
    assert len(ports_seen) == 2
    assert all(engine.popen.poll() is not None for engine in started)
