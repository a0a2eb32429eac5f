"""Routing policies (docs/policies.md): pure objects from (request, candidates) to a Decision."""

from router.policies.base import Candidate, Decision, Policy, RouteRequest, Score, WorkerLoad
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.consistent_hash import ConsistentHashPolicy
from router.policies.least_load import LeastLoadPolicy, PowerOfTwoPolicy
from router.policies.registry import POLICY_NAMES, make_policy, policy_params
from router.policies.round_robin import RoundRobinPolicy
from router.policies.sglang import SGLangCacheAwarePolicy

__all__ = [
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
]
