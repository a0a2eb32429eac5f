"""A real engine (vLLM, SGLang) as a child process, and what the gateway must know about it.

Real engines have no /urc/info, so a launcher hands the gateway an `EngineEndpoints` (the
`[[workers]]` entry of a gateway config, docs/cli.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KV_TOPIC = "kv"


@dataclass(slots=True)
class EngineEndpoints:
    """One engine as the gateway's `[[workers]]` entry describes it."""

    url: str
    models: list[str]
    block_size: int
    kv_events: str | None = None  # as the gateway connects to it (tcp://host:port)
    kv_replay: str | None = None
    kv_topic: str = KV_TOPIC

    @classmethod
    def of(
        cls, host: str, port: int, models: list[str], block_size: int, events: int, replay: int
    ) -> EngineEndpoints:
        """An engine on `host` serving HTTP on `port`, publishing on `events` and `replay`."""
        connect = f"tcp://{host}:"
        return cls(
            f"http://{host}:{port}", models, block_size, f"{connect}{events}", f"{connect}{replay}"
        )

    def worker_entry(self) -> dict[str, Any]:
        """The `[[workers]]` table of a gateway config file."""
        entry: dict[str, Any] = {
            "url": self.url,
            "models": list(self.models),
            "block_size": self.block_size,
            "kv_topic": self.kv_topic,
        }
        optional = {"kv_events": self.kv_events, "kv_replay": self.kv_replay}
        return entry | {k: v for k, v in optional.items() if v}


@dataclass(slots=True)
class EngineLaunch:
    """A command line and environment that start one engine, and its endpoints once up."""

    argv: list[str]
    env: dict[str, str]
    endpoints: EngineEndpoints


@dataclass(slots=True, eq=False)
class EngineProcess:
    """A started engine; its output goes to `log_path` (engines are chatty)."""

    launch: EngineLaunch
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def endpoints(self) -> EngineEndpoints:
        return self.launch.endpoints

    def wait_ready(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        """Until /health answers 200; RuntimeError (with the log's tail) if it exits or the
        time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self.popen.returncode}:\n{self.log_tail()}"
                )
            health = self.endpoints.url + "/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(interval_s)
        raise RuntimeError(f"engine not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def kill(self) -> None:
        """SIGKILL to the whole engine (its engine-core child holds the KV-event sockets),
        as a crash: no goodbye on any socket."""
        self._signal_group(signal.SIGKILL)
        self.popen.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to whatever of the engine is left (children included)."""
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        self.kill()

    def _signal_group(self, sig: signal.Signals) -> None:
        # start_engine made the engine a session (and process group) leader
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


def start_engine(launch: EngineLaunch, log_path: str | Path) -> EngineProcess:
    """Start `launch` in its own process group, output to `log_path`; does not wait."""
    path = Path(log_path)
    with path.open("wb") as log:  # the child writes to its own copy of the descriptor
        popen = subprocess.Popen(
            launch.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **launch.env},
            start_new_session=True,
        )
    return EngineProcess(launch, popen, path)


def kv_events_config(events_port: int, replay_port: int, **extra: Any) -> str:
    """The `--kv-events-config` both engines take: ZMQ PUB and replay on every interface."""
    return json.dumps(
        {
            **extra,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": KV_TOPIC,
        }
    )
