"""A model's KV identity: the hash of everything that decides the K/V of a token sequence
(config, dtype, page size, tokenizer, the weights on the KV path; docs/workers.md)."""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from backends.torch_worker.config import LlamaConfig

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


def dummy_digest(seed: int, init_std: float, device_type: str) -> str:
    """Random weights are identified by their draw (the same seed on another device type
    draws other numbers)."""
    return f"dummy:{seed}:{init_std!r}:{device_type}"


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


def kv_group_of(fingerprint: str) -> str:
    """The kv_group name of a fingerprint: equal fingerprints, one group."""
    return f"kv-{fingerprint[:16]}"
