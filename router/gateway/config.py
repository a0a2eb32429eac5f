"""Gateway configuration: a TOML file and/or command-line flags (flags win), its types and limits
checked by msgspec. The settings: config_schema.py (every one, its type, default and flag:
docs/config.md); the flags: config_flags.py."""

from __future__ import annotations

import difflib
import importlib.util
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgspec

from router.gateway.config_schema import (
    ENGINES,
    FAIRNESS,
    ISOLATION_LEVELS,
    LOG_FORMATS,
    LOG_LEVELS,
    SECRETS,
    TABLES,
    GatewayConfig,
    ModelConfig,
    TenantConfig,
    WorkerConfig,
    flag_of,
)
from router.policies import POLICY_NAMES, make_policy

__all__ = [
    "ConfigError",
    "GatewayConfig",
    "ModelConfig",
    "TenantConfig",
    "WorkerConfig",
    "check",
    "load_config",
    "parse_config",
    "validate",
]


class ConfigError(ValueError):
    pass


_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]")


def load_config(path: str | Path | None = None) -> GatewayConfig:
    """Read a TOML file (None: all defaults); a wrong type, a value out of range or an unknown
    key: ConfigError naming the file and the key."""
    if path is None:
        return GatewayConfig()
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    try:
        config = parse_config(raw)
        check(config)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    return config


def parse_config(raw: dict[str, Any]) -> GatewayConfig:
    """A parsed TOML document: `[gateway]`, `[[workers]]`, `[[models]]`, `[[tenants]]`."""
    settings = {f.name for f in fields(GatewayConfig)} - set(TABLES)
    _top_level(raw, settings)
    gateway = raw.get("gateway", {})
    if not isinstance(gateway, dict):
        raise ConfigError("[gateway] must be a table")
    _known(gateway, settings, "[gateway].", "setting")
    merged = dict(gateway)
    for key, cls in TABLES.items():
        entries = raw.get(key, [])
        if isinstance(entries, list):
            names = {f.name for f in fields(cls)}
            for i, entry in enumerate(entries):
                if isinstance(entry, dict):
                    _known(entry, names, f"{key}[{i}].", "key")
        merged[key] = entries
    return _convert(merged, merged)


def _top_level(raw: dict[str, Any], settings: set[str]) -> None:
    """Only `[gateway]` and the arrays of tables live at the top: a setting written there (a
    flat `port = 8000`) is pointed to its table, a misspelt table to the nearest one."""
    for key, value in raw.items():
        if key == "gateway" or key in TABLES:
            continue
        if isinstance(value, dict):
            close = difflib.get_close_matches(key, ["gateway", *TABLES], n=1)
            hint = f"; did you mean [{close[0]}]?" if close else ""
            raise ConfigError(f"unknown table [{key}]{hint}")
        setting = difflib.get_close_matches(key, settings, n=1)
        hint = (
            f": did you mean [gateway] {setting[0]}?" if setting else " (settings go in [gateway])"
        )
        raise ConfigError(f"unknown key {key!r} at the top level{hint}")


def _known(table: dict[str, Any], known: set[str], where: str, what: str) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown {what} {where}{key}{hint}")


def _convert(merged: dict[str, Any], raw: dict[str, Any], flags: bool = False) -> GatewayConfig:
    """msgspec's typed conversion; its error names the key as the file spells it (and its flag,
    after the flags)."""
    try:
        return msgspec.convert(merged, GatewayConfig)
    except msgspec.ValidationError as exc:
        message, _, at = str(exc).partition(" - at `")
        path = at.rstrip("`") or "$"
        key = _key(path)
        flag = flag_of(key.removeprefix("[gateway].")) if flags else None
        shown = f"{key} ({flag})" if flag else key
        raise ConfigError(f"{shown}: {_expected(message, raw, path)}") from None


def _key(path: str) -> str:
    """msgspec's `$.port`, `$.workers[1].kv_topic` as the file's `[gateway].port`,
    `workers[1].kv_topic`."""
    parts = path.removeprefix("$")
    head = _PATH_PART.match(parts)
    if head is None or head.group(1) in TABLES:
        return parts.lstrip(".") or "[gateway]"
    return "[gateway]" + parts


def _expected(message: str, raw: dict[str, Any], path: str) -> str:
    """msgspec's message, and the value it was about (not a secret's)."""
    message = message[:1].lower() + message[1:]
    value: Any = raw
    for name, index in _PATH_PART.findall(path.removeprefix("$")):
        if name in SECRETS or name == "api_keys":
            return message
        try:
            value = value[name] if name else value[int(index)]
        except (KeyError, IndexError, TypeError):
            return message
    if isinstance(value, dict | list):
        return message
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"{message} ({shown})" if "got" in message else f"{message}, got {shown}"


