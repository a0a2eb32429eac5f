"""docker-compose.yml parses and its commands are the CLI's own (docker itself is not run)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import yaml

from backends.emulated.server import build_parser as worker_parser
from router.gateway.config import load_config
from urc.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_default_profile_is_a_gateway_in_front_of_emulated_workers():
    services = compose()["services"]
    workers = {name: s for name, s in services.items() if name.startswith("worker-")}
    assert len(workers) == 4
    ports = {}
    for name, service in workers.items():
        command = service["command"]
        assert command[:2] == ["urc", "worker"]
        args = worker_parser().parse_args(command[2:])
        assert args.host == "0.0.0.0" and args.kv_events_port and args.kv_replay_port
        ports[name] = args.port
    gateway = services["gateway"]["command"]
    assert gateway[:2] == ["urc", "gateway"]
    parser, _ = build_parser()
    args = parser.parse_args(gateway[1:])
    targets = {(urlparse(u).hostname, urlparse(u).port) for u in args.worker}
    assert targets == {(name, port) for name, port in ports.items()}
    assert set(services["gateway"]["depends_on"]) == set(workers)


def test_gpu_profile_is_described_for_the_gateway():
    services = compose()["services"]
    gpu = {name: s for name, s in services.items() if "gpu" in s.get("profiles", [])}
    assert {"sglang-1", "sglang-2", "gateway-gpu"} <= set(gpu)
    for name in ("sglang-1", "sglang-2"):
        command = services[name]["command"]
        events = json.loads(command[command.index("--kv-events-config") + 1])
        assert events["publisher"] == "zmq"
    config = load_config(ROOT / "deploy" / "gateway-sglang.toml")
    assert {urlparse(w.url).hostname for w in config.workers} == {"sglang-1", "sglang-2"}
    assert all(w.kv_events and w.models for w in config.workers)
    parser, _ = build_parser()
    args = parser.parse_args(services["gateway-gpu"]["command"][1:])
    assert args.config == "/deploy/gateway-sglang.toml"
