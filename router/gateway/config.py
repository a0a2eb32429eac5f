"""Gateway configuration: a TOML file and/or command-line flags (flags win). The file's format
and an example: docs/cli.md, "The config file"."""

from __future__ import annotations

import argparse
import importlib.util
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from core.logs import FORMATS, LEVELS
from router.policies import POLICY_NAMES

ISOLATION_LEVELS = ("shared", "tenant", "user", "session")


class ConfigError(ValueError):
    pass


def _flag(
    default: Any,
    help: str,
    kind: type | None = None,
    flag: str = "",
    choices: tuple[str, ...] = (),
) -> Any:
    """A setting that is also a command-line flag: its name dashed, less a unit `_s`, unless
    `flag` says (`kind`: its type, when the default is None; a bool is a switch)."""
    metadata = {"flag": flag, "help": help, "kind": kind or type(default), "choices": choices}
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class ModelConfig:
    name: str
    kv_group: str | None = None  # None: the model's own name (or what its worker reports)
    tokenizer: str = "byte"
    block_size: int | None = None  # None: the worker's
    aliases: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WorkerConfig:
    url: str
    name: str | None = None  # None: derived from the URL
    models: list[str] | None = None  # None: discovered from the worker's /urc/info
    kv_events: str | None = None  # ZMQ endpoint of its KV events (None: discovered or none)
    kv_replay: str | None = None
    kv_topic: str = ""
    block_size: int | None = None
    engine: str = "urc"  # "urc" (ours: /urc/load), "vllm" or "sglang" (their /metrics)


@dataclass(slots=True)
class TenantConfig:
    name: str
    api_keys: list[str]
    isolation: str = "tenant"  # shared | tenant | user | session


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: list[WorkerConfig] = field(default_factory=list)
    models: list[ModelConfig] = field(default_factory=list)
    tenants: list[TenantConfig] = field(default_factory=list)
    policy: str = "cache_aware"
    policy_params: dict[str, Any] = field(default_factory=dict)
    admin_key: str | None = None
    # also flags (README, "Limits, timeouts and failure handling"); connection.py reads limits
    salt_secret: str = _flag(
        "",
        "keys the tenants' cache salts (unset: random per process; gateway replicas in front "
        "of one fleet must share one)",
    )
    processes: int = _flag(
        1,
        "gateway processes on this host, one port (SO_REUSEPORT), each a full replica; "
        "/metrics and the admin API cover them all (docs/scale-out.md)",
    )
    kv_groups: str = _flag(
        "",
        "route and follow the KV events of only these kv_groups, comma-separated (default: "
        "all): replica sets that each follow a shard of a fleet too large for one",
    )
    metrics_port: int | None = _flag(None, "serve /metrics and /health on this port too", int)
    metrics_key: str | None = _flag(
        None,
        "/metrics on the API port needs 'Authorization: Bearer KEY' (the admin key works too)",
        str,
    )
    max_body_bytes: int = _flag(16 * 2**20, "larger request bodies get 413")
    max_request_line_bytes: int = _flag(8192, "longer URLs get 414")
    max_header_bytes: int = _flag(65536, "larger request headers get 431")
    header_timeout_s: float = _flag(
        10.0, "seconds from a request's first byte to the end of its headers, else 408"
    )
    body_timeout_s: float = _flag(
        60.0, "seconds from the end of the headers to the end of the body, else 408"
    )
    keepalive_s: float = _flag(
        75.0, "seconds before idle kept-alive connections close", flag="--keepalive-timeout"
    )
    shutdown_delay_s: float = _flag(
        0.0,
        "on SIGTERM, seconds /health answers 503 while the gateway still accepts and serves, "
        "before it stops accepting (Kubernetes: at least the readiness probe's period times "
        "its failureThreshold)",
    )
    drain_timeout_s: float = _flag(
        30.0, "on SIGTERM, seconds in-flight requests have to finish before the gateway exits"
    )
    connect_timeout_s: float = _flag(2.0, "seconds to connect to a worker")
    ttfb_timeout_s: float = _flag(
        30.0,
        "seconds to a worker's first byte before the request fails over; a non-streamed one "
        "waits on while its worker answers health checks",
    )
    request_timeout_s: float = _flag(600.0, "seconds a request may take in all")
    load_interval_s: float = _flag(
        0.05,
        "seconds between samples of every worker's own load (/urc/load, or vLLM's and SGLang's "
        "/metrics), merged into the gateway's ledger so replicas see each other's requests "
        "(0: off, the gateway's own counts only)",
    )
    health_interval_s: float = 0.5
    unhealthy_after: int = 2  # consecutive failed health checks or requests
    breaker_cooldown_s: float = 3.0  # a worker taken out stays out at least this long
    approx_ttl_s: float = 120.0
    pending_ttl_s: float = 0.0  # --pending-ttl: keys pending from dispatch (0: off)
    index_max_blocks: int = 20_000_000
    prefill_tokens_per_s: float = 15_000.0  # to age queued prefill of non-streamed requests
    record: str | None = None  # a JSONL file: every served request, for `urc replay`
    degraded: bool = False  # route by plain least load (the degrade switch)
    shadow_policies: list[str] = field(default_factory=list)  # watch, never act
    parity_interval_s: float = 300.0  # token-parity probes of every worker (0: none at all)
    # logs and traces (docs/operability.md)
    log_level: str = _flag("info", "the lowest level logged", choices=LEVELS)
    log_format: str = _flag(
        "text", "text (time, level, logger, message, key=value) or json lines", choices=FORMATS
    )
    access_log: bool = _flag(False, "one line per request on the logger urc.access, at INFO")
    otel_endpoint: str = _flag(
        "",
        "OpenTelemetry: send a span per request to this OTLP/HTTP endpoint, e.g. "
        "http://collector:4318 (the otel extra; empty: tracing off)",
    )
    # worker discovery (docs/kubernetes.md, "Discovery")
    discover: str = _flag("", "discover workers: 'k8s' watches the engine pods of a namespace")
    discover_namespace: str = _flag(
        "", "the pods' namespace (default: the gateway pod's own, else the kubeconfig's)"
    )
    discover_selector: str = _flag(
        "", "label selector of the engine pods, e.g. app=vllm,tier=engine (--discover k8s)"
    )
    discover_port: int = _flag(
        8000, "a pod's port when no urc.dev/port annotation or container port 'http' says"
    )
    discover_kubeconfig: str = _flag(
        "", "kubeconfig file (default: the in-cluster service account, else $KUBECONFIG)"
    )


