"""The body of `GET /v1/models`, which `urc gateway` and `urc epp` both answer (docs/epp.md)."""

from __future__ import annotations

import json

from router.gateway.fleet import Fleet, Worker


class ModelList:
    """The models some up worker serves, by served name (aliases a worker serves included),
    each with its kv_group, sorted: an OpenAI model list. `body` is rendered again whenever a
    worker comes up or goes down (the Fleet's hooks: the only times the served set changes), so
    a request sends bytes made once."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.body = self.render()
        fleet.on_up.append(self._changed)
        fleet.on_down.append(self._changed)

    def render(self) -> bytes:
        served = {name for w in self.fleet.workers.values() if w.up for name in w.models}
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "urc", "kv_group": m.kv_group}
            for name, m in sorted(self.fleet.models.items())
            if name in served
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    def _changed(self, _worker: Worker) -> None:
        self.body = self.render()
