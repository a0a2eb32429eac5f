"""Routing policies (docs/policies.md): pure objects from (request, candidates) to a Decision,
and the policies by name, with parameters as keyword values (strings are converted: "64")."""

import inspect
import math
from collections.abc import Mapping
from typing import Any, Final

from router.policies.base import Candidate, Decision, Policy, RouteRequest, Score, WorkerLoad
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.consistent_hash import ConsistentHashPolicy
from router.policies.least_load import LeastLoadPolicy, PowerOfTwoPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.sglang import SGLangCacheAwarePolicy

__all__ = [
    "FLEET_SETTINGS",
    "POLICY_NAMES",
    "CacheAwarePolicy",
    "Candidate",
    "ConsistentHashPolicy",
    "Decision",
    "LeastLoadPolicy",
    "Policy",
    "PowerOfTwoPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "SGLangCacheAwarePolicy",
    "Score",
    "WorkerLoad",
    "make_policy",
    "policy_params",
    "told_params",
]

POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (
        CacheAwarePolicy,
        RoundRobinPolicy,
        LeastLoadPolicy,
        PowerOfTwoPolicy,
        ConsistentHashPolicy,
        SGLangCacheAwarePolicy,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)

# what a policy that models it is told by its fleet, never given as a parameter: one knob, the
# gateway's prefill_tokens_per_s (its cost model's too) or the replay's engine's
FLEET_SETTINGS: Final = ("prefill_tokens_per_s",)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _signature(name: str) -> dict[str, Any]:
    """Everything policy `name` takes, with its default."""
    cls = _policy_class(name)
    # the class's signature, not __init__'s: a compiled class (core/native.py) tells only that
    # one, its parameters marked positional-only although it takes them by keyword too
    return {
        p.name: p.default
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)
    }


def policy_params(name: str) -> dict[str, Any]:
    """The parameters one may give policy `name`, with their defaults (FLEET_SETTINGS are not)."""
    return {k: v for k, v in _signature(name).items() if k not in FLEET_SETTINGS}


def told_params(name: str, told: Mapping[str, Any]) -> dict[str, Any]:
    """Of what the caller knows of its fleet (settings, a seed), what policy `name` takes."""
    takes = _signature(name)
    return {k: v for k, v in told.items() if k in takes}


def make_policy(name: str, told: Mapping[str, Any] | None = None, /, **params: Any) -> Policy:
    """Build policy `name` from what the caller knows of its fleet (`told`: taken where the
    policy has it) and the given parameters, which override it; values may be strings ("64",
    "0.3", "true") and are converted to the type of the parameter's default. Unknown names,
    parameters or values, or a fleet setting given as a parameter: ValueError."""
    defaults = policy_params(name)
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        fleet = [k for k in unknown if k in FLEET_SETTINGS]
        if fleet:
            raise ValueError(
                f"{', '.join(fleet)} is a setting of the fleet, not a policy parameter: the "
                "gateway's, or the replay's engine (--prefill-tokens-per-s)"
            )
        known = ", ".join(defaults) or "none"
        raise ValueError(f"policy {name!r} has no parameter {', '.join(unknown)} (known: {known})")
    converted = {key: _convert(name, key, value, defaults[key]) for key, value in params.items()}
    return _policy_class(name)(**{**told_params(name, told or {}), **converted})


def _policy_class(name: str) -> type:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})") from None


def _convert(policy: str, key: str, value: Any, default: Any) -> Any:
    kind = type(default)
    try:
        if kind in (int, float) and isinstance(value, bool):
            raise ValueError(value)  # an int to Python, never a number here
        if kind is bool:
            text = str(value).strip().lower()
            if text not in _TRUE and text not in _FALSE:
                raise ValueError(value)
            return text in _TRUE
        if kind is int and not isinstance(value, int):
            try:
                return int(str(value).strip())
            except ValueError:
                number = float(value)  # "64.0" or "1e3"
            if not number.is_integer():
                raise ValueError(value)
            return int(number)
        if kind is float:
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(value)
            return number
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"policy {policy!r}: {key}={value!r} is not a valid {kind.__name__}"
        ) from None