def _entries(raw: dict[str, Any], key: str, cls: type) -> list[Any]:
    """The `[[key]]` tables, each a `cls`."""
    tables = raw.get(key, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"[[{key}]] must be an array of tables")
    entries = []
    for table in tables:
        try:
            entries.append(cls(**table))
        except TypeError as exc:
            raise ConfigError(f"bad {key} entry {table!r}: {exc}") from None
    return entries


def load_config(path: str | Path | None = None) -> GatewayConfig:
    """Read a TOML file (None: all defaults)."""
    config = GatewayConfig()
    if path is None:
        return config
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    for key, value in raw.get("gateway", {}).items():
        if not hasattr(config, key) or key in ("workers", "models", "tenants"):
            raise ConfigError(f"unknown [gateway] setting {key!r}")
        setattr(config, key, value)
    config.workers = _entries(raw, "workers", WorkerConfig)
    config.models = _entries(raw, "models", ModelConfig)
    config.tenants = _entries(raw, "tenants", TenantConfig)
    return config


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    def repeatable(flag: str, metavar: str, help: str, **kwargs: Any) -> None:
        parser.add_argument(flag, action="append", default=[], metavar=metavar, help=help, **kwargs)

    def seconds(flag: str, help: str) -> None:  # the setting `name_s` of the flag `--name`
        dest = flag[2:].replace("-", "_") + "_s"
        parser.add_argument(flag, dest=dest, type=float, metavar="S", help=help)

    parser.add_argument("--config", help="TOML file (flags override it)")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    repeatable(
        "--worker",
        "URL",
        "a worker's base URL; repeatable. Ours are discovered (models, block size, "
        "KV-event endpoints); others are described in the config file",
    )
    parser.add_argument("--policy", choices=POLICY_NAMES, help="routing policy")
    repeatable(
        "--policy-param", "KEY=VALUE", "a policy parameter, e.g. cache_threshold=0.5; repeatable"
    )
    repeatable(
        "--api-key",
        "TENANT:KEY",
        "an API key of a tenant; repeatable. With none, auth is off (one shared tenant)",
    )
    repeatable(
        "--tenant-isolation",
        "TENANT:LEVEL",
        "a tenant's cache isolation: shared (its leading system prompt is shared with "
        "other shared tenants), tenant (the default), user (the request's 'user'), session "
        "(the x-urc-session header); repeatable",
    )
    parser.add_argument("--admin-key", help="the key of the admin API (/admin/...)")
    repeatable(
        "--shadow-policy",
        "NAME",
        "a policy that sees every request and chooses without being acted on; its "
        "predictions are exported in /metrics and /admin/mode; repeatable",
        choices=POLICY_NAMES,
    )
    parser.add_argument(
        "--degraded",
        action="store_true",
        default=None,
        help="start degraded: plain least-load routing (flip with POST /admin/mode)",
    )
    parser.add_argument(
        "--record",
        metavar="FILE",
        help="append every served request to FILE (Mooncake JSONL + model, tenant, worker, "
        "cached tokens) for `urc replay`",
    )
    repeatable(
        "--attach",
        "URL,KEY=VALUE,...",
        "an engine started elsewhere (vLLM, SGLang), e.g. http://h:8000,model=llama,"
        "kv_events=tcp://h:5557,kv_replay=tcp://h:5558,kv_topic=kv,block_size=16; repeatable",
    )
    seconds(
        "--parity-interval",
        "probe every worker's token counts against the gateway's every S seconds, and "
        "when it comes up (default 300; 0: never)",
    )
    seconds(
        "--pending-ttl",
        "hold a request's prefix on its worker from dispatch until the worker's KV events "
        "confirm it, or for S seconds, so that concurrent requests find it (e.g. 10; default "
        "0: off)",
    )
    repeatable(
        "--model-tokenizer",
        "MODEL=SPEC",
        "tokenizer of a model: 'byte' or a model directory; repeatable",
    )
    for setting in _FLAGS:  # the help gets the setting's default
        help = setting.metadata["help"]
        flag = setting.metadata["flag"] or "--" + setting.name.removesuffix("_s").replace("_", "-")
        shown = f"{help} (default {setting.default})" if setting.default else help
        if setting.metadata["kind"] is bool:
            parser.add_argument(
                flag, dest=setting.name, action="store_true", default=None, help=help
            )
            continue
        choices = setting.metadata["choices"] or None
        kind = setting.metadata["kind"]
        parser.add_argument(flag, dest=setting.name, type=kind, choices=choices, help=shown)


