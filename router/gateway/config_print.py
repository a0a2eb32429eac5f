"""`urc gateway --print-config`: the merged configuration (file + flags) as a TOML file that
load_config reads back to the same config, secrets masked (docs/config.md)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from typing import Any

from core.settings import flagged
from router.gateway.config_schema import SECRETS, TABLES, GatewayConfig
from router.rollout_plan import RolloutPlan

MASK = "***"
_BARE = re.compile(r"[A-Za-z0-9_-]+")


def config_toml(config: GatewayConfig, mask: bool = True) -> str:
    """`[gateway]` (every setting; None ones left out: TOML has no null, and None is their
    default), `[gateway.policy_params]`, `[gateway.rollout]` (when set), then the `[[workers]]`,
    `[[models]]`, `[[tenants]]`."""
    lines = ["[gateway]"]
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in TABLES or f.name in ("policy_params", "rollout") or value is None:
            continue
        if mask and f.name in SECRETS and value:
            value = MASK
        lines.append(f"{f.name} = {_value(value)}")
    if config.policy_params:
        lines += ["", "[gateway.policy_params]"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in config.policy_params.items()]
    if config.rollout != RolloutPlan():
        lines += ["", "[gateway.rollout]"]
        plan = config.rollout
        lines += [f"{f.name} = {_value(getattr(plan, f.name))}" for f in flagged(RolloutPlan)]
        if plan.policy_params:
            lines += ["", "[gateway.rollout.policy_params]"]
            lines += [f"{_key(k)} = {_value(v)}" for k, v in plan.policy_params.items()]
    for table in TABLES:
        for entry in getattr(config, table):
            lines += ["", f"[[{table}]]"]
            for f in fields(entry):
                value = getattr(entry, f.name)
                if mask and f.name == "api_keys":
                    value = [MASK for _ in value]
                if value is not None:
                    lines.append(f"{f.name} = {_value(value)}")
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if _BARE.fullmatch(key) else _string(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def _string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's (quotes, backslashes, control characters),
    and TOML escapes DEL too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
