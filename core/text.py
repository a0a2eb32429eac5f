"""Deterministic filler text: printable ASCII with no `<|`, so `len(text)` is its token count
under the byte tokenizer. The same `key` gives the same text in any process (`random.Random(str)`
seeds from a SHA-512 of the string, not from Python's randomised `hash`)."""

from __future__ import annotations

import random
from functools import lru_cache

# Short common words: a fixed vocabulary keeps text readable and real tokenizers' lengths sane.
_WORDS = """
    the of and to in is it that for on with as was at by be this are from or have an they which
    one you were all we her she there been if more when will would who so no time can out up
    about into than them some could only other new then its also two may first any these like
    now over such our man me even most made after way many must before through back years where
    much your well down should because each just those people how too little state good very
    make world still own see men work long get here between both life being under never day
    same another know while last might us great old year off come since against go came right
    used take three cache model token block prefix route worker query answer system user server
    data graph node tree page layer batch queue match hash merge value table index green river
    stone cloud light water paper field music north south east west small large quick quiet
"""
VOCAB: tuple[str, ...] = tuple(_WORDS.split())


@lru_cache(maxsize=65536)
def filler(n_tokens: int, key: str) -> str:
    """Exactly `n_tokens` ASCII bytes of space-separated vocabulary words, fixed by `key`."""
    assert n_tokens >= 0, n_tokens
    rng = random.Random(f"urc-loadgen/{key}")
    parts: list[str] = []
    size = 0
    while size < n_tokens:
        words = rng.choices(VOCAB, k=n_tokens // 5 + 8)
        chunk = " ".join(words) + " "
        parts.append(chunk)
        size += len(chunk)
    return "".join(parts)[:n_tokens]