_FLAGS = [f for f in fields(GatewayConfig) if "flag" in f.metadata]
# the settings above that must be positive numbers (a port may be 0: any free one; 0 turns
# the load feed off; no delay: 0)
_NON_NEGATIVE = ("metrics_port", "load_interval_s", "shutdown_delay_s")
_POSITIVE = [
    f.name for f in _FLAGS if f.metadata["kind"] not in (str, bool) and f.name not in _NON_NEGATIVE
]
# the scalar settings: a flag whose dest is one of them sets it when given
_SCALARS = [f.name for f in fields(GatewayConfig) if f.default is not MISSING]


def _pair(item: str, sep: str, flag: str, form: str) -> tuple[str, str]:
    left, found, right = item.partition(sep)
    if not found or not left or not right:
        raise ConfigError(f"{flag} wants {form}, got {item!r}")
    return left, right


def apply_flags(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    for name in _SCALARS:
        value = getattr(args, name, None)
        if value is not None and value != "":
            setattr(config, name, value)
    config.workers.extend(WorkerConfig(url=url) for url in args.worker)
    config.workers.extend(parse_attach(spec) for spec in args.attach)
    for item in args.policy_param:
        key, value = _pair(item, "=", "--policy-param", "KEY=VALUE")
        config.policy_params[key] = value
    by_name = {t.name: t for t in config.tenants}
    for item in args.api_key:
        tenant, key = _pair(item, ":", "--api-key", "TENANT:KEY")
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


def validate(config: GatewayConfig) -> None:
    for name in (config.policy, *config.shadow_policies):
        if name not in POLICY_NAMES:
            raise ConfigError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    keys: set[str] = set()
    for tenant in config.tenants:
        for key in tenant.api_keys:
            if key in keys:
                raise ConfigError(f"API key of tenant {tenant.name!r} is used twice")
            keys.add(key)
        if tenant.isolation not in ISOLATION_LEVELS:
            levels = ", ".join(ISOLATION_LEVELS)
            raise ConfigError(f"tenant {tenant.name!r}: isolation must be one of {levels}")
    for name in _POSITIVE:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{name} must be a number > 0, got {value!r}")
    if config.shutdown_delay_s < 0:
        raise ConfigError(f"shutdown_delay_s must be >= 0, got {config.shutdown_delay_s}")
    interval = config.load_interval_s
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
        raise ConfigError(f"load_interval_s must be >= 0 (0: off), got {interval!r}")
    if config.pending_ttl_s < 0:
        raise ConfigError(f"pending_ttl_s must be >= 0 (0: off), got {config.pending_ttl_s}")
    _validate_logs(config)
    for worker in config.workers:
        if not worker.url.startswith(("http://", "https://")):
            raise ConfigError(f"worker URL must start with http:// or https://: {worker.url!r}")
    _validate_discovery(config)


def _validate_logs(config: GatewayConfig) -> None:
    if config.log_level not in LEVELS:
        raise ConfigError(f"log_level must be one of {', '.join(LEVELS)}, got {config.log_level!r}")
    if config.log_format not in FORMATS:
        raise ConfigError(f"log_format must be text or json, got {config.log_format!r}")
    if not isinstance(config.access_log, bool):
        raise ConfigError(f"access_log must be true or false, got {config.access_log!r}")
    endpoint = config.otel_endpoint
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"otel_endpoint must be an http(s):// URL, got {endpoint!r}")
    if endpoint and not _installed("opentelemetry.sdk", "opentelemetry.exporter.otlp"):
        raise ConfigError(
            "--otel-endpoint needs the otel extra: pip install 'unified-radix-cache[otel]'"
        )


def _installed(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _validate_discovery(config: GatewayConfig) -> None:
    if config.discover not in ("", "k8s"):
        raise ConfigError(f"discover must be 'k8s' (or unset), got {config.discover!r}")
    if not config.discover:
        return
    if not config.discover_selector.strip():
        raise ConfigError("--discover k8s needs --discover-selector, e.g. app=vllm")
    if config.discover_kubeconfig and not Path(config.discover_kubeconfig).is_file():
        raise ConfigError(f"no kubeconfig at {config.discover_kubeconfig!r}")
    if importlib.util.find_spec("lightkube") is None:
        raise ConfigError("--discover k8s needs lightkube: pip install 'unified-radix-cache[k8s]'")
