"""A Llama-architecture model's shape, read from (and written as) a Hugging Face config.json;
`PRESETS` are shapes built with random weights, nothing downloaded."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from core.tokenizer import BYTE_VOCAB_SIZE

_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: str | None = None  # the config's rope_scaling object as canonical JSON
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.hidden_size, self.num_hidden_layers) <= 0:
            raise ValueError("vocab_size, hidden_size and num_hidden_layers must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else json.loads(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """From a config.json; ValueError for an architecture this engine does not run."""
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (expected one of {_ARCHITECTURES})"
            )
        heads = int(hf["num_attention_heads"])
        scaling = hf.get("rope_scaling")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10_000.0)),
            rope_scaling=None if scaling is None else json.dumps(scaling, sort_keys=True),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that `from_hf` reads back to an equal config."""
        out: dict[str, Any] = asdict(self)
        out["rope_scaling"] = self.rope_scaling_dict
        out["architectures"] = ["LlamaForCausalLM"]
        out["model_type"] = "llama"
        out["hidden_act"] = "silu"
        return out


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
    ),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500_000.0,
        rope_scaling='{"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, '
        '"original_max_position_embeddings": 8192, "rope_type": "llama3"}',  # canonical JSON
        max_position_embeddings=131_072,
        tie_word_embeddings=True,
    ),
}
