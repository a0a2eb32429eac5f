"""The gateway's settings: their types, limits, defaults and flags, one place for the config file
(config.py), the flags (config_flags.py) and the reference (docs/config.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from core import settings
from core.hardware import DEFAULT_PREFILL_TOKENS_PER_S
from core.logs import FORMATS, LEVELS
from core.settings import setting
from router.adapters import DEFAULT_LOAD_MB_PER_S, DEFAULT_LOAD_S
from router.index import DEFAULT_APPROX_TTL_S
from router.rollout_plan import RolloutPlan

ISOLATION_LEVELS = ("shared", "tenant", "user", "session")
FAIRNESS = ("tenant", "user", "session")  # the flows a tenant's weight is shared between
ENGINES = ("urc", "vllm", "sglang")
LOG_LEVELS, LOG_FORMATS = LEVELS, FORMATS  # core/logs.py
SECRETS = ("admin_key", "metrics_key", "salt_secret")  # and tenants' api_keys: masked in print
# the one tenant when auth is off, and the owner of a key given without a tenant
DEFAULT_TENANT = "default"

# limits msgspec checks on every value, from the file and from flags
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]  # 0: any free one
PolicyParam = str | int | float | bool


# the groups of the flags in `--help` (config_flags.py), in this order, the essentials first; each
# with the first of its run of settings in GatewayConfig (None: config_flags.py's own flags only)
GROUPS: dict[str, tuple[str, str | None]] = {
    "essentials": ("essentials", "host"),
    "workers": ("workers, models and discovery", "models"),
    "routing": ("routing", "policy_params"),
    "index": ("the index and KV events", "approx_ttl_s"),
    "tenants": ("tenants and isolation", "salt_secret"),
    "load": ("load, health and failover", "max_concurrent_requests"),
    "flow": ("flow control (docs/flow-control.md)", "flow_control"),
    "http": ("HTTP limits, timeouts and shutdown", "max_body_bytes"),
    "admin": ("admin API, metrics and recording", "admin_key"),
    "logs": ("logs and traces", "log_level"),
    "scale": ("scale-out (docs/scale-out.md)", "processes"),
    "rollout": ("gradual rollout ([gateway.rollout], docs/rollouts.md)", None),
    "compat": ("sglang-router's and vllm-router's names (docs/migration.md)", None),
}


@dataclass(slots=True)
class ModelConfig:
    name: str
    kv_group: str | None = None  # None: the model's own name (or what its worker reports)
    tokenizer: str = "byte"
    block_size: PositiveInt | None = None  # None: the worker's
    aliases: list[str] = field(default_factory=list)
    # a LoRA adapter (docs/adapters.md): its base model, where its weights load from, its size
    base: str | None = None
    lora_path: str | None = None
    size_mb: Positive | None = None


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
    priority_scheduling: bool = False  # vLLM under --scheduling-policy priority: send `priority`


@dataclass(slots=True)
class TenantConfig:
    name: str = DEFAULT_TENANT  # a bare `--api-key KEY` (sglang-router's form) is this tenant's
    api_keys: list[str] = field(default_factory=list)  # at least one (config.py checks)
    isolation: str = "tenant"  # shared | tenant | user | session
    # flow control (docs/flow-control.md); budgets: 0 is none
    weight: Positive = 1.0  # its share of GPU work against the others of its priority
    priority: int = 0  # higher first; below 0: sheddable
    fairness: str = "tenant"  # tenant | user | session: the flows its weight is shared between
    requests_per_minute: NonNegativeInt = 0
    tokens_per_minute: NonNegativeInt = 0  # input + output
    max_concurrent_requests: NonNegativeInt = 0


@dataclass(slots=True)
class GatewayConfig:
    # A setting's flag: core/settings.py's `setting` (None: no flag of its own; config_flags.py
    # adds what sets it). The settings come in runs, one per group of `--help` (GROUPS).
    # essentials
    host: str = setting("127.0.0.1", "address to listen on")
    port: Port = setting(8000, "port to listen on (0: any free one)")
    workers: list[WorkerConfig] = setting([], "the workers ([[workers]] tables)", None)
    tenants: list[TenantConfig] = setting([], "tenants and API keys ([[tenants]])", None)
    policy: str = setting("cache_aware", "routing policy (docs/policies.md)")
    # worker discovery (docs/kubernetes.md, "Discovery")
    discover: str = setting("", "discover workers: 'k8s' watches the engine pods of a namespace")

    # workers
    models: list[ModelConfig] = setting([], "models and their tokenizers ([[models]])", None)
    discover_namespace: str = setting(
        "", "the pods' namespace (default: the gateway pod's own, else the kubeconfig's)"
    )
    discover_selector: str = setting(
        "", "label selector of the engine pods, e.g. app=vllm,tier=engine (--discover k8s)"
    )
    discover_port: Annotated[int, Meta(gt=0, le=65535)] = setting(
        8000, "a pod's port when no urc.dev/port annotation or container port 'http' says"
    )
    discover_kubeconfig: str = setting(
        "", "kubeconfig file (default: the in-cluster service account, else $KUBECONFIG)"
    )

    # routing
    policy_params: dict[str, PolicyParam] = setting({}, "the policy's parameters", None)
    prefill_tokens_per_s: Positive = setting(
        DEFAULT_PREFILL_TOKENS_PER_S,
        "a worker's prefill speed: the one the routing policy (cache_aware), the shadow policies' "
        "estimates and the aging of non-streamed requests' queued prefill assume",
    )
    degraded: bool = setting(
        False, "start degraded: plain least-load routing (flip with POST /admin/mode)"
    )
    shadow_policies: list[str] = setting([], "policies that watch, never act", None)
    lora_load_mb_per_s: Positive = setting(
        DEFAULT_LOAD_MB_PER_S, "LoRA adapters: the rate a worker reads an adapter's weights at"
    )
    lora_load_s: NonNegative = setting(
        DEFAULT_LOAD_S,
        "LoRA adapters: a load's fixed seconds (the call, opening its files)",
        "--lora-load-s",
    )

    # index
    approx_ttl_s: Positive = setting(
        DEFAULT_APPROX_TTL_S,
        "seconds a prefix routed to a worker without KV events counts as held there "
        "(approximate residency)",
    )
    pending_ttl_s: NonNegative = setting(
        0.0,
        "hold a request's prefix on its worker from dispatch until the worker's KV events "
        "confirm it, or for S seconds, so that concurrent requests find it (e.g. 10; 0: off)",
    )
    index_max_blocks: NonNegativeInt = setting(
        20_000_000,
        "blocks the unified index holds at most, the least recently used dropped "
        "past it (0: no bound)",
    )
    parity_interval_s: NonNegative = setting(
        300.0,
        "probe every worker's token counts against the gateway's every S seconds, and when it "
        "comes up (0: never)",
    )

    # tenants
    salt_secret: str = setting(
        "",
        "keys the tenants' cache salts (unset: random per gateway, one for all its --processes; "
        "gateway replicas in front of one fleet must share one)",
    )

    # load
    max_concurrent_requests: NonNegativeInt = setting(
        0, "inference requests in flight per gateway process; more get 429 (0: unlimited)"
    )
    connect_timeout_s: Positive = setting(2.0, "seconds to connect to a worker")
    ttfb_timeout_s: Positive = setting(
        30.0,
        "seconds to a worker's first byte before the request fails over; a non-streamed one "
        "waits on while its worker answers health checks",
    )
    request_timeout_s: Positive = setting(
        600.0, "seconds a request may take in all", aliases=("--request-timeout-secs",)
    )
    load_interval_s: NonNegative = setting(
        0.05,
        "seconds between samples of every worker's own load (/urc/load, or vLLM's and SGLang's "
        "/metrics), merged into the gateway's ledger so replicas see each other's requests "
        "(0: off, the gateway's own counts only)",
    )
    health_interval_s: Positive = setting(
        0.5,
        "seconds between health checks of each worker",
        aliases=("--health-check-interval-secs",),
    )
    unhealthy_after: PositiveInt = setting(
        2,
        "consecutive failed health checks or requests that take a worker out",
        aliases=("--health-failure-threshold",),
    )
    breaker_cooldown_s: NonNegative = setting(3.0, "seconds a worker taken out stays out at least")

    # flow
    flow_control: bool = setting(
        False, "admission: tenants' budgets, priorities and fair queues while a pool is saturated"
    )
    flow_saturation_ms: Positive = setting(
        500.0, "a pool is saturated when every worker has this many ms of prefill queued"
    )
    flow_queue_max: NonNegativeInt = setting(
        1024, "requests queued per gateway process at most, all pools; beyond: 429 queue_full"
    )
    flow_queue_timeout_s: Positive = setting(
        30.0, "seconds a request waits in the queue at most, then 429 queue_timeout"
    )
    flow_protect_window_s: NonNegative = setting(
        10.0,
        "seconds a flow's rank sent to a worker stays protected there: a request of another "
        "flow ranked after it carries x-urc-protect, so the worker's steps stay short (0: off)",
    )
    flow_budget_share: Annotated[float, Meta(gt=0, le=1)] = setting(
        1.0,
        "the part of every tenant budget this replica enforces (e.g. 1/3 for 3 replicas); "
        "--processes N divides it by N again",
    )

    # http
    max_body_bytes: PositiveInt = setting(
        16 * 2**20, "larger request bodies get 413", aliases=("--max-payload-size",)
    )
    max_request_line_bytes: PositiveInt = setting(8192, "longer URLs get 414")
    max_header_bytes: PositiveInt = setting(65536, "larger request headers get 431")
    header_timeout_s: Positive = setting(
        10.0, "seconds from a request's first byte to the end of its headers, else 408"
    )
    body_timeout_s: Positive = setting(
        60.0, "seconds from the end of the headers to the end of the body, else 408"
    )
    keepalive_s: Positive = setting(
        75.0, "seconds before idle kept-alive connections close", "--keepalive-timeout"
    )
    shutdown_delay_s: NonNegative = setting(
        0.0,
        "on SIGTERM, seconds /health answers 503 while the gateway still accepts and serves, "
        "before it stops accepting (Kubernetes: at least the readiness probe's period times "
        "its failureThreshold)",
    )
    drain_timeout_s: Positive = setting(
        30.0, "on SIGTERM, seconds in-flight requests have to finish before the gateway exits"
    )

    # admin
    admin_key: str | None = setting(None, "the key of the admin API (/admin/...); off without")
    metrics_port: Port | None = setting(
        None, "serve /metrics and /health on this port too", aliases=("--prometheus-port",)
    )
    metrics_host: str = setting(
        "", "address of the metrics port (default: --host)", aliases=("--prometheus-host",)
    )
    metrics_key: str | None = setting(
        None,
        "/metrics on the API port needs 'Authorization: Bearer KEY' (the admin key works too)",
    )
    record: str | None = setting(
        None,
        "append every served request to this file (Mooncake JSONL + model, tenant, worker, "
        "cached tokens) for `urc replay`",
    )

    # logs
    log_level: str = setting("info", "log level: debug, info, warning or error")
    log_format: str = setting("text", "log lines as text or json")
    access_log: bool = setting(False, "one line per request on the urc.access logger")
    otel_endpoint: str = setting(
        "", "OTLP/HTTP traces endpoint, e.g. http://collector:4318 (empty: tracing off)"
    )

    # scale
    processes: PositiveInt = setting(
        1,
        "gateway processes on this host, one port (SO_REUSEPORT), each a full replica; "
        "/metrics and the admin API cover them all (docs/scale-out.md)",
    )
    ingest_per_process: bool = setting(
        False,
        "with --processes N, each process follows every worker's KV events itself (N times the "
        "ingest) rather than one per host sharing its keyed deltas (docs/scale-out.md)",
    )
    kv_groups: str = setting(
        "",
        "route and follow the KV events of only these kv_groups, comma-separated (default: "
        "all): replica sets that each follow a shard of a fleet too large for one",
    )

    # rollout: the plan's settings are declared once, in router/rollout_plan.py (urc replay's too)
    rollout: RolloutPlan = field(
        default_factory=RolloutPlan,
        metadata={"flag": None, "help": "a gradual rollout's plan ([gateway.rollout])"},
    )


TABLES: dict[str, type] = {"workers": WorkerConfig, "models": ModelConfig, "tenants": TenantConfig}


def flag_of(name: str) -> str | None:
    """The flag of GatewayConfig's setting `name` (None: none of its own)."""
    return settings.flag_of(GatewayConfig, name)
