"""The config file (docs/config.md): a wrong type or an unknown key stops a real `urc gateway`
before it listens, naming the key and the file; `--print-config` loads back to the same config;
the reference table lists every setting with a flag that exists."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from router.gateway.config import ConfigError, load_config
from router.gateway.config_flags import add_gateway_arguments, apply_flags
from router.gateway.config_print import MASK, config_toml
from router.gateway.config_schema import (
    GatewayConfig,
    ModelConfig,
    TenantConfig,
    WorkerConfig,
    flag_of,
)
from router.rollout_plan import RolloutPlan
from urc.cli import build_parser
from urc.processes import ROOT

WORKERS = '[[workers]]\nurl = "http://127.0.0.1:1"\n'


def urc(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "urc.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ('[gateway]\nport = "abc"\n' + WORKERS, "[gateway].port", "expected `int`, got `str`"),
        (
            '[gateway]\nhealth_interval_s = "fast"\n' + WORKERS,
            "[gateway].health_interval_s",
            "expected `float`, got `str`",
        ),
        (WORKERS + WORKERS + "kv_topic = 5\n", "workers[1].kv_topic", "expected `str`"),
        ("[gateway]\nprot = 8001\n" + WORKERS, "[gateway].prot", "did you mean 'port'"),
        (WORKERS + "kv_topik = 'kv'\n", "workers[0].kv_topik", "unknown key"),
        ('[[models]]\nname = "m"\nalias = ["x"]\n' + WORKERS, "models[0].alias", "unknown"),
        ('[[tenants]]\nname = "t"\napi_keys = ["k"]\nlevel = 1\n', "tenants[0].level", "unknown"),
        ("[gateway]\ndrain_timeout_s = -1\n" + WORKERS, "drain_timeout_s", "> 0.0, got -1"),
        ('[gateway]\nlog_level = "loud"\n' + WORKERS, "[gateway].log_level", "'debug'"),
        ('[[tenants]]\nname = "t"\napi_keys = "sk-9"\n', "tenants[0].api_keys", "`array`"),
    ],
)
def test_a_bad_config_file_stops_the_gateway_naming_the_key_and_the_file(
    tmp_path: Path, text: str, key: str, why: str
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    done = urc("gateway", "--config", str(path), "--port", "0")
    assert done.returncode == 2, done.stderr
    assert key in done.stderr and str(path) in done.stderr and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "" and "sk-9" not in done.stderr


def test_print_config_loads_back_to_the_merged_config(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[gateway]\nport = 9100\npolicy = "sglang"\ndrain_timeout_s = 5\nadmin_key = "k-admin"\n'
        '[gateway.policy_params]\ntree_size = "index"\n'
        '[[workers]]\nurl = "http://10.0.0.7:8000"\nmodels = ["m"]\nengine = "vllm"\n'
        'kv_topic = "a \\"quoted\\"\\ttopic"\n'
        '[[models]]\nname = "m"\nblock_size = 32\naliases = ["m2"]\n'
        '[[tenants]]\nname = "acme"\napi_keys = ["sk-1"]\nisolation = "user"\n'
    )
    flags = ["--config", str(path), "--worker-urls", "http://127.0.0.1:9001", "http://h:9002"]
    flags += ["--cache-threshold", "0.4", "--max-concurrent-requests", "8", "--access-log"]
    flags += ["--prometheus-port", "9200", "--salt-secret", "s3cret"]
    flags += ["--shadow-policy", "round_robin"]
    flags += ["--rollout-policy", "cache_aware", "--rollout-steps", "5,100"]
    flags += ["--rollout-policy-param", "externality=0.5", "--rollout-dwell", "60"]
    done = urc("gateway", *flags, "--print-config")
    assert done.returncode == 0, done.stderr
    assert not any(secret in done.stdout for secret in ("k-admin", "s3cret", "sk-1"))
    printed = tmp_path / "printed.toml"
    printed.write_text(done.stdout)
    parser, _ = build_parser()
    merged = apply_flags(load_config(path), parser.parse_args(["gateway", *flags]))
    masked = replace(merged, admin_key=MASK, salt_secret=MASK)
    masked.tenants = [TenantConfig("acme", [MASK], "user")]
    assert load_config(printed) == masked
    assert merged.metrics_port == 9200 and merged.max_concurrent_requests == 8
    assert merged.policy_params == {"tree_size": "index", "cache_threshold": 0.4}
    assert merged.rollout.steps == "5,100" and merged.rollout.dwell_s == 60
    assert merged.rollout.policy_params == {"externality": "0.5"}
    assert [w.url for w in merged.workers][1:] == ["http://127.0.0.1:9001", "http://h:9002"]
    assert config_toml(merged, mask=False).count("s3cret") == 1
    assert urc("epp", *flags, "--print-config").stdout == done.stdout


def _parse(*argv: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    return apply_flags(load_config(None), parser.parse_args(list(argv)))


def test_their_policies_and_thresholds_map_or_are_refused_clearly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ConfigError, match="no 'random' policy: power_of_two"):
        _parse("--policy", "random")
    sglang = _parse(
        "--policy", "sglang", "--balance-abs-threshold", "8", "--cache-threshold", "0.5"
    )
    assert sglang.policy_params == {"cache_threshold": 0.5, "balance_abs_threshold": 8}
    ours = _parse("--policy", "cache_aware", "--balance-rel-threshold", "2", "--max-tree-size", "9")
    assert ours.policy_params == {}
    assert "--balance-rel-threshold ignored" in caplog.text and "--max-tree-size" in caplog.text
    with pytest.raises(ConfigError, match=r"\[gateway.policy_params\]: .*cache_threshold"):
        _parse("--policy", "sglang", "--cache-threshold", "2")  # outside [0, 1]
    with pytest.raises(ConfigError, match=r"max_concurrent_requests \(--max-concurrent-requests"):
        _parse("--max-concurrent-requests", "-1")


def _table(text: str, heading: str) -> dict[str, str]:
    """The rows of the table under `heading`: first cell's name -> the whole row."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|(.*)$", section, flags=re.MULTILINE)
    return dict(rows)


