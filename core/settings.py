"""Settings declared once: a dataclass field per setting whose metadata names its flag and help,
from which the command-line flags are made and parsed values mapped back. The gateway's
`GatewayConfig` (router/gateway/config_schema.py) and the emulated engine's `EngineConfig`
(backends/emulated/config.py) are declared this way (docs/config.md, docs/workers.md)."""

from __future__ import annotations

import argparse
from dataclasses import Field, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def setting(
    default: Any,
    help: str,
    flag: str | None = "",
    aliases: tuple[str, ...] = (),
    flag_scale: float = 1.0,
) -> Any:
    """A setting and its flag: its name dashed, less a unit `_s` (not a rate's `_per_s`), unless
    `flag` says (None: no flag of its own). `aliases`: other names of the flag (sglang-router's).
    `flag_scale`: the flag's value is the setting's times this (1e3: a flag in ms of seconds)."""
    metadata = {"flag": flag, "help": help, "aliases": aliases, "flag_scale": flag_scale}
    if isinstance(default, list | dict):
        return field(default_factory=type(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(cls: type, name: str) -> str | None:
    """The flag of `cls`'s setting `name` (None: none of its own)."""
    for f in fields(cls):
        if f.name == name:
            return _flag(f)
    return None


def flagged(cls: type) -> list[Field[Any]]:
    """`cls`'s settings that have a flag, in declaration order."""
    return [f for f in fields(cls) if _flag(f) is not None]


def _flag(f: Field[Any]) -> str | None:
    flag = f.metadata.get("flag")
    if flag is None:
        return None
    if flag:
        return str(flag)
    name = f.name if f.name.endswith("_per_s") else f.name.removesuffix("_s")
    return "--" + name.replace("_", "-")


def _dest(f: Field[Any]) -> str:
    return str(_flag(f))[2:].replace("-", "_")


def add_setting_flags(group: argparse._ActionsContainer, cls: type) -> None:
    """One flag per setting of `cls` (numbers and strings: the type of its default), defaulting
    to the default in the flag's unit."""
    for f in flagged(cls):
        scale = f.metadata["flag_scale"]
        default = f.default if scale == 1.0 else f.default * scale
        group.add_argument(
            str(_flag(f)),
            *f.metadata["aliases"],
            dest=_dest(f),
            type=type(f.default),
            default=default,
            help=f.metadata["help"],
        )


def from_flags(cls: type[T], args: argparse.Namespace, **fixed: Any) -> T:
    """`cls` from the flags `add_setting_flags` made, in the setting's unit; `fixed`: settings
    the caller decides. ValueError where `cls` refuses the values."""
    values = dict(fixed)
    for f in flagged(cls):
        value = getattr(args, _dest(f))
        scale = f.metadata["flag_scale"]
        values.setdefault(f.name, value if scale == 1.0 else value / scale)
    return cls(**values)


def settings_of(config: Any) -> dict[str, Any]:
    """The values of `config`'s flagged settings, by name (a report's record of them)."""
    return {f.name: getattr(config, f.name) for f in flagged(type(config))}
