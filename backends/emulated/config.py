"""The emulated engine's settings, declared once (core/settings.py): the time model, the pool
and the host tier. `urc worker --engine emulated` and `urc replay` make their flags from it."""

from __future__ import annotations

from dataclasses import dataclass

from backends.lora_slots import DEFAULT_MAX_LORAS
from core.blocks import DEFAULT_BLOCK_SIZE
from core.hardware import (
    DEFAULT_HOST_COPY_TOKENS_PER_S,
    DEFAULT_HOST_TO_GPU_GBPS,
    DEFAULT_PREFILL_TOKENS_PER_S,
)
from core.settings import setting


@dataclass(slots=True)
class EngineConfig:
    """The time model; the defaults model an 8B bf16 model on one H100 (docs/workers.md). Each
    setting with a flag is one of `urc worker --engine emulated` and of `urc replay`."""

    block_size: int = setting(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    capacity_tokens: int = setting(400_000, "KV pool size in tokens")
    prefill_tokens_per_s: float = setting(DEFAULT_PREFILL_TOKENS_PER_S, "prefill tokens/s")
    decode_base_s: float = setting(0.008, "a decode step, ms", "--decode-base-ms", flag_scale=1e3)
    decode_per_request_s: float = setting(
        0.00008,
        "added to a decode step per running request, ms",
        "--decode-per-request-ms",
        flag_scale=1e3,
    )
    max_batch: int = setting(256, "running requests")
    chunk_tokens: int = setting(8192, "prefill tokens per step")
    protect_step_s: float = setting(
        0.005,
        "while a better-ranked request is in the engine, worse-ranked ones prefill at most "
        "this much a step, ms of prefill (0: no cap)",
        "--protect-step-ms",
        flag_scale=1e3,
    )
    protect_window_s: float = setting(
        1.0,
        "the cap holds this long after the last better-ranked request left, ms",
        "--protect-window-ms",
        flag_scale=1e3,
    )
    host_capacity_tokens: int = setting(0, "host-memory KV tier in tokens (0: none; docs/tiers.md)")
    host_copy_tokens_per_s: float = setting(
        DEFAULT_HOST_COPY_TOKENS_PER_S, "host -> GPU copy rate of the host tier, tokens/s"
    )
    max_loras: int = setting(DEFAULT_MAX_LORAS, "LoRA adapters active at once (vLLM's)")
    lora_load_gbps: float = setting(
        DEFAULT_HOST_TO_GPU_GBPS, "an adapter's activation copies its bytes at this rate, GB/s"
    )
    # a rank-16 adapter on an 8B model's 7 projections of 32 layers, in bf16
    lora_default_mb: float = setting(84.0, "an adapter's size where its files are absent, MB")
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
        if self.max_loras < 1 or self.lora_load_gbps <= 0 or self.lora_default_mb < 0:
            raise ValueError("need max_loras >= 1, lora_load_gbps > 0 and lora_default_mb >= 0")
        if self.protect_step_s < 0 or self.protect_window_s < 0:
            raise ValueError("need protect_step_s >= 0 and protect_window_s >= 0")

    def protect_tokens(self) -> int:
        """Worse-ranked prefill tokens a step while a better rank is protected (0: no cap; at
        least one block when on, so a capped request still advances)."""
        if not self.protect_step_s:
            return 0
        return max(self.block_size, round(self.protect_step_s * self.prefill_tokens_per_s))

    def step_s(self, decoding: int, prefill_tokens: int, copied_tokens: int) -> float:
        """One forward pass's time (docs/workers.md): a base, each decoding request, the
        step's prefill chunk, and the host-tier blocks copied in for it."""
        return (
            self.decode_base_s
            + self.decode_per_request_s * decoding
            + prefill_tokens / self.prefill_tokens_per_s
            + copied_tokens / self.host_copy_tokens_per_s
        )
