"""Turns one model's batch of (request, new tokens) into tensors (decodes first, as attention.py
expects) and runs one forward pass; the logits of requests that get a next token."""

from __future__ import annotations

from typing import NamedTuple

import torch

from backends.torch_worker.attention import (
    BatchLayout,
    PagedAttention,
    SequenceView,
    new_token_slots,
)
from backends.torch_worker.model import LlamaForCausalLM
from backends.torch_worker.paging import PagePool
from backends.torch_worker.request import Request


class WorkItem(NamedTuple):
    req: Request
    n: int  # new tokens this forward computes: tokens[computed : computed + n]


class ForwardResult(NamedTuple):
    sampled: list[Request]  # requests whose last token was computed: they get a next token
    logits: torch.Tensor  # [len(sampled), vocab] float32, row i for sampled[i]


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, attention: PagedAttention, device: torch.device
    ) -> None:
        self.model = model
        self.attention = attention
        self.device = device

    def forward(self, pool: PagePool, items: list[WorkItem]) -> ForwardResult:
        bs = pool.layout.page_size
        decodes = [SequenceView(1, it.req.computed + 1, it.req.pages) for it in items if it.n == 1]
        prefills = [
            SequenceView(it.n, it.req.computed + it.n, it.req.pages) for it in items if it.n > 1
        ]
        ordered = [it for it in items if it.n == 1] + [it for it in items if it.n > 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []  # the batch row of each sampled request's last token
        sampled: list[Request] = []
        for it, seq in zip(ordered, decodes + prefills, strict=True):
            req, start = it.req, it.req.computed
            assert len(req.pages) * bs >= start + it.n, "pages do not cover the chunk"
            ids.extend(req.tokens[start : start + it.n])
            positions.extend(range(start, start + it.n))
            slots.extend(new_token_slots(seq, bs))
            if start + it.n == req.num_tokens:
                rows.append(len(ids) - 1)
                sampled.append(req)
        device = self.device
        layout = BatchLayout(bs, decodes, prefills, torch.tensor(slots, dtype=torch.long))
        self.attention.prepare(layout, device)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            pool.kv,
            layout.write_slots.to(device),
            self.attention,
        )
        if not rows:
            return ForwardResult([], hidden.new_empty((0, self.model.config.vocab_size)))
        logits = self.model.logits(hidden[torch.tensor(rows, device=device)])
        return ForwardResult(sampled, logits)
