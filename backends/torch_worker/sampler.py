"""Next-token choice from a row of logits: greedy at temperature 0, else temperature, top-k and
top-p (nucleus) sampling from the request's own seeded generator."""

from __future__ import annotations

import torch

from backends.torch_worker.request import Request


def sample(req: Request, logits: torch.Tensor) -> int:
    """logits: [vocab] float32 for one request."""
    params = req.params
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if req.generator is None:
        req.generator = torch.Generator(device=probs.device)
        if params.seed is not None:
            req.generator.manual_seed(params.seed)
        else:
            req.generator.seed()
    return int(torch.multinomial(probs, 1, generator=req.generator))
