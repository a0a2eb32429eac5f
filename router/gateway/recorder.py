"""`--record FILE`: each served request as a Mooncake JSON line, written as it ends, that
`urc replay` reads back (docs/traces.md)."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from router.gateway.fleet import Worker
from router.gateway.proxy import Usage
from router.gateway.routing import Plan


class Recorder:
    """`--record FILE`: a Mooncake JSON line per served request, as it ends (docs/traces.md)."""

    def __init__(self, path: str | Path, policy: str) -> None:
        self.path = Path(path)
        self.policy = policy
        self._file = self.path.open("ab", buffering=1 << 16)
        self._t0 = time.monotonic()  # the clock of Plan.arrived
        self._encode = msgspec.json.Encoder().encode

    def record(self, plan: Plan, worker: Worker, tenant: str, usage: Usage) -> None:
        line = {
            "timestamp": round((plan.arrived - self._t0) * 1000, 3),
            "input_length": plan.request.prompt_tokens,
            "output_length": usage.output_tokens or 0,
            "hash_ids": plan.request.block_keys,
            "block_size": plan.model.block_size,
            "model": plan.model.name,
            "tenant": tenant,
            "worker": worker.name,
            "policy": self.policy,
            "predicted_tokens": plan.matched(worker.name),
            "cached_tokens": usage.cached_tokens,
        }
        self._file.write(self._encode(line) + b"\n")

    def close(self) -> None:
        self._file.close()
