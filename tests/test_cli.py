"""The `urc` entry point: every DESIGN §6 subcommand is listed; the built ones run."""

from __future__ import annotations

import subprocess
import sys

from router.cli import SUBCOMMANDS, main


def test_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("gateway", "worker", "cluster", "replay", "bench"):
        assert name in out
    assert "issue 5" in out  # not-yet-built commands say which issue brings them


def test_unbuilt_commands_say_which_issue_and_fail(capsys):
    assert main(["replay"]) == 2
    assert f"issue {SUBCOMMANDS['replay'][1]}" in capsys.readouterr().err


def test_keys_prints_one_key_per_full_block(capsys):
    assert main(["keys", "x" * 40, "--block-size", "16"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
