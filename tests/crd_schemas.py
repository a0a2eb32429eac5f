"""The custom resources' schemas the deploy/kubernetes tests validate with (tests/data/crds/: a
CRD's v1 openAPIV3Schema, vendored with its source named in the file's header), made strict.

An API server prunes the fields a structural schema does not declare, so a misspelt field is
silently dropped there; `strict` makes jsonschema refuse it instead, so a typo fails the test."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CRDS = Path(__file__).resolve().parent / "data" / "crds"

# the ObjectMeta fields these manifests use: the CRDs' schemas leave metadata open
_METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of an openAPIV3Schema in which every object that lists `properties`, sets no
    `additionalProperties` and does not preserve unknown fields refuses other fields."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for key, value in node.items():
                # under `properties` the keys are field names, whose values are schemas
                children = value.values() if key == "properties" else [value]
                for child in children:
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(schema)
    return schema


def crd_schema(plural_group: str, api_version: str, kind: str) -> dict[str, Any]:
    """The strict schema of an object of `kind` at `api_version`, from
    tests/data/crds/PLURAL.GROUP.VERSION.yaml; apiVersion, kind, metadata and spec required."""
    version = api_version.rsplit("/", 1)[1]
    schema = strict(yaml.safe_load((CRDS / f"{plural_group}.{version}.yaml").read_text()))
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = _METADATA
    schema["required"] = sorted(
        {*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"}
    )
    return schema
