"""One generation as the engine tracks it: its tokens (prompt then output), its pages and its
place in the cache. `computed` tokens have K/V in its pages; the next forward computes the rest.

    pages[0, node_blocks)          in the cache's tree, on the path `node` locks
    pages[node_blocks, len(pages)) private: allocated to it, not (yet) in the tree
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from backends.cache.nodes import Run
from backends.http.generation import SamplingParams
from core.blocks import block_keys, chain_keys, continue_after


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class Request:
    rid: int
    model: str  # the served name it asked for
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished
    cached_tokens: int = 0  # prompt tokens found in the cache at its first admission
    host_hit_tokens: int = 0  # of those, the ones promoted from the host tier
    admitted: bool = False  # cached_tokens is known
    preemptions: int = 0
    # engine bookkeeping (see the module doc)
    kv_group: str = ""
    computed: int = 0
    pages: list[int] = field(default_factory=list, repr=False)
    node: Run | None = field(default=None, repr=False)
    node_blocks: int = 0
    keys: list[int] = field(default_factory=list, repr=False)  # keys of full blocks so far
    order: int = 0  # admission order: preemption takes the newest
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = field(default=None, repr=False)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # when recorded
    # shared isolation: leading prompt blocks keyed in the shared namespace (core/blocks.py)
    public_blocks: int = 0
    priority: int = 0  # vLLM's `priority`: lower is scheduled earlier (docs/workers.md)
    protect: int | None = None  # the gateway's hint: this rank is active elsewhere in the pool
    lora_name: str | None = None  # the LoRA adapter it runs: its keys are in its namespace

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        """Tokens whose K/V the next forward must compute."""
        return self.num_tokens - self.computed

    @property
    def done(self) -> bool:
        return self.status is Status.FINISHED or self.status is Status.ABORTED

    def block_keys(self, blocks: int, page_size: int) -> list[int]:
        """The keys of the first `blocks` full blocks of its tokens (extended as needed)."""
        have = len(self.keys)
        public = self.public_blocks
        if blocks > have and have < public:  # up to or across the public edge: key it whole
            span = self.tokens[: blocks * page_size]
            limit = min(public, blocks)
            self.keys = block_keys(span, page_size, self.cache_salt, limit, self.lora_name)
        elif blocks > have:
            first = continue_after(self.keys, self.cache_salt, public, self.lora_name)
            span = self.tokens[have * page_size : blocks * page_size]
            self.keys.extend(chain_keys(span, page_size, first))
        return self.keys[:blocks]
