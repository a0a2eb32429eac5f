"""Gateway configuration: a TOML file and/or command-line flags (flags win), its types and limits
checked by msgspec. Every setting, its type, default and flag: docs/config.md; the flags:
config_flags.py."""

from __future__ import annotations

import difflib
import importlib.util
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from router.policies import POLICY_NAMES, make_policy

ISOLATION_LEVELS = ("shared", "tenant", "user", "session")
ENGINES = ("urc", "vllm", "sglang")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
SECRETS = ("admin_key", "metrics_key", "salt_secret")  # and tenants' api_keys: masked in print

# limits msgspec checks on every value, from the file and from flags
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]  # 0: any free one
PolicyParam = str | int | float | bool


class ConfigError(ValueError):
    pass


def _setting(default: Any, help: str, flag: str | None = "", aliases: tuple[str, ...] = ()) -> Any:
    """A setting and its flag: its name dashed, less a unit `_s`, unless `flag` says (None: no
    flag of its own; config_flags.py adds what sets it). `aliases`: sglang-router's names."""
    metadata = {"flag": flag, "help": help, "aliases": aliases}
    if isinstance(default, list | dict):
        return field(default_factory=type(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class ModelConfig:
    name: str
    kv_group: str | None = None  # None: the model's own name (or what its worker reports)
    tokenizer: str = "byte"
    block_size: PositiveInt | None = None  # None: the worker's
    aliases: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WorkerConfig:
    url: str
    name: str | None = None  # None: derived from the URL
    models: list[str] | None = None  # None: discovered from the worker's /urc/info
    kv_events: str | None = None  # ZMQ endpoint of its KV events (None: discovered or none)
    kv_replay: str | None = None
    kv_topic: str = ""
    block_size: PositiveInt | None = None
    engine: str = "urc"  # "urc" (ours: /urc/load), "vllm" or "sglang" (their /metrics)


@dataclass(slots=True)
class TenantConfig:
    name: str
    api_keys: list[str]
    isolation: str = "tenant"  # shared | tenant | user | session


@dataclass(slots=True)
class GatewayConfig:
    host: str = _setting("127.0.0.1", "address to listen on")
    port: Port = _setting(8000, "port to listen on (0: any free one)")
    workers: list[WorkerConfig] = _setting([], "the workers ([[workers]] tables)", None)
    models: list[ModelConfig] = _setting([], "models and their tokenizers ([[models]])", None)
    tenants: list[TenantConfig] = _setting([], "tenants and API keys ([[tenants]])", None)
    policy: str = _setting("cache_aware", "routing policy (docs/policies.md)")
    policy_params: dict[str, PolicyParam] = _setting({}, "the policy's parameters", None)
    admin_key: str | None = _setting(None, "the key of the admin API (/admin/...); off without")
    salt_secret: str = _setting(
        "",
        "keys the tenants' cache salts (unset: random per process; gateway replicas in front "
        "of one fleet must share one)",
    )
    processes: PositiveInt = _setting(
        1,
        "gateway processes on this host, one port (SO_REUSEPORT), each a full replica; "
        "/metrics and the admin API cover them all (docs/scale-out.md)",
    )
    kv_groups: str = _setting(
        "",
        "route and follow the KV events of only these kv_groups, comma-separated (default: "
        "all): replica sets that each follow a shard of a fleet too large for one",
    )
    max_concurrent_requests: NonNegativeInt = _setting(
        0,
        "inference requests in flight per gateway process; more get 429 (0: unlimited)",
    )
    metrics_port: Port | None = _setting(
        None, "serve /metrics and /health on this port too", aliases=("--prometheus-port",)
    )
    metrics_host: str = _setting(
        "", "address of the metrics port (default: --host)", aliases=("--prometheus-host",)
    )
    metrics_key: str | None = _setting(
        None, "/metrics on the API port needs 'Authorization: Bearer KEY' (the admin key works too)"
    )
    log_level: str = _setting("info", "log level: debug, info, warning or error")
    log_format: str = _setting("text", "log lines as text or json")
    access_log: bool = _setting(False, "one line per request on the urc.access logger")
    otel_endpoint: str = _setting(
        "", "OTLP/HTTP traces endpoint, e.g. http://collector:4318 (empty: tracing off)"
    )
    max_body_bytes: PositiveInt = _setting(
        16 * 2**20, "larger request bodies get 413", aliases=("--max-payload-size",)
    )
    max_request_line_bytes: PositiveInt = _setting(8192, "longer URLs get 414")
    max_header_bytes: PositiveInt = _setting(65536, "larger request headers get 431")
    header_timeout_s: Positive = _setting(
        10.0, "seconds from a request's first byte to the end of its headers, else 408"
    )
    body_timeout_s: Positive = _setting(
        60.0, "seconds from the end of the headers to the end of the body, else 408"
    )
    keepalive_s: Positive = _setting(
        75.0, "seconds before idle kept-alive connections close", "--keepalive-timeout"
    )
    shutdown_delay_s: NonNegative = _setting(
        0.0,
        "on SIGTERM, seconds /health answers 503 while the gateway still accepts and serves, "
        "before it stops accepting (Kubernetes: at least the readiness probe's period times "
        "its failureThreshold)",
    )
    drain_timeout_s: Positive = _setting(
        30.0, "on SIGTERM, seconds in-flight requests have to finish before the gateway exits"
    )
    connect_timeout_s: Positive = _setting(2.0, "seconds to connect to a worker")
    ttfb_timeout_s: Positive = _setting(
        30.0,
        "seconds to a worker's first byte before the request fails over; a non-streamed one "
        "waits on while its worker answers health checks",
    )
    request_timeout_s: Positive = _setting(
        600.0, "seconds a request may take in all", aliases=("--request-timeout-secs",)
    )
    load_interval_s: NonNegative = _setting(
        0.05,
        "seconds between samples of every worker's own load (/urc/load, or vLLM's and SGLang's "
        "/metrics), merged into the gateway's ledger so replicas see each other's requests "
        "(0: off, the gateway's own counts only)",
    )
    health_interval_s: Positive = _setting(
        0.5,
        "seconds between health checks of each worker",
        aliases=("--health-check-interval-secs",),
    )
    unhealthy_after: PositiveInt = _setting(
        2,
        "consecutive failed health checks or requests that take a worker out",
        aliases=("--health-failure-threshold",),
    )
    breaker_cooldown_s: NonNegative = _setting(3.0, "seconds a worker taken out stays out at least")
    approx_ttl_s: Positive = _setting(
        120.0,
        "seconds a prefix routed to a worker without KV events counts as held there "
        "(approximate residency)",
    )
    pending_ttl_s: NonNegative = _setting(
        0.0,
        "hold a request's prefix on its worker from dispatch until the worker's KV events "
        "confirm it, or for S seconds, so that concurrent requests find it (e.g. 10; 0: off)",
    )
    index_max_blocks: NonNegativeInt = _setting(
        20_000_000,
        "blocks the unified index holds at most, the least recently used dropped "
        "past it (0: no bound)",
    )
    prefill_tokens_per_s: Positive = _setting(
        15_000.0,
        "a worker's prefill speed, to age the queued prefill of non-streamed requests",
        "--prefill-tokens-per-s",
    )
    record: str | None = _setting(
        None,
        "append every served request to this file (Mooncake JSONL + model, tenant, worker, "
        "cached tokens) for `urc replay`",
    )
    degraded: bool = _setting(
        False, "start degraded: plain least-load routing (flip with POST /admin/mode)"
    )
    shadow_policies: list[str] = _setting([], "policies that watch, never act", None)
    parity_interval_s: NonNegative = _setting(
        300.0,
        "probe every worker's token counts against the gateway's every S seconds, and when it "
        "comes up (0: never)",
    )
    # worker discovery (docs/kubernetes.md, "Discovery")
    discover: str = _setting("", "discover workers: 'k8s' watches the engine pods of a namespace")
    discover_namespace: str = _setting(
        "", "the pods' namespace (default: the gateway pod's own, else the kubeconfig's)"
    )
    discover_selector: str = _setting(
        "", "label selector of the engine pods, e.g. app=vllm,tier=engine (--discover k8s)"
    )
    discover_port: Annotated[int, Meta(gt=0, le=65535)] = _setting(
        8000, "a pod's port when no urc.dev/port annotation or container port 'http' says"
    )
    discover_kubeconfig: str = _setting(
        "", "kubeconfig file (default: the in-cluster service account, else $KUBECONFIG)"
    )


TABLES: dict[str, type] = {"workers": WorkerConfig, "models": ModelConfig, "tenants": TenantConfig}
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
    _known(raw, {"gateway", *TABLES}, "", "table")
    gateway = raw.get("gateway", {})
    if not isinstance(gateway, dict):
        raise ConfigError("[gateway] must be a table")
    settings = {f.name for f in fields(GatewayConfig)} - set(TABLES)
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


def _known(table: dict[str, Any], known: set[str], where: str, what: str) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            name = f"[{key}]" if what == "table" else f"{where}{key}"
            raise ConfigError(f"unknown {what} {name}{hint}")


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
    """msgspec's message, and the value it was about."""
    message = message[:1].lower() + message[1:]
    value: Any = raw
    for name, index in _PATH_PART.findall(path.removeprefix("$")):
        try:
            value = value[name] if name else value[int(index)]
        except (KeyError, IndexError, TypeError):
            return message
    if isinstance(value, dict | list):
        return message
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"{message} ({shown})" if "got" in message else f"{message}, got {shown}"


def flag_of(name: str) -> str | None:
    """The flag of GatewayConfig's setting `name` (None: none of its own)."""
    for f in fields(GatewayConfig):
        if f.name == name and f.metadata["flag"] is not None:
            return f.metadata["flag"] or "--" + name.removesuffix("_s").replace("_", "-")
    return None


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
    _one_of("[gateway].log_level", config.log_level, LOG_LEVELS)
    _one_of("[gateway].log_format", config.log_format, LOG_FORMATS)
    _one_of("[gateway].discover", config.discover, ("", "k8s"))
    keys: set[str] = set()
    for i, tenant in enumerate(config.tenants):
        for key in tenant.api_keys:
            if key in keys:
                raise ConfigError(f"API key of tenant {tenant.name!r} is used twice")
            keys.add(key)
        _one_of(
            f"tenants[{i}].isolation (tenant {tenant.name!r})", tenant.isolation, ISOLATION_LEVELS
        )
    for i, worker in enumerate(config.workers):
        if not worker.url.startswith(("http://", "https://")):
            raise ConfigError(
                f"workers[{i}].url: must start with http:// or https://, got {worker.url!r}"
            )
        _one_of(f"workers[{i}].engine", worker.engine, ENGINES)


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
    if not config.discover:
        return
    if not config.discover_selector.strip():
        raise ConfigError("--discover k8s needs --discover-selector, e.g. app=vllm")
    if config.discover_kubeconfig and not Path(config.discover_kubeconfig).is_file():
        raise ConfigError(f"no kubeconfig at {config.discover_kubeconfig!r}")
    if importlib.util.find_spec("lightkube") is None:
        raise ConfigError("--discover k8s needs lightkube: pip install 'unified-radix-cache[k8s]'")
