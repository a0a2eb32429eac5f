"""LoRA adapters in the torch worker (docs/workers.md, "LoRA adapters"): a PEFT adapter read into
host memory, copied to the device when it takes a slot, and applied to a projection as
y = W x + (alpha / r) B A x (the scale folded into B once, at reading)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# module -> its parent in a decoder layer: the projections a LoRA may adapt
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_PEFT_PREFIX = "base_model.model."  # PEFT's names start so; the rest are the model's own

LayerLora = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B*scale [out, r])


@dataclass(slots=True)
class LoraWeights:
    """Per decoder layer, the adapted projections' A and scaled B."""

    layers: list[LayerLora]

    def to(self, device: torch.device) -> LoraWeights:
        """A copy on `device` (a copy even on the same device: an activation's real cost)."""
        return LoraWeights(
            [
                {
                    m: (a.to(device, copy=True), b.to(device, copy=True))
                    for m, (a, b) in layer.items()
                }
                for layer in self.layers
            ]
        )

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for ab in layer.values()
            for t in ab
        )


def lora_linear(
    linear: nn.Linear, x: torch.Tensor, lora: LayerLora | None, name: str
) -> torch.Tensor:
    """`linear(x)`, plus the adapter's B A x where it adapts this projection."""
    y = linear(x)
    if lora is None or (ab := lora.get(name)) is None:
        return y
    a, b = ab
    return y + (x @ a.t()) @ b.t()


def read_adapter(path: str, model: nn.Module, dtype: torch.dtype) -> LoraWeights:
    """A PEFT LoRA adapter directory for `model` (a LlamaForCausalLM), in host memory in `dtype`.
    ValueError when it is not one this model can apply (files, type, modules, shapes)."""
    root = Path(path)
    try:
        config = json.loads((root / "adapter_config.json").read_text())
        from safetensors.torch import load_file

        tensors = load_file(str(root / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:  # missing, unreadable, not JSON, not safetensors
        raise ValueError(f"cannot read a LoRA adapter at {path!r}: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    if (
        config.get("use_dora")
        or config.get("modules_to_save")
        or config.get("bias", "none") != "none"
    ):
        raise ValueError(f"{path}: DoRA, modules_to_save and biases are not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    params = dict(model.named_parameters())
    layers: list[LayerLora] = [{} for _ in model.model.layers]
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        weight = params.get(module + ".weight")
        parts = module.split(".")  # model.layers.<i>.<parent>.<projection>
        if b is None or weight is None or len(parts) != 5 or parts[4] not in PROJECTIONS:
            raise ValueError(f"{path}: {name} adapts no projection of this model")
        out_features, in_features = weight.shape
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(f"{path}: {name} has the wrong shape for rank {rank}")
        layers[int(parts[2])][parts[4]] = (a.to(dtype), (b.float() * scale).to(dtype))
    if not any(layers):
        raise ValueError(f"{path}: the adapter adapts nothing")
    return LoraWeights(layers)
