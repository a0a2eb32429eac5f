"""The Dockerfile, read as docker would (docker itself is not run): a builder stage with the
compiler, a runtime stage without it, a non-root user, a healthcheck of what CMD serves, and
the extras and the version the deploy/ manifests rely on."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import yaml

from urc.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what the manifests' commands need beyond the core install
EXTRA_OF = {"epp": "epp", "--discover-namespace": "k8s"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for op, args in instructions():
        if op == "FROM":
            out.append([])
        if out:
            out[-1].append((op, args))
    return out


def args_of(stage: list[tuple[str, str]], op: str) -> list[str]:
    return [args for o, args in stage if o == op]


def installed_extras() -> set[str]:
    builder = stages()[0]
    default = dict(a.split("=", 1) for a in args_of(builder, "ARG"))["URC_EXTRAS"]
    (install,) = [r for r in args_of(builder, "RUN") if "pip install" in r]
    assert '".[${URC_EXTRAS}]"' in install
    return set(default.split(","))


def test_a_builder_with_the_compiler_and_a_runtime_without_it():
    builder, runtime = stages()
    assert args_of(builder, "FROM")[0].endswith(" AS builder")
    assert any("gcc" in r for r in args_of(builder, "RUN"))
    assert not any("gcc" in r or "apt-get" in r for r in args_of(runtime, "RUN"))
    assert any(c.startswith("--from=builder ") for c in args_of(runtime, "COPY"))
    copied = {f for c in args_of(builder, "COPY") for f in c.split()}  # sources and targets
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in find["include"]}
    needed = {"pyproject.toml", "setup.py", "third_party", PYPROJECT["project"]["readme"]}
    assert packages | needed | set(PYPROJECT["project"]["license-files"]) <= copied


def test_runtime_runs_as_a_non_root_user():
    (user,) = args_of(stages()[-1], "USER")
    assert user.split(":")[0] == "10001"


def test_the_healthcheck_and_the_command_serve_the_same_port():
    runtime = stages()[-1]
    command = json.loads(args_of(runtime, "CMD")[-1])
    assert command[0] == "urc"
    parser, _ = build_parser()
    args = parser.parse_args(command[1:])
    assert args.host == "0.0.0.0"
    env = " ".join(args_of(runtime, "ENV"))
    url = urlparse(re.search(r"URC_HEALTH_URL=(\S+)", env).group(1))
    assert (url.hostname, url.port, url.path) == ("127.0.0.1", args.port, "/health/live")
    (health,) = args_of(runtime, "HEALTHCHECK")
    probe = json.loads(health[health.index(" CMD ") + 5 :])
    assert probe[0] == "python" and "URC_HEALTH_URL" in probe[-1]
    assert str(args.port) in args_of(runtime, "EXPOSE")[0].split()


def test_extras_exist_and_cover_what_the_manifests_run():
    extras = installed_extras()
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])
    version = PYPROJECT["project"]["version"]
    for path in sorted((ROOT / "deploy" / "kubernetes").rglob("deployment.yaml")):
        spec = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            repo, _, tag = container["image"].rpartition(":")
            if not repo.endswith("urc"):
                continue
            assert tag == version, f"{path}: {container['image']} is not urc:{version}"
            line = container["command"] + container.get("args", [])
            assert line[0] in ("urc", "python"), line  # both on the image's PATH
            for word, extra in EXTRA_OF.items():
                assert word not in line or extra in extras, f"{path}: {word} needs [{extra}]"


def test_the_build_context_leaves_out_host_builds():
    """A host's .so in the context would be copied over the builder's own."""
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", "**/*.so", "build", ".git"} <= ignored