def test_the_reference_table_lists_every_setting_with_its_flag() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    known = set(re.findall(r"(?<![\w-])--[\w-]+", parser.format_help()))
    rows = _table(text, "[gateway]")
    assert set(rows) == {f.name for f in fields(GatewayConfig)}
    for name, row in rows.items():
        flags = set(re.findall(r"`(--[\w-]+)", row))
        assert flags <= known, (name, flags - known)
        flag = flag_of(name)
        assert flag is None or flag in flags, (name, flag)
    for heading, cls in (
        ("[[workers]]", WorkerConfig),
        ("[[models]]", ModelConfig),
        ("[[tenants]]", TenantConfig),
        ("[gateway.rollout]", RolloutPlan),
    ):
        assert set(_table(text, heading)) == {f.name for f in fields(cls)}, heading


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("port = 8000\n", "unknown key 'port' at the top level: did you mean [gateway] port?"),
        ("prot = 8000\n", "unknown key 'prot' at the top level: did you mean [gateway] port?"),
        ("zzz = 1\n", "unknown key 'zzz' at the top level (settings go in [gateway])"),
        ("[gatway]\nport = 8000\n", "unknown table [gatway]; did you mean [gateway]?"),
        (
            '[[tenants]]\nname = "t"\n',
            "tenants[0].api_keys (tenant 't'): one or more keys, none empty",
        ),
    ],
)
def test_a_misplaced_key_is_pointed_to_its_table(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == f"config {path}: {error}"


def test_a_bare_api_key_is_the_default_tenants_in_flags_and_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[[tenants]]\napi_keys = ["sk-123"]\n')
    from_file = load_config(path).tenants
    from_flag = _parse("--api-key", "sk-123").tenants
    assert from_file == from_flag == [TenantConfig("default", ["sk-123"])]
    mixed = _parse("--api-key", "sk-1", "--api-key", "acme:sk-2", "--api-key", "sk-3").tenants
    assert mixed == [TenantConfig("default", ["sk-1", "sk-3"]), TenantConfig("acme", ["sk-2"])]
    for bad in ("", "acme:", ":sk-1"):
        with pytest.raises(ConfigError, match=r"--api-key wants \[TENANT:\]KEY"):
            _parse("--api-key", bad)
