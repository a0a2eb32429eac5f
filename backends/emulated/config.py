"""The emulated engine's time model (engine.py): what a forward pass costs, and the pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """The time model. Defaults: an 8B model in bf16 (Llama-3.1-8B) on one H100 SXM 80 GB.

    - decode_base_s 8 ms: a decode step reads all 16 GB of weights; at ~70% of the 3.35 TB/s
      HBM bandwidth that is ~6.8 ms, plus sampling and scheduling (vLLM/SGLang measure a
      7-8 ms inter-token latency at batch 1).
    - decode_per_request_s 0.08 ms: each running request reads its KV every step; 128 KiB
      per token (32 layers x 8 KV heads x 128 dims x K,V x 2 bytes) x ~2k tokens of context
      = 256 MiB, ~0.08 ms at full bandwidth.
    - prefill_tokens_per_s 15k: ~16 GFLOP per token for the weights plus ~2 GFLOP of
      attention at a few thousand tokens of context, so ~270 TFLOP/s, 27% of the 989 TFLOP/s
      dense bf16 peak: a conservative end-to-end figure (the kernels alone reach about twice).
    - capacity_tokens 400k: 80 GB x 0.9 (memory fraction) - 16 GB weights - ~4 GB
      activations and graphs = ~52 GB of KV pool / 128 KiB per token.
    - max_batch 256 and chunk_tokens 8192: vLLM's max_num_seqs and SGLang's chunked prefill
      size on an H100.
    """

    block_size: int = 16
    capacity_tokens: int = 400_000
    prefill_tokens_per_s: float = 15_000.0
    decode_base_s: float = 0.008
    decode_per_request_s: float = 0.00008
    max_batch: int = 256
    chunk_tokens: int = 8192
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

    def step_time(self, decoding: int, prefill_tokens: int) -> float:
        """Seconds of one forward pass with `decoding` requests and `prefill_tokens` to fill."""
        return (
            self.decode_base_s
            + self.decode_per_request_s * decoding
            + prefill_tokens / self.prefill_tokens_per_s
        )
