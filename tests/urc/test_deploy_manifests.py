"""deploy/kubernetes: every object valid against Kubernetes' schemas, and the objects consistent
with each other and with urc (docs/deploy.md).

Rendering: no kustomize or Helm is pip-installable, so tests/manifests.py applies the two
kustomization fields used here (`resources`, `namespace`) itself and refuses any other; where
`kubectl` is installed, its own `kubectl kustomize` render must give the same objects.

Schemas: built-in kinds with `kubernetes_validate` in strict mode (unknown fields fail) for
Kubernetes K8S_VERSIONS. kubernetes_validate has no CRD support, so the custom resources are
checked with jsonschema, unknown fields refused: the ServiceMonitor against
SERVICE_MONITOR_SCHEMA below, the Prometheus Operator's monitoring.coreos.com/v1 fields these
manifests use; the InferencePool and the HTTPRoute against their CRDs' own v1 schemas, vendored
in tests/data/crds/ (tests/crd_schemas.py). The inference-extension kustomization's own checks
are in test_deploy_inference_extension.py."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import fields
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from backends.real.process import EngineSpec, vllm_launch
from backends.tiny_checkpoint import write_tokenizer
from core.tokenizer import load_tokenizer
from router.gateway.config import GatewayConfig, load_config
from router.gateway.config_flags import apply_flags
from tests.crd_schemas import crd_schema
from tests.manifests import (
    KUBERNETES,
    KUSTOMIZATIONS,
    ROOT,
    Object,
    all_objects,
    container,
    container_port,
    containers,
    kustomize,
    label_selector,
    one,
    referenced_files,
    selects,
)
from urc.cli import build_parser

K8S_VERSIONS = ("1.31", kubernetes_validate.latest_version())
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}
# the custom resources' schemas, by kind (kubernetes_validate knows only the built-in kinds)
CUSTOM_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": SERVICE_MONITOR_SCHEMA,
    "InferencePool": crd_schema(
        "inferencepools.inference.networking.k8s.io",
        "inference.networking.k8s.io/v1",
        "InferencePool",
    ),
    "HTTPRoute": crd_schema(
        "httproutes.gateway.networking.k8s.io", "gateway.networking.k8s.io/v1", "HTTPRoute"
    ),
}
CONFIG_PATH = "/etc/urc/gateway.toml"


def gateway_flags() -> set[str]:
    parser, _ = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    gateway = commands.choices["gateway"]
    return {flag for action in gateway._actions for flag in action.option_strings}


def gateway_toml(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """The ConfigMap's gateway.toml parsed, and written to a file `load_config` can read."""
    import tomllib

    text = one("ConfigMap", "urc-gateway-config")["data"]["gateway.toml"]
    raw = tomllib.loads(text)
    known = {f.name for f in fields(GatewayConfig)}
    for key in raw["gateway"]:
        assert key in known, f"[gateway] {key} is not a GatewayConfig field"
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return raw, path


def engine_args() -> list[str]:
    return container(one("Deployment", "vllm-engine"), "vllm")["args"]


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# -- schemas -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_kubernetes_schemas(version):
    objects = all_objects()
    assert {o["kind"] for _, o in objects} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        *CUSTOM_SCHEMAS,
    }
    for _, obj in objects:
        if obj["kind"] in CUSTOM_SCHEMAS:
            jsonschema.Draft202012Validator(CUSTOM_SCHEMAS[obj["kind"]]).validate(obj)
        else:
            kubernetes_validate.validate(obj, version, strict=True)


