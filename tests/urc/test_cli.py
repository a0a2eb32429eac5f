"""The `urc` entry point: every docs/cli.md subcommand is listed; the built ones run."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from urc.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "urc.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("gateway", "worker", "cluster", "replay", "bench"):
        assert name in out
    assert "torch" in out


def test_unbuilt_engines_say_which_issue_and_fail(capsys):
    assert main(["worker", "--engine", "nonesuch"]) == 2
    assert "issue" in capsys.readouterr().err


def test_every_subcommand_has_help():
    for name in SUBCOMMANDS:
        out = subprocess.run(
            [sys.executable, "-m", "urc.cli", name, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "usage" in out.stdout.lower(), name


def test_keys_prints_one_key_per_full_block(capsys):
    assert main(["keys", "x" * 40, "--block-size", "16"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_version_is_the_distributions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = subprocess.run(
        [sys.executable, "-m", "urc.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert out == f"urc {project['version']}\n"


def test_version_from_a_checkout_that_is_not_installed():
    """`-S`: no site-packages, so no installed distribution: pyproject.toml beside the source."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    code = f"import sys; sys.path[:0] = [{str(ROOT)!r}]; import urc.cli; print(urc.cli.version())"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out == f"{project['version']}\n"


def test_the_host_tier_flags_reach_the_workers_and_parse_on_each_command():
    from backends.emulated.server import build_engine, build_parser
    from router.gateway.config import GatewayConfig
    from simulation.cli import build_parser as replay_parser
    from urc.cli import build_parser as urc_parser
    from urc.cluster import worker_argv

    flags = ["--host-capacity-tokens", "1600000", "--host-copy-tokens-per-s", "250000"]
    args = urc_parser()[0].parse_args(["cluster", "--workers", "2", *flags])
    argv = worker_argv(args, GatewayConfig())
    assert argv[argv.index("--host-capacity-tokens") + 1] == "1600000"
    assert argv[argv.index("--host-copy-tokens-per-s") + 1] == "250000.0"
    worker = build_engine(build_parser().parse_args(argv[3:]))
    assert worker.config.host_capacity_tokens == 1_600_000
    assert worker.engine.host is not None and worker.engine.host.capacity_tokens == 1_600_000
    assert worker.info()["host_copy_tokens_per_s"] == 250_000.0
    torch = urc_parser()[0].parse_args(["cluster", "--engine", "torch", *flags])
    with pytest.raises(ValueError):
        worker_argv(torch, GatewayConfig())
    plain = worker_argv(urc_parser()[0].parse_args(["cluster"]), GatewayConfig())
    assert "--host-capacity-tokens" not in plain
    replay = replay_parser().parse_args(["trace.jsonl", *flags])
    assert (replay.host_capacity_tokens, replay.host_copy_tokens_per_s) == (1_600_000, 250_000.0)
