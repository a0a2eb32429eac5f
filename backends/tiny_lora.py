"""A tiny random LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors)
for a Llama checkpoint such as the one backends/tiny_checkpoint.py writes: every attention and
MLP projection, lora_B non-zero (PEFT starts it at zero, which would change nothing), so outputs
differ from the base's. vLLM (`--enable-lora`) and our torch worker load it; nothing is
downloaded; the same arguments write the same files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model.model.layers"  # PEFT's names of a LlamaForCausalLM's layers


def projection_shapes(hf: dict[str, object]) -> dict[str, tuple[str, int, int]]:
    """module -> (its parent in a layer, in features, out features) of a config.json's Llama."""
    from backends.torch_worker.model import LlamaConfig

    cfg = LlamaConfig.from_hf(hf)
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": ("self_attn", hidden, q),
        "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv),
        "o_proj": ("self_attn", q, hidden),
        "gate_proj": ("mlp", hidden, inner),
        "up_proj": ("mlp", hidden, inner),
        "down_proj": ("mlp", inner, hidden),
    }


def write_adapter(
    directory: str | Path, base: str | Path, seed: int = 0, rank: int = 8, alpha: int = 16
) -> Path:
    """An adapter of rank `rank` (vLLM takes 8, 16, 32, ...) and `lora_alpha` `alpha` for the
    checkpoint at `base`, with random A and B from `seed`, in bfloat16."""
    import torch
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    hf = json.loads((Path(base) / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(int(hf["num_hidden_layers"])):
        for module, (parent, fan_in, fan_out) in projection_shapes(hf).items():
            name = f"{_PREFIX}.{layer}.{parent}.{module}"
            a = torch.randn((rank, fan_in), generator=gen) / fan_in**0.5
            b = 0.05 * torch.randn((fan_out, rank), generator=gen)
            weights[f"{name}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            weights[f"{name}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    save_file(weights, str(root / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (root / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--base", required=True, help="the checkpoint directory it adapts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    args = parser.parse_args(argv)
    print(write_adapter(args.directory, args.base, args.seed, args.rank, args.alpha))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
