"""docker-compose.yml parses, and what `docker compose config` and `up` would check holds for
each profile: images pinned, ours built, healthchecks, healthy dependencies, distinct GPUs and
host ports, mounted files in the repo; the commands are the CLI's own (docker itself is not run).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from backends.emulated.server import build_parser as worker_parser
from router.gateway.config import load_config
from urc.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
OURS = "urc"  # the image the repository's Dockerfile builds
# profile -> (the profiles enabled, the service `up` is given), as the compose file's header says
PROFILES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "default": ((), None),
    "monitoring": (("monitoring",), None),
    "gpu": (("gpu",), "gateway-gpu"),
}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def enabled(services: dict, profiles: tuple[str, ...]) -> dict:
    """The services a profile set enables: those without profiles and those in one of them."""
    return {
        name: s
        for name, s in services.items()
        if not s.get("profiles") or set(s["profiles"]) & set(profiles)
    }


def started(services: dict, profile: str) -> dict:
    """What `docker compose [--profile P] up [SERVICE]` starts: the target and its dependencies."""
    profiles, target = PROFILES[profile]
    active = enabled(services, profiles)
    if target is None:
        return active
    names, todo = set(), [target]
    while todo:
        name = todo.pop()
        if name not in names:
            names.add(name)
            todo.extend(services[name].get("depends_on", {}))
    return {name: services[name] for name in names}


def dependencies(service: dict) -> dict:
    depends = service.get("depends_on", {})
    assert isinstance(depends, dict), "depends_on as a mapping, with conditions"
    return depends


def health_url(service: dict) -> str:
    """The URL our image's healthcheck opens (python -c "... urlopen('URL', ...)")."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return re.search(r"urlopen\('([^']+)'", test[3]).group(1)


def gateway_args(command: list[str]):
    assert command[:2] == ["urc", "gateway"]
    parser, _ = build_parser()
    return parser.parse_args(command[1:])


def listen_port(command: list[str]) -> int:
    """The port an `urc gateway` or `urc worker` command listens on, as its parser reads it."""
    if command[:2] == ["urc", "worker"]:
        return worker_parser().parse_args(command[2:]).port
    return gateway_args(command).port


def in_repo(service: dict, path: str) -> Path:
    """The repository file a container path of a service's bind mounts is."""
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if path == target or path.startswith(target + "/"):
            return ROOT / source / path[len(target) :].lstrip("/")
    raise AssertionError(f"{path} is in no mount")


@pytest.mark.parametrize("profile", PROFILES)
def test_images_are_pinned_and_ours_are_built(profile):
    services = compose()["services"]
    for name, service in enabled(services, PROFILES[profile][0]).items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag, f"{name}: {image} has no tag"
        if repo == OURS:  # built here, so `latest` is the checkout's
            assert service.get("build") == ".", f"{name}: {image} without build: ."
        else:
            assert "build" not in service and tag != "latest" and re.search(r"\d", tag), name
    assert (ROOT / "Dockerfile").is_file()


@pytest.mark.parametrize("profile", PROFILES)
def test_every_service_is_health_checked_and_waits_for_healthy_dependencies(profile):
    services = compose()["services"]
    active = enabled(services, PROFILES[profile][0])
    for name, service in started(services, profile).items():
        check = service["healthcheck"]
        assert check["test"][0] == "CMD" and check["retries"] > 0, name
        for dependency, how in dependencies(service).items():
            assert dependency in active, f"{name} needs {dependency}, not in profile {profile}"
            assert how == {"condition": "service_healthy"}, name


@pytest.mark.parametrize("profile", PROFILES)
def test_gpus_and_host_ports_are_distinct(profile):
    services = started(compose()["services"], profile)
    gpus, ports = [], []
    for service in services.values():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        for device in reservations.get("devices", []):
            assert "count" not in device, "GPUs by device_ids, so two services never share one"
            gpus += device["device_ids"]
        ports += [p.split(":")[0] for p in service.get("ports", [])]
    assert len(gpus) == len(set(gpus)) and len(ports) == len(set(ports)), (gpus, ports)
    if profile == "gpu":
        assert sorted(gpus) == ["0", "1"]


def test_mounted_files_are_in_the_repository():
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"


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
        assert urlparse(health_url(service)).port == args.port
        ports[name] = args.port
    args = gateway_args(services["gateway"]["command"])
    targets = {(urlparse(u).hostname, urlparse(u).port) for u in args.worker}
    assert targets == {(name, port) for name, port in ports.items()}
    assert set(dependencies(services["gateway"])) == set(workers)
    url = urlparse(health_url(services["gateway"]))
    assert (url.port, url.path) == (args.port, "/health")


def test_gpu_profile_is_described_for_the_gateway():
    services = compose()["services"]
    gpu = {name: s for name, s in services.items() if "gpu" in s.get("profiles", [])}
    assert {"sglang-1", "sglang-2", "gateway-gpu"} <= set(gpu)
    for name in ("sglang-1", "sglang-2"):
        command = services[name]["command"]
        events = json.loads(command[command.index("--kv-events-config") + 1])
        assert events["publisher"] == "zmq"
        assert "--enable-cache-report" in command
        port = command[command.index("--port") + 1]
        assert services[name]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
    config = load_config(ROOT / "deploy" / "gateway-sglang.toml")
    assert {urlparse(w.url).hostname for w in config.workers} == {"sglang-1", "sglang-2"}
    assert all(w.kv_events and w.models for w in config.workers)
    args = gateway_args(services["gateway-gpu"]["command"])
    assert args.config == "/deploy/gateway-sglang.toml"
    assert urlparse(health_url(services["gateway-gpu"])).port == args.port


def test_monitoring_profile_scrapes_the_default_services():
    services = compose()["services"]
    monitoring = enabled(services, ("monitoring",))
    assert {"prometheus", "grafana"} <= set(monitoring)
    scrape = yaml.safe_load((ROOT / "deploy/monitoring/prometheus.yml").read_text())
    targets = {
        target
        for job in scrape["scrape_configs"]
        for config in job["static_configs"]
        for target in config["targets"]
    }
    for target in targets:
        host, port = target.split(":")
        assert host in monitoring, f"Prometheus scrapes {host}, not a service of the profile"
        assert listen_port(monitoring[host]["command"]) == int(port), target
    grafana = services["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:-")
    assert in_repo(grafana, env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).is_file()
    provisioning = in_repo(grafana, "/etc/grafana/provisioning/dashboards/urc.yml")
    for provider in yaml.safe_load(provisioning.read_text())["providers"]:
        assert list(in_repo(grafana, provider["options"]["path"]).glob("*.json"))