def test_a_typo_fails_validation():
    deployment = json.loads(json.dumps(one("Deployment", "urc-gateway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    monitor = json.loads(json.dumps(one("ServiceMonitor", "urc-gateway")))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    pool = json.loads(json.dumps(one("InferencePool", "vllm-engine")))
    pool["spec"]["endpointPickerRef"]["failuremode"] = "FailOpen"  # failureMode
    route = json.loads(json.dumps(one("HTTPRoute", "urc-inference")))
    route["spec"]["rules"][0]["backendRefs"][0]["namepsace"] = "urc"
    bad_value = json.loads(json.dumps(one("InferencePool", "vllm-engine")))
    bad_value["spec"]["endpointPickerRef"]["failureMode"] = "FailClosed"  # not in the enum
    for obj in (monitor, pool, route, bad_value):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(CUSTOM_SCHEMAS[obj["kind"]]).validate(obj)


def test_every_yaml_file_is_in_a_kustomization_and_names_are_unique():
    used = set().union(*(referenced_files(KUBERNETES / name) for name in KUSTOMIZATIONS))
    files = {p.resolve() for p in KUBERNETES.rglob("*.y*ml")}
    assert files == {p.resolve() for p in used}
    keys = [
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for _, o in all_objects()
    ]
    assert len(keys) == len(set(keys))
    assert {
        o["metadata"].get("namespace") for _, o in all_objects() if o["kind"] != "Namespace"
    } == {"urc"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kubectl_kustomize_renders_what_the_tests_load(name):
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    objects = [doc for doc in yaml.safe_load_all(rendered) if doc is not None]

    def key(obj: Object) -> str:
        return json.dumps(obj, sort_keys=True)

    assert sorted(map(key, objects)) == sorted(map(key, kustomize(KUBERNETES / name)))


# -- the gateway -------------------------------------------------------------------------------


def test_gateway_command_and_config_are_the_gateways_own(tmp_path):
    deployment = one("Deployment", "urc-gateway")
    gateway = container(deployment, "gateway")
    assert gateway["command"][:2] == ["urc", "gateway"]
    argv = gateway["command"][2:] + gateway["args"]
    known = gateway_flags()
    for item in argv:
        assert not item.startswith("--") or item in known, f"{item} is not a flag of urc gateway"
    # each $(VAR) is an env var of the container (the kubelet leaves an unknown one as is)
    env = {e["name"] for e in gateway["env"]}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(argv))) <= env
    assert arg(argv, "--config") == CONFIG_PATH
    mount = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}["config"]
    volume = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["config"]
    assert volume["configMap"]["name"] == "urc-gateway-config"
    assert Path(mount) / "gateway.toml" == Path(CONFIG_PATH)

    # what `urc gateway` does with them: the file, then the flags, then validation
    raw, path = gateway_toml(tmp_path)
    parser, _ = build_parser()
    args = parser.parse_args(["gateway", *[str(path) if a == CONFIG_PATH else a for a in argv]])
    config = apply_flags(load_config(args.config), args)
    assert config.host == "0.0.0.0"
    assert config.salt_secret == "$(URC_SALT_SECRET)" and config.admin_key == "$(URC_ADMIN_KEY)"
    secrets = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in gateway["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }
    for var in ("URC_SALT_SECRET", "URC_ADMIN_KEY"):  # every replica the same, never missing
        assert secrets[var]["name"] == "urc-secrets" and not secrets[var].get("optional")
    assert container_port(deployment, "http") == config.port
    assert container_port(deployment, "metrics") == config.metrics_port

    # the tokenizer the init container fetches is the one [[models]] names
    init = container(deployment, "fetch-tokenizer")
    dest = {e["name"]: e.get("value") for e in init["env"]}["DEST"]
    (model,) = config.models
    assert model.tokenizer == dest
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    assert Path(dest).parent == Path(mounts["tokenizers"])
    assert arg(init["command"], "python") == "/etc/urc/fetch-tokenizer.py"


def test_gateway_rollout_probes_and_disruption_budget(tmp_path):
    deployment = one("Deployment", "urc-gateway")
    spec = deployment["spec"]
    replicas = spec["replicas"]
    assert replicas >= 2
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pods = spec["template"]["metadata"]["labels"]
    assert selects(spec["selector"]["matchLabels"], pods)
    raw, _ = gateway_toml(tmp_path)
    settings = raw["gateway"]
    stop = settings["shutdown_delay_s"] + settings["drain_timeout_s"]
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > stop
    gateway = container(deployment, "gateway")
    ready, live = gateway["readinessProbe"]["httpGet"], gateway["livenessProbe"]["httpGet"]
    assert ready["path"] == "/health" and live["path"] == "/health/live"
    # unready within the shutdown delay: endpoints drop the pod while it still serves
    probe = gateway["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] <= settings["shutdown_delay_s"]

    budget = one("PodDisruptionBudget", "urc-gateway")["spec"]
    assert selects(budget["selector"]["matchLabels"], pods)
    unavailable = budget.get("maxUnavailable", replicas - budget.get("minAvailable", replicas))
    assert 1 <= unavailable < replicas


def test_probe_and_service_ports_are_container_ports():
    deployments = [o for _, o in all_objects() if o["kind"] == "Deployment"]
    for deployment in deployments:
        for c in containers(deployment):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    (action,) = set(c[probe]) & {"httpGet", "grpc", "tcpSocket"}  # with a port
                    container_port(deployment, c[probe][action]["port"])
    services = [o for _, o in all_objects() if o["kind"] == "Service"]
    assert services
    for service in services:
        selector = service["spec"]["selector"]
        (target,) = [
            d for d in deployments if selects(selector, d["spec"]["template"]["metadata"]["labels"])
        ]
        for port in service["spec"]["ports"]:
            container_port(target, port["targetPort"])


def test_discovery_rbac_grants_pod_reads_to_the_gateway():
    role = one("Role", "urc-gateway-discovery")
    granted = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert {("", "pods", verb) for verb in ("get", "list", "watch")} <= granted
    assert all(v in ("get", "list", "watch") for _, _, v in granted)  # read-only
    binding = one("RoleBinding", "urc-gateway-discovery")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "urc-gateway-discovery",
    }
    account = one("Deployment", "urc-gateway")["spec"]["template"]["spec"]["serviceAccountName"]
    one("ServiceAccount", account)
    subject = {
        "kind": "ServiceAccount",
        "name": account,
        "namespace": binding["metadata"]["namespace"],
    }
    assert subject in binding["subjects"]


def test_service_monitor_scrapes_the_metrics_port(tmp_path):
    monitor = one("ServiceMonitor", "urc-gateway")["spec"]
    service = one("Service", "urc-gateway")
    assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    raw, _ = gateway_toml(tmp_path)
    assert (
        container_port(one("Deployment", "urc-gateway"), port["targetPort"])
        == raw["gateway"]["metrics_port"]
    )
    assert endpoint["path"] == "/metrics"


# -- the engines -------------------------------------------------------------------------------


def test_engine_runs_vllm_as_the_tests_launch_it():
    deployment = one("Deployment", "vllm-engine")
    vllm = container(deployment, "vllm")
    args = vllm["args"]
    spec = EngineSpec(
        model=arg(args, "--model"),
        port=8000,
        events_port=5557,
        replay_port=5558,
        names=[arg(args, "--served-model-name")],
        host="0.0.0.0",
        max_model_len=int(arg(args, "--max-model-len")),
        python="python3",
    )
    assert vllm["command"] + args == vllm_launch(spec).argv
    makefile = (ROOT / "Makefile").read_text()
    (version,) = re.findall(r"^VLLM_VERSION \?= (\S+)$", makefile, re.M)
    assert vllm["image"] == f"vllm/vllm-openai:v{version}"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_engine_annotations_and_labels_are_what_the_gateway_discovers(tmp_path):
    deployment = one("Deployment", "vllm-engine")
    template = deployment["spec"]["template"]["metadata"]
    notes, args = template["annotations"], engine_args()
    events = json.loads(arg(args, "--kv-events-config"))
    assert notes["urc.dev/engine"] == "vllm"
    assert notes["urc.dev/port"] == arg(args, "--port")
    assert container_port(deployment, int(notes["urc.dev/port"])) == int(arg(args, "--port"))
    assert notes["urc.dev/models"].split(",") == [arg(args, "--served-model-name")]
    assert notes["urc.dev/block-size"] == arg(args, "--block-size")
    assert (notes["urc.dev/kv-events"], notes["urc.dev/kv-replay"]) == (
        events["endpoint"],
        events["replay_endpoint"],
    )
    assert notes["urc.dev/kv-topic"] == events["topic"]
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    for endpoint in (events["endpoint"], events["replay_endpoint"]):
        container_port(deployment, int(endpoint.rsplit(":", 1)[1]))

    raw, _ = gateway_toml(tmp_path)
    settings = raw["gateway"]
    assert selects(label_selector(settings["discover_selector"]), template["labels"])
    assert not selects(
        label_selector(settings["discover_selector"]),
        one("Deployment", "urc-gateway")["spec"]["template"]["metadata"]["labels"],
    )
    assert settings["discover_port"] == int(notes["urc.dev/port"])
    (model,) = raw["models"]
    assert model["name"] == arg(args, "--served-model-name")
    assert model["block_size"] == int(arg(args, "--block-size"))
    init = container(one("Deployment", "urc-gateway"), "fetch-tokenizer")
    assert {e["name"]: e.get("value") for e in init["env"]}["HF_MODEL"] == arg(args, "--model")


# -- the init container's script ---------------------------------------------------------------


def serve_hub(directory: Path) -> tuple[ThreadingHTTPServer, list[str]]:
    """A hub on 127.0.0.1 that serves `directory/REPO/resolve/REV/FILE`; the Authorization
    headers it was sent are collected."""
    seen: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            super().do_GET()

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_fetch_tokenizer_script_gets_a_tokenizer_the_gateway_loads(tmp_path):
    script = tmp_path / "fetch-tokenizer.py"
    script.write_text(one("ConfigMap", "urc-gateway-config")["data"]["fetch-tokenizer.py"])
    hub = tmp_path / "hub"
    model = hub / "org" / "tiny" / "resolve" / "main"
    model.mkdir(parents=True)
    write_tokenizer(model, 300)
    server, seen = serve_hub(hub)
    dest = tmp_path / "models" / "tiny"
    env = {"HF_MODEL": "org/tiny", "DEST": str(dest), "HF_TOKEN": "hf-secret"}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}"
    run = partial(
        subprocess.run, [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    try:
        first = run(env=env)
        assert first.returncode == 0, first.stderr
        assert sorted(p.name for p in dest.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
        assert set(seen) == {"Bearer hf-secret"}
        expected = load_tokenizer(str(model)).encode("cache me")
        assert load_tokenizer(str(dest)).encode("cache me") == expected
        seen.clear()
        again = run(env=env)  # a restarted init container keeps what it has
        assert again.returncode == 0 and len(seen) == 3  # only the 3 files still missing
        missing = run(env={**env, "HF_MODEL": "org/none", "DEST": str(tmp_path / "none")})
        assert missing.returncode == 1 and "not found" in missing.stderr
    finally:
        server.shutdown()
        server.server_close()
