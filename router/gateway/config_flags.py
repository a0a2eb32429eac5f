"""The gateway's command-line flags (`urc gateway`, `urc epp`, `urc cluster`): one per setting of
GatewayConfig (config.py), the repeatable ones that build its tables, and sglang-router's and
vllm-router's names (docs/migration.md). Flags override the config file."""

from __future__ import annotations

import argparse
import logging
from dataclasses import Field, fields
from typing import Any, get_args, get_type_hints

from core.settings import flag_of as flag_of_setting
from core.settings import flagged
from router.gateway.config import ConfigError, validate
from router.gateway.config_schema import (
    DEFAULT_TENANT,
    GROUPS,
    LOG_FORMATS,
    LOG_LEVELS,
    GatewayConfig,
    ModelConfig,
    TenantConfig,
    WorkerConfig,
    flag_of,
)
from router.policies import POLICY_NAMES
from router.rollout_plan import RolloutPlan

log = logging.getLogger(__name__)
_CHOICES = {"log_level": LOG_LEVELS, "log_format": LOG_FORMATS}
_HINTS = get_type_hints(GatewayConfig)  # Annotated limits dropped: int, float, str | None
_SETTINGS = [f for f in fields(GatewayConfig) if f.metadata["flag"] is not None]
# sglang-router's cache_aware thresholds: the parameters of urc's `sglang` policy
_THRESHOLDS = {
    "cache_threshold": float,
    "balance_abs_threshold": int,
    "balance_rel_threshold": float,
}
# sglang-router flags that tune what urc does not have: accepted, ignored, said so
_IGNORED = {
    "--eviction-interval-secs": "its approximate tree's eviction period; urc's index evicts "
    "least recently used blocks as it inserts, past --index-max-blocks",
    "--max-tree-size": "its approximate tree's size in characters; urc's index holds "
    "--index-max-blocks blocks",
}


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """Every gateway flag on `parser`, in GROUPS' argument groups (the essentials first)."""
    groups = {key: parser.add_argument_group(title) for key, (title, _) in GROUPS.items()}
    runs = {first: groups[key] for key, (_, first) in GROUPS.items() if first is not None}
    essentials = groups["essentials"]
    essentials.add_argument("--config", help="TOML file (flags override it; docs/config.md)")
    essentials.add_argument(
        "--print-config",
        action="store_true",
        help="print the merged config (file + flags) as TOML, secrets masked, and exit",
    )
    group = essentials
    for setting in fields(GatewayConfig):  # a group's run of settings ends where another begins
        group = runs.pop(setting.name, group)
        if setting.metadata["flag"] is not None:
            _add_setting(group, setting)
    assert not runs, f"GROUPS names no setting {list(runs)}"
    _add_tables(groups)
    _add_rollout(groups["rollout"])
    compat = groups["compat"]
    compat.add_argument(
        "--worker-urls",
        dest="worker",
        nargs="+",
        action="extend",
        metavar="URL",
        help="workers' base URLs, space-separated (sglang-router's form of --worker)",
    )
    for name, kind in _THRESHOLDS.items():
        compat.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            help=f"sglang-router's {name}: a parameter of --policy sglang (docs/migration.md)",
        )
    for flag, why in _IGNORED.items():
        compat.add_argument(flag, help=f"accepted from sglang-router and ignored: {why}")


def _add_setting(group: argparse._ArgumentGroup, setting: Field[Any]) -> None:
    """The flag (and aliases) of one GatewayConfig setting; its help gets the default."""
    flag = flag_of(setting.name)
    assert flag is not None
    help = setting.metadata["help"]
    names = (flag, *setting.metadata["aliases"])
    if setting.default is False:  # a switch: unset keeps the file's value
        group.add_argument(*names, dest=setting.name, action="store_true", default=None, help=help)
        return
    shown = f"{help} (default {setting.default})" if setting.default else help
    if setting.name == "policy":
        shown = f"{shown}: {', '.join(POLICY_NAMES)}"
    kind, choices = _kind(setting.name), _CHOICES.get(setting.name)
    metavar = "S" if setting.name.endswith("_s") else "N" if kind is int else None
    group.add_argument(
        *names, dest=setting.name, type=kind, choices=choices, metavar=metavar, help=shown
    )


