"""The hardware urc's defaults model: an 8B bf16 model on one H100 SXM 80GB (docs/workers.md).
The emulated engine runs at these rates, and the gateway's cost model and `cache_aware` assume
them until configured otherwise."""

from __future__ import annotations

from typing import Final

# ~18 GFLOP per token (weights and attention) at 27% of the dense bf16 peak
DEFAULT_PREFILL_TOKENS_PER_S: Final = 15_000.0
# a host-tier block's copy back to the GPU: ~128 KiB of KV per token over ~50 GB/s of PCIe 5
DEFAULT_HOST_COPY_TOKENS_PER_S: Final = 400_000.0
# host -> GPU copies of weights (a LoRA adapter's activation): PCIe 5 x16, one direction, pinned
DEFAULT_HOST_TO_GPU_GBPS: Final = 50.0
