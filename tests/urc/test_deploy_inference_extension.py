"""deploy/kubernetes/inference-extension: urc epp as the endpoint picker of a Gateway API gateway
(the Gateway API Inference Extension), consistent with itself, with the engines and with the
gateway's own manifests (docs/deploy.md, "Behind a Gateway API gateway"). The objects' schemas
(the InferencePool's and HTTPRoute's CRDs included) are checked in test_deploy_manifests.py."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path
from typing import Any

from router.gateway.config import GatewayConfig, load_config
from router.gateway.config_flags import apply_flags
from tests.manifests import (
    Object,
    container,
    container_port,
    label_selector,
    one,
    selects,
)
from urc.cli import build_parser

CONFIG_PATH = "/etc/urc/epp.toml"
GRPC_PORT = 9002  # GIE's convention for the EPP's ext_proc port


def epp_flags() -> set[str]:
    """The flags `urc epp` takes."""
    parser, _ = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {flag for action in commands.choices["epp"]._actions for flag in action.option_strings}


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def epp() -> Object:
    return container(one("Deployment", "urc-epp"), "epp")


def epp_argv() -> list[str]:
    return epp()["command"][2:] + epp()["args"]


def epp_config(tmp_path: Path) -> tuple[dict[str, Any], GatewayConfig]:
    """epp.toml parsed, and the settings `urc epp` runs with: the file, then the flags."""
    text = one("ConfigMap", "urc-epp-config")["data"]["epp.toml"]
    path = tmp_path / "epp.toml"
    path.write_text(text)
    parser, _ = build_parser()
    args = parser.parse_args(["epp", *[str(path) if a == CONFIG_PATH else a for a in epp_argv()]])
    return tomllib.loads(text), apply_flags(load_config(args.config), args)


def pod_labels(deployment: str) -> dict[str, str]:
    return one("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


def test_pool_selects_the_engine_pods_the_epp_discovers_and_nothing_else(tmp_path):
    spec = one("InferencePool", "vllm-engine")["spec"]
    selector = spec["selector"]["matchLabels"]
    assert selects(selector, pod_labels("vllm-engine"))
    assert not selects(selector, pod_labels("urc-gateway"))
    assert not selects(selector, pod_labels("urc-epp"))
    raw, config = epp_config(tmp_path)
    # the pods the gateway may send to are the pods the EPP picks from
    assert label_selector(raw["gateway"]["discover_selector"]) == selector
    assert (
        config.discover == "k8s" and arg(epp_argv(), "--discover-namespace") == "$(POD_NAMESPACE)"
    )
    engine = one("Deployment", "vllm-engine")
    notes = engine["spec"]["template"]["metadata"]["annotations"]
    (target,) = spec["targetPorts"]
    assert target["number"] == container_port(engine, "http") == config.discover_port
    assert target["number"] == int(notes["urc.dev/port"])


def test_endpoint_picker_ref_is_the_epp_services_grpc_port():
    ref = one("InferencePool", "vllm-engine")["spec"]["endpointPickerRef"]
    # the CRD's defaults, and its CEL rule (which jsonschema does not run): a Service needs a port
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
    assert "port" in ref
    assert ref["failureMode"] == "FailClose"  # no request reaches a pod without urc's salt
    service = one("Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port["appProtocol"] == "http2" and port["protocol"] == "TCP"
    deployment = one("Deployment", "urc-epp")
    assert selects(service["spec"]["selector"], pod_labels("urc-epp"))
    assert not selects(service["spec"]["selector"], pod_labels("urc-gateway"))
    grpc_port = int(arg(epp_argv(), "--grpc-port"))
    assert container_port(deployment, port["targetPort"]) == grpc_port == GRPC_PORT


def test_route_sends_the_gateways_requests_to_the_pool(tmp_path):
    route = one("HTTPRoute", "urc-inference")["spec"]
    (parent,) = route["parentRefs"]
    assert parent["group"] == "gateway.networking.k8s.io" and parent["kind"] == "Gateway"
    assert "namespace" not in parent  # the Gateway is in the route's namespace (docs/deploy.md)
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    one("InferencePool", backend["name"])
    assert "port" not in backend  # an InferencePool's ports are its targetPorts
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    _, config = epp_config(tmp_path)
    (seconds,) = re.fullmatch(r"(\d+)s", rule["timeouts"]["request"]).groups()
    assert int(seconds) == config.request_timeout_s


def test_epp_command_secrets_and_config_are_urcs_own(tmp_path):
    deployment = one("Deployment", "urc-epp")
    picker = epp()
    assert picker["command"][:2] == ["urc", "epp"]
    argv = epp_argv()
    known = epp_flags()
    flags = [item for item in argv if item.startswith("--")]
    assert set(flags) <= known, f"not flags of urc epp: {set(flags) - known}"
    env = {e["name"] for e in picker["env"]}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(argv))) <= env
    assert arg(argv, "--config") == CONFIG_PATH
    mount = {m["name"]: m["mountPath"] for m in picker["volumeMounts"]}["config"]
    volume = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}["config"]
    assert volume["configMap"]["name"] == "urc-epp-config"
    assert Path(mount) / "epp.toml" == Path(CONFIG_PATH)

    _, config = epp_config(tmp_path)
    assert config.salt_secret == "$(URC_SALT_SECRET)" and config.admin_key == "$(URC_ADMIN_KEY)"
    # the gateway's secrets exactly: a tenant's cache_salt is the same through either front door
    gateway = container(one("Deployment", "urc-gateway"), "gateway")

    def secrets(c: Object) -> dict[str, Any]:
        return {
            e["name"]: e["valueFrom"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})
        }

    assert secrets(picker) == secrets(gateway)
    assert all(not ref["secretKeyRef"].get("optional") for ref in secrets(picker).values())
    assert container_port(deployment, "metrics") == config.metrics_port


def test_epp_knows_the_same_models_and_fetches_their_tokenizers_as_the_gateway():
    epp_toml = tomllib.loads(one("ConfigMap", "urc-epp-config")["data"]["epp.toml"])
    gateway_toml = tomllib.loads(one("ConfigMap", "urc-gateway-config")["data"]["gateway.toml"])
    assert epp_toml["models"] == gateway_toml["models"]
    for key in ("policy", "discover", "discover_selector", "discover_port", "index_max_blocks"):
        assert epp_toml["gateway"][key] == gateway_toml["gateway"][key], key
    script = "fetch-tokenizer.py"
    assert (
        one("ConfigMap", "urc-epp-config")["data"][script]
        == one("ConfigMap", "urc-gateway-config")["data"][script]
    )
    deployment = one("Deployment", "urc-epp")
    init = container(deployment, "fetch-tokenizer")
    values = {e["name"]: e.get("value") for e in init["env"]}
    gateway_init = container(one("Deployment", "urc-gateway"), "fetch-tokenizer")
    assert init == gateway_init  # the same image, model, destination, secret and mounts
    (model,) = epp_toml["models"]
    assert model["tokenizer"] == values["DEST"]
    mounts = {m["name"]: m["mountPath"] for m in epp()["volumeMounts"]}
    assert Path(values["DEST"]).parent == Path(mounts["tokenizers"])


def test_epp_probes_rollout_and_disruption_budget(tmp_path):
    deployment = one("Deployment", "urc-epp")
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert selects(spec["selector"]["matchLabels"], pod_labels("urc-epp"))
    grpc_port = int(arg(epp_argv(), "--grpc-port"))
    # gRPC health on the ext_proc port, under the service names urc epp registers
    ready, live = epp()["readinessProbe"], epp()["livenessProbe"]
    assert ready["grpc"] == {"port": grpc_port, "service": "readiness"}
    assert live["grpc"] == {"port": grpc_port, "service": "liveness"}
    raw, _ = epp_config(tmp_path)
    settings = raw["gateway"]
    stop = settings["shutdown_delay_s"] + settings["drain_timeout_s"]
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > stop
    # unready within the shutdown delay: the EPP Service drops the pod while it still serves
    assert ready["periodSeconds"] * ready["failureThreshold"] <= settings["shutdown_delay_s"]
    budget = one("PodDisruptionBudget", "urc-epp")["spec"]
    assert selects(budget["selector"]["matchLabels"], pod_labels("urc-epp"))
    assert 1 <= budget["maxUnavailable"] < spec["replicas"]


def test_epp_rbac_reads_only_pods():
    role = one("Role", "urc-epp-discovery")
    granted = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == {("", "pods", verb) for verb in ("get", "list", "watch")}
    binding = one("RoleBinding", "urc-epp-discovery")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "urc-epp-discovery",
    }
    account = one("Deployment", "urc-epp")["spec"]["template"]["spec"]["serviceAccountName"]
    one("ServiceAccount", account)
    namespace = binding["metadata"]["namespace"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    ]
