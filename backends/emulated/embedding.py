"""The emulated worker's embeddings: it has no weights, so a vector is derived from the token
ids alone, deterministically (the same on every machine): the unit-norm sum of a fixed random
vector per token id, so prompts sharing tokens point in similar directions (docs/workers.md)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

EMBEDDING_SIZE = 64


@lru_cache(maxsize=4096)
def token_vector(token: int) -> tuple[float, ...]:
    """Token `token`'s vector: standard normal components from a generator seeded by it."""
    rng = random.Random(token)
    return tuple(rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_SIZE))


def embed(prompt: Sequence[int]) -> list[float]:
    """The unit-norm bag-of-tokens vector of `prompt` (a non-empty list of token ids)."""
    total = [0.0] * EMBEDDING_SIZE
    for token, count in Counter(prompt).items():
        for j, x in enumerate(token_vector(token)):
            total[j] += count * x
    norm = math.sqrt(sum(x * x for x in total)) or 1.0
    return [x / norm for x in total]
