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


def _help(*command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "urc.cli", *command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def _group_titles(out: str) -> list[str]:
    return [line[:-1] for line in out.splitlines() if line and line[0] != " " and line[-1] == ":"]


def _options_without_help(out: str) -> list[str]:
    """Option lines of a --help with no text: none after the flag, none on the next line."""
    lines = out.splitlines()
    return [
        line.strip()
        for line, after in zip(lines, [*lines[1:], ""], strict=True)
        if line.startswith("  -") and "  " not in line.strip() and not after.startswith(" " * 24)
    ]


def test_gateway_help_groups_its_options_essentials_first():
    out = _help("gateway")
    titles = _group_titles(out)
    assert titles[:3] == ["options", "essentials", "workers, models and discovery"]
    assert len(titles) >= 10
    essentials = out.split("essentials:\n")[1].split("\n\n")[0]
    for flag in ("--config", "--host", "--port", "--policy", "--worker", "--api-key"):
        assert f"  {flag} " in essentials, flag
    assert "--drain-timeout" not in essentials


def test_cluster_help_gives_its_own_options_first():
    out = _help("cluster")
    assert _group_titles(out)[:4] == [
        "options",
        "cluster",
        "real engines (--engine vllm|sglang)",
        "essentials",
    ]
    assert "the workers' engine" in out.split("--engine {")[1].split("--worker-arg")[0]


@pytest.mark.parametrize("command", ["gateway", "epp", "cluster", "keys"])
def test_every_option_has_help(command):
    assert _options_without_help(_help(command)) == []


@pytest.mark.parametrize("command", ["gateway", "cluster", "epp"])
def test_a_prefix_of_a_flag_is_an_error(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([command, "--print-config", "--drain-time", "5"])
    assert exit.value.code == 2
    assert "--drain-time" in capsys.readouterr().err


def test_cluster_prints_the_merged_config(capsys):
    assert main(["cluster", "--print-config", "--port", "9123", "--policy", "round_robin"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)["gateway"]
    assert (printed["port"], printed["policy"]) == (9123, "round_robin")


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
    assert argv[2:6] == ["urc.cli", "worker", "--engine", "emulated"]
    worker = build_engine(build_parser().parse_args(argv[6:]))
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
