"""The objects of deploy/kubernetes's kustomizations, loaded as `kubectl kustomize` renders them
as far as those kustomizations go: `resources` (files, and folders holding a kustomization) and
`namespace` (set on every namespaced object, and on a binding's ServiceAccount subjects that
name none, as kustomize does). Any other kustomization field fails the load, so a
kustomization cannot grow past what this loader renders faithfully without the tests noticing
(tests/urc/test_deploy_manifests.py also compares it with kubectl's own render where kubectl is
installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
# the kustomizations: the gateway, its ServiceMonitor, the example engines, urc as a Gateway API
# gateway's endpoint picker (docs/deploy.md)
KUSTOMIZATIONS = ("base", "monitoring", "vllm-engine", "inference-extension")

Object = dict[str, Any]

_FIELDS = {"apiVersion", "kind", "namespace", "resources"}
# kinds without a namespace among those a kustomization here may hold
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


def yaml_documents(path: Path) -> list[Object]:
    """Every non-empty document of a YAML file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomize(directory: Path) -> list[Object]:
    """The objects `kubectl kustomize directory` gives, in the order of its `resources`."""
    (spec,) = yaml_documents(directory / "kustomization.yaml")
    unknown = set(spec) - _FIELDS
    assert not unknown, f"{directory}: kustomization fields this loader does not render: {unknown}"
    assert spec["kind"] == "Kustomization", directory
    objects: list[Object] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        objects += kustomize(path) if path.is_dir() else yaml_documents(path)
    namespace = spec.get("namespace")
    if namespace is not None:
        for obj in objects:
            if obj["kind"] not in _CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
            for subject in obj.get("subjects", []):  # a (Cluster)RoleBinding's
                if subject["kind"] == "ServiceAccount" and not subject.get("namespace"):
                    subject["namespace"] = namespace
    return objects


def referenced_files(directory: Path) -> set[Path]:
    """The kustomization files and resource files a kustomization reads, its own included."""
    (spec,) = yaml_documents(directory / "kustomization.yaml")
    files = {directory / "kustomization.yaml"}
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        files |= referenced_files(path) if path.is_dir() else {path}
    return files


def all_objects() -> list[tuple[str, Object]]:
    """(kustomization, object) for every object of every kustomization."""
    return [(name, obj) for name in KUSTOMIZATIONS for obj in kustomize(KUBERNETES / name)]


def one(kind: str, name: str) -> Object:
    """The object of that kind and name (there must be exactly one)."""
    found = [o for _, o in all_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A `matchLabels`-style selector (or a Service's) matches these labels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def label_selector(text: str) -> dict[str, str]:
    """An equality-based label selector string `k=v,k2=v2` as a dict (set-based forms fail)."""
    pairs = [item.split("=") for item in text.split(",")]
    assert all(len(p) == 2 and p[0] and p[1] for p in pairs), f"not k=v,...: {text!r}"
    return {k.strip(): v.strip() for k, v in pairs}


def containers(deployment: Object) -> list[Object]:
    """A Deployment's init containers, then its containers."""
    spec = deployment["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def container(deployment: Object, name: str) -> Object:
    """The (init) container of that name."""
    (found,) = [c for c in containers(deployment) if c["name"] == name]
    return found


def container_port(deployment: Object, port: int | str) -> int:
    """The containerPort a probe's or a Service's port (a name or a number) reaches."""
    ports = [p for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
    found = [p["containerPort"] for p in ports if port in (p.get("name"), p["containerPort"])]
    assert len(found) == 1, f"port {port!r} is not one container port of {ports}"
    return found[0]
