"""The emulated engine's time model: what a forward pass costs, and the pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """The time model; the defaults model an 8B bf16 model on one H100 (docs/workers.md)."""

    block_size: int = 16
    capacity_tokens: int = 400_000
    prefill_tokens_per_s: float = 15_000.0
    decode_base_s: float = 0.008
    decode_per_request_s: float = 0.00008
    max_batch: int = 256
    chunk_tokens: int = 8192
    # the host tier (docs/tiers.md; 0: none) and its copy rate: ~128 KiB of KV per token over
    # ~50 GB/s of PCIe 5 (docs/workers.md)
    host_capacity_tokens: int = 0
    host_copy_tokens_per_s: float = 400_000.0
    report_tokens: bool = True  # StepResult.emitted per request (a simulator turns it off)
    emit_events: bool = True  # StepResult.events (BlockStored / BlockRemoved)
    # BlockStored carries the blocks' token ids; off, token_ids is empty (a simulator that
    # applies the keys itself, and requests known only by their keys, need no tokens)
    event_tokens: bool = True

    def __post_init__(self) -> None:
        if min(self.block_size, self.max_batch, self.chunk_tokens) <= 0:
            raise ValueError("block_size, max_batch and chunk_tokens must be positive")
        if self.prefill_tokens_per_s <= 0 or self.decode_base_s < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and decode_base_s >= 0")
        if self.decode_per_request_s < 0 or self.capacity_tokens < self.block_size:
            raise ValueError("need decode_per_request_s >= 0 and capacity_tokens >= block_size")
        if self.decode_base_s + self.decode_per_request_s <= 0:
            raise ValueError("a decode step must take time")
        if self.host_capacity_tokens and self.host_capacity_tokens < self.block_size:
            raise ValueError("host_capacity_tokens must be 0 (no host tier) or >= block_size")
        if self.host_capacity_tokens < 0 or self.host_copy_tokens_per_s <= 0:
            raise ValueError("need host_capacity_tokens >= 0 and host_copy_tokens_per_s > 0")
