"""What the emulated worker serves: one model name on the byte tokenizer, and its KV identity."""

from __future__ import annotations

import hashlib
import json

from backends.http.served_model import ServedModel
from core.tokenizer import ByteTokenizer

ENGINE = "emulated"


def kv_fingerprint(kv_group: str, block_size: int, tokenizer_fingerprint: str) -> str:
    """The KV identity of a group: workers that agree on it produce identical K/V for
    identical tokens (same emulated weights, tokenizer and block size)."""
    ident = json.dumps([ENGINE, kv_group, block_size, tokenizer_fingerprint])
    return hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()


def served_model(
    name: str, kv_group: str, block_size: int, max_model_len: int, default_max_tokens: int
) -> ServedModel:
    tokenizer = ByteTokenizer()
    return ServedModel(
        name=name,
        kv_group=kv_group,
        fingerprint=kv_fingerprint(kv_group, block_size, tokenizer.fingerprint),
        tokenizer=tokenizer,
        tokenizer_spec="byte",
        max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        vocab_size=tokenizer.vocab_size,
    )