def _add_tables(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """The repeatable flags that build the config's tables and lists."""

    def repeatable(
        group: argparse._ArgumentGroup, flag: str, metavar: str, help: str, **kwargs: Any
    ) -> None:
        group.add_argument(flag, action="append", default=[], metavar=metavar, help=help, **kwargs)

    repeatable(
        groups["essentials"],
        "--worker",
        "URL",
        "a worker's base URL; repeatable. Ours are discovered (models, block size, "
        "KV-event endpoints); others are described in the config file",
    )
    repeatable(
        groups["essentials"],
        "--api-key",
        "[TENANT:]KEY",
        "an API key of a tenant (a bare KEY: the tenant 'default'); repeatable. With none, "
        "auth is off (one shared tenant)",
    )
    repeatable(
        groups["routing"],
        "--policy-param",
        "KEY=VALUE",
        "a policy parameter, e.g. cache_threshold=0.5; repeatable",
    )
    repeatable(
        groups["tenants"],
        "--tenant-isolation",
        "TENANT:LEVEL",
        "a tenant's cache isolation: shared (its leading system prompt is shared with "
        "other shared tenants), tenant (the default), user (the request's 'user'), session "
        "(the x-urc-session header); repeatable",
    )
    repeatable(
        groups["routing"],
        "--shadow-policy",
        "NAME",
        "a policy that sees every request and chooses without being acted on; its "
        "predictions are exported in /metrics and /admin/mode; repeatable",
        choices=POLICY_NAMES,
    )
    repeatable(
        groups["workers"],
        "--attach",
        "URL,KEY=VALUE,...",
        "an engine started elsewhere (vLLM, SGLang), e.g. http://h:8000,model=llama,"
        "kv_events=tcp://h:5557,kv_replay=tcp://h:5558,kv_topic=kv,block_size=16; repeatable",
    )
    repeatable(
        groups["workers"],
        "--model-tokenizer",
        "MODEL=SPEC",
        "tokenizer of a model: 'byte' or a model directory; repeatable",
    )


def _add_rollout(group: argparse._ArgumentGroup) -> None:
    """[gateway.rollout]'s flags (router/rollout_plan.py declares them; `urc replay` too)."""
    for f in flagged(RolloutPlan):
        flag = flag_of_setting(RolloutPlan, f.name)
        assert flag is not None
        metavar = "S" if f.name.endswith("_s") else None
        help = f"{f.metadata['help']} (default {f.default})" if f.default else f.metadata["help"]
        group.add_argument(flag, type=type(f.default), metavar=metavar, help=help)
    group.add_argument(
        "--rollout-policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of the candidate policy; repeatable",
    )


def _apply_rollout(config: GatewayConfig, args: argparse.Namespace) -> None:
    plan = config.rollout
    for f in flagged(RolloutPlan):
        flag = flag_of_setting(RolloutPlan, f.name)
        value = getattr(args, str(flag)[2:].replace("-", "_"), None)
        if value is not None and value != "":
            setattr(plan, f.name, value)
    for item in getattr(args, "rollout_policy_param", []):
        key, value = _pair(item, "=", "--rollout-policy-param", "KEY=VALUE")
        plan.policy_params[key] = value


def _kind(setting: str) -> type:
    """The argparse type of a setting: its annotation less limits and None."""
    hint = _HINTS[setting]
    kinds = [k for k in get_args(hint) if k is not type(None)] or [hint]
    return kinds[0] if kinds[0] in (int, float) else str


def _pair(item: str, sep: str, flag: str, form: str) -> tuple[str, str]:
    left, found, right = item.partition(sep)
    if not found or not left or not right:
        raise ConfigError(f"{flag} wants {form}, got {item!r}")
    return left, right


def _tenant_key(item: str) -> tuple[str, str]:
    """`--api-key TENANT:KEY`, or a bare `KEY` as sglang-router and vllm-router mean it: the
    one key of the one tenant, `default` (docs/isolation.md)."""
    if ":" in item:
        return _pair(item, ":", "--api-key", "[TENANT:]KEY")
    if not item:
        raise ConfigError("--api-key wants [TENANT:]KEY, got ''")
    return DEFAULT_TENANT, item


def apply_flags(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    for setting in _SETTINGS:
        value = getattr(args, setting.name, None)
        if value is not None and value != "":
            setattr(config, setting.name, value)
    config.workers.extend(WorkerConfig(url=url) for url in args.worker)
    config.workers.extend(parse_attach(spec) for spec in args.attach)
    for item in args.policy_param:
        key, value = _pair(item, "=", "--policy-param", "KEY=VALUE")
        config.policy_params[key] = value
    _apply_thresholds(config, args)
    _apply_rollout(config, args)
    by_name = {t.name: t for t in config.tenants}
    for item in args.api_key:
        tenant, key = _tenant_key(item)
        if tenant not in by_name:
            by_name[tenant] = TenantConfig(tenant, [])
            config.tenants.append(by_name[tenant])
        by_name[tenant].api_keys.append(key)
    for item in args.tenant_isolation:
        tenant, sep, level = item.partition(":")
        if not sep or tenant not in by_name:
            raise ConfigError(f"--tenant-isolation wants TENANT:LEVEL of a known tenant: {item!r}")
        by_name[tenant].isolation = level
    config.shadow_policies.extend(args.shadow_policy)
    models = {m.name: m for m in config.models}
    for item in args.model_tokenizer:
        name, spec = _pair(item, "=", "--model-tokenizer", "MODEL=SPEC")
        if name not in models:
            models[name] = ModelConfig(name)
            config.models.append(models[name])
        models[name].tokenizer = spec
    validate(config)
    return config


def _apply_thresholds(config: GatewayConfig, args: argparse.Namespace) -> None:
    """sglang-router's thresholds are parameters of SGLang's cache_aware, urc's `sglang`; urc's
    own cache_aware prices cache against load in seconds and has none (docs/migration.md)."""
    for name in _THRESHOLDS:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if config.policy == "sglang":
            config.policy_params[name] = value
        else:
            log.warning(
                "%s ignored: it is a parameter of SGLang's cache_aware (--policy sglang); "
                "urc's %s has no thresholds (docs/migration.md)",
                flag,
                config.policy,
            )
    for flag in _IGNORED:
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            log.warning("%s ignored: %s (docs/migration.md)", flag, _IGNORED[flag])


def parse_attach(spec: str) -> WorkerConfig:
    """`URL,model=NAME,...,kv_events=EP,kv_replay=EP,kv_topic=T,block_size=N,name=N,engine=E`."""
    url, *items = spec.split(",")
    worker = WorkerConfig(url=url.strip())
    models: list[str] = []
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ConfigError(f"--attach wants URL,KEY=VALUE,...: bad {item!r} in {spec!r}")
        if key in ("model", "models"):
            models.append(value)
        elif key == "block_size" and value.isdigit():
            worker.block_size = int(value)
        elif key in ("kv_events", "kv_replay", "kv_topic", "name", "engine"):
            setattr(worker, key, value)
        else:
            raise ConfigError(f"--attach: unknown or bad {key!r} in {spec!r}")
    if not models:
        raise ConfigError(f"--attach {spec!r}: name the served models (model=NAME, repeatable)")
    worker.models = models
    return worker