def check(config: GatewayConfig) -> None:
    """Types and limits (msgspec), then the rules across settings; ConfigError names the key."""
    builtins = msgspec.to_builtins(config)
    _convert(builtins, builtins, flags=True)
    if config.policy not in POLICY_NAMES:
        raise ConfigError(f"[gateway].policy (--policy): {_unknown_policy(config.policy)}")
    for name in config.shadow_policies:
        if name not in POLICY_NAMES:
            raise ConfigError(f"[gateway].shadow_policies: {_unknown_policy(name)}")
    try:
        make_policy(config.policy, **config.policy_params)
    except ValueError as exc:
        raise ConfigError(f"[gateway.policy_params]: {exc}") from None
    _check_rollout(config)
    _one_of("[gateway].log_level", config.log_level, LOG_LEVELS)
    _one_of("[gateway].log_format", config.log_format, LOG_FORMATS)
    _one_of("[gateway].discover", config.discover, ("", "k8s"))
    endpoint = config.otel_endpoint
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"[gateway].otel_endpoint: must be an http(s):// URL, got {endpoint!r}")
    keys: set[str] = set()
    for i, tenant in enumerate(config.tenants):
        if not tenant.api_keys or not all(tenant.api_keys):
            where = f"tenants[{i}].api_keys (tenant {tenant.name!r})"
            raise ConfigError(f"{where}: one or more keys, none empty")
        for key in tenant.api_keys:
            if key in keys:
                raise ConfigError(f"API key of tenant {tenant.name!r} is used twice")
            keys.add(key)
        where = f"tenants[{i}].%s (tenant {tenant.name!r})"
        _one_of(where % "isolation", tenant.isolation, ISOLATION_LEVELS)
        _one_of(where % "fairness", tenant.fairness, FAIRNESS)
    _check_adapters(config)
    for i, worker in enumerate(config.workers):
        if not worker.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"workers[{i}].url: must start with http:// or https://, got {worker.url!r}"
            )
        _one_of(f"workers[{i}].engine", worker.engine, ENGINES)


def _check_adapters(config: GatewayConfig) -> None:
    """LoRA adapters (docs/adapters.md): each over a declared base model that is no adapter,
    its kv_group derived (never given), its name its own."""
    models = {m.name: m for m in config.models}
    for i, model in enumerate(config.models):
        where = f"models[{i}] ({model.name!r})"
        if model.base is None:
            if model.lora_path is not None or model.size_mb is not None:
                raise ConfigError(f"{where}: lora_path and size_mb need a base (a LoRA adapter)")
            continue
        base = models.get(model.base)
        if base is None:
            raise ConfigError(
                f"{where}.base: {model.base!r} is not a model of [[models]]: declare the base "
                "model too (name, tokenizer)"
            )
        if base.base is not None:
            raise ConfigError(f"{where}.base: {model.base!r} is itself an adapter")
        if model.kv_group is not None:
            raise ConfigError(
                f"{where}.kv_group: an adapter's kv_group is derived "
                f"(<base's kv_group>+lora:{model.name}), not given"
            )
        if model.aliases:
            raise ConfigError(f"{where}.aliases: an adapter is asked for by its own name")


def _check_rollout(config: GatewayConfig) -> None:
    """[gateway.rollout], where it names a candidate (docs/rollouts.md)."""
    plan = config.rollout
    if not plan.configured:
        return
    try:
        plan.check()
        if plan.policy and plan.policy not in POLICY_NAMES:
            raise ValueError(_unknown_policy(plan.policy))
        if plan.policy:
            make_policy(plan.policy, **plan.policy_params)
    except ValueError as exc:
        raise ConfigError(f"[gateway.rollout]: {exc}") from None


def _unknown_policy(name: str) -> str:
    if name == "random":  # sglang-router's and vllm-router's; docs/migration.md
        return (
            "urc has no 'random' policy: power_of_two (the less loaded of two random picks) "
            "or round_robin spread as evenly"
        )
    return f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})"


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{key}: must be one of {shown}, got {value!r}")


def validate(config: GatewayConfig) -> None:
    """`check`, then what depends on this machine (discovery's needs)."""
    check(config)
    if config.otel_endpoint and not _installed("opentelemetry.sdk", "opentelemetry.exporter.otlp"):
        raise ConfigError(
            "--otel-endpoint needs the otel extra: pip install 'unified-radix-cache[otel]'"
        )
    if not config.discover:
        return
    if not config.discover_selector.strip():
        raise ConfigError("--discover k8s needs --discover-selector, e.g. app=vllm")
    if config.discover_kubeconfig and not Path(config.discover_kubeconfig).is_file():
        raise ConfigError(f"no kubeconfig at {config.discover_kubeconfig!r}")
    if importlib.util.find_spec("lightkube") is None:
        raise ConfigError("--discover k8s needs lightkube: pip install 'unified-radix-cache[k8s]'")


def _installed(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:  # a parent package is missing
        return False
