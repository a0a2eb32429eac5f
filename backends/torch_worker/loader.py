"""Models the worker serves: a preset shape (`tiny`, `llama-3.2-1b`) with random weights, or a
Hugging Face directory; and their KV identity, the hash of everything that decides the K/V of
a token sequence (docs/workers.md)."""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from backends.torch_worker.model import PRESETS, LlamaConfig, LlamaForCausalLM
from backends.torch_worker.paging import KVLayout
from core.blocks import DEFAULT_BLOCK_SIZE
from core.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_INIT_STD = 0.1  # larger than HF's 0.02: sharp attention, so a wrong page shows in logits
INIT_STD = 0.02


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAST_LAYER_KV = ("input_layernorm.", "self_attn.k_proj.", "self_attn.v_proj.")


def on_kv_path(name: str, num_layers: int) -> bool:
    """Whether checkpoint tensor `name` can change any layer's K or V."""
    if name.startswith("model.embed_tokens."):
        return True
    match = _LAYER.fullmatch(name)
    if match is None:
        return False
    layer, rest = int(match.group(1)), match.group(2)
    return layer < num_layers - 1 or rest.startswith(_LAST_LAYER_KV)


def safetensors_digest(files: Iterable[Path], num_layers: int) -> str:
    """Hash of the KV-path tensors of a checkpoint, read straight from its files."""
    entries: list[tuple[str, str, list[int], bytes]] = []
    for path in sorted(files):
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            (size,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + size])
            base = 8 + size
            for name, meta in header.items():
                if name == "__metadata__" or not on_kv_path(name, num_layers):
                    continue
                start, end = meta["data_offsets"]
                raw = hashlib.blake2b(data[base + start : base + end], digest_size=16).digest()
                entries.append((name, meta["dtype"], meta["shape"], raw))
    digest = hashlib.blake2b(digest_size=16)
    for name, dtype, shape, raw in sorted(entries):
        digest.update(json.dumps([name, dtype, shape]).encode())
        digest.update(raw)
    return digest.hexdigest()


def model_fingerprint(
    config: LlamaConfig,
    dtype: torch.dtype,
    page_size: int,
    tokenizer_fingerprint: str,
    weights_digest: str,
) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    ident = [config.to_hf(), dtype_name, page_size, tokenizer_fingerprint, weights_digest]
    return hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass(slots=True, eq=False)
class LoadedModel:
    """One set of weights on the device; every served name of it shares this object."""

    source: str
    config: LlamaConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    tokenizer_spec: str  # "byte" or the directory holding tokenizer.json (load_tokenizer's)
    fingerprint: str
    kv_group: str
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    page_size: int

    @property
    def layout(self) -> KVLayout:
        cfg = self.config
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        return KVLayout(cfg.num_hidden_layers, heads, dim, self.page_size, self.dtype)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (expected auto or one of {sorted(DTYPES)})")
    return DTYPES[name]


def _empty_model(config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, device="meta")
    model.to_empty(device=device)
    model.to(dtype)
    if config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _randomize(model: LlamaForCausalLM, seed: int, std: float) -> None:
    """Deterministic random weights: norms 1, biases 0, the rest N(0, std), in name order."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=gen)


def _load_checkpoint(model: LlamaForCausalLM, files: list[Path], device: torch.device) -> None:
    params = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for path in files:
            for name, tensor in load_file(str(path), device=str(device)).items():
                if "rotary_emb" in name:
                    continue  # old checkpoints store RoPE tables; we compute them
                if name not in params:
                    raise ValueError(f"{path.name}: unexpected tensor {name!r}")
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the checkpoint")
                params[name].copy_(tensor)
                seen.add(name)
    missing = set(params) - seen
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"the checkpoint lacks {sorted(missing)[:5]}")


def load_model(
    spec: str,
    *,
    device: torch.device,
    dtype: str = "auto",
    page_size: int = DEFAULT_BLOCK_SIZE,
    load_format: str = "auto",
    seed: int = 0,
    max_model_len: int = 0,
) -> LoadedModel:
    """Load (or build) the model `spec` names; ValueError when it cannot be served."""
    torch_dtype = resolve_dtype(dtype, device)
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load format {load_format!r}")
    tokenizer: Tokenizer
    if spec in PRESETS:
        config = PRESETS[spec]
        tokenizer, tokenizer_spec = ByteTokenizer(), "byte"
        files: list[Path] = []
        dummy = True
    else:
        root = Path(spec)
        if not (root / "config.json").is_file():
            raise ValueError(
                f"{spec!r} is neither a preset {sorted(PRESETS)} nor a model directory"
            )
        config = LlamaConfig.from_hf(json.loads((root / "config.json").read_text()))
        tokenizer, tokenizer_spec = HFTokenizer(root), str(root.resolve())
        files = sorted(root.glob("*.safetensors"))
        dummy = load_format == "dummy"
        if not dummy and not files:
            raise ValueError(
                f"{spec}: no *.safetensors (use --load-format dummy for random weights)"
            )
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{spec}: the tokenizer has more ids than the model's vocab_size")
    model = _empty_model(config, torch_dtype, device)
    std = TINY_INIT_STD if spec == "tiny" else INIT_STD
    if dummy:
        _randomize(model, seed, std)
        weights = f"dummy:{seed}:{std!r}:{device.type}"  # its draw (device types draw apart)
    else:
        _load_checkpoint(model, files, device)
        weights = safetensors_digest(files, config.num_hidden_layers)
    fingerprint = model_fingerprint(config, torch_dtype, page_size, tokenizer.fingerprint, weights)
    limit = config.max_position_embeddings
    return LoadedModel(
        source=spec,
        config=config,
        model=model,
        tokenizer=tokenizer,
        tokenizer_spec=tokenizer_spec,
        fingerprint=fingerprint,
        kv_group=f"kv-{fingerprint[:16]}",  # equal fingerprints, one group
        max_model_len=min(max_model_len, limit) if max_model_len > 0 else limit,
        dtype=torch_dtype,
        device=device,
        page_size=page_size,
    )
