"""What the emulated worker serves: one model name on the byte tokenizer, and its limits."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.emulated.api_errors import ApiError
from router.tokenizer import ByteTokenizer

ENGINE = "emulated"


def kv_fingerprint(kv_group: str, block_size: int, tokenizer_fingerprint: str) -> str:
    """The KV identity of a group: workers that agree on it produce identical K/V for
    identical tokens (same emulated weights, tokenizer and block size)."""
    ident = json.dumps([ENGINE, kv_group, block_size, tokenizer_fingerprint])
    return hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()


@dataclass(slots=True)
class ServedModel:
    name: str
    kv_group: str
    block_size: int
    max_model_len: int
    default_max_tokens: int  # when a request sets none
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)

    @property
    def fingerprint(self) -> str:
        return kv_fingerprint(self.kv_group, self.block_size, self.tokenizer.fingerprint)

    def info(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kv_group": self.kv_group,
            "fingerprint": self.fingerprint,
            "tokenizer": "byte",
            "max_model_len": self.max_model_len,
        }

    def check_model(self, requested: object) -> None:
        """404 unless the request names this model (or none)."""
        if requested is None or requested == self.name:
            return
        raise ApiError(
            404,
            f"The model `{requested}` does not exist.",
            param="model",
            code="model_not_found",
        )

    def check_ids(self, ids: Sequence[object], param: str) -> list[int]:
        if not ids:
            raise ApiError(400, f"'{param}' must not be empty", param=param)
        vocab = self.tokenizer.vocab_size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                raise ApiError(400, f"'{param}' holds a token id outside [0, {vocab})", param=param)
        return list(ids)  # type: ignore[arg-type]

    def max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        """The output length: the request's, or the default shortened to fit the context."""
        room = self.max_model_len - prompt_len
        if requested is None:
            if room < 1:
                raise self._too_long(prompt_len, 1, prompt_param)
            return min(self.default_max_tokens, room)
        if requested > room:
            raise self._too_long(prompt_len, requested, prompt_param)
        return requested

    def _too_long(self, prompt_len: int, completion: int, param: str) -> ApiError:
        return ApiError(
            400,
            f"This model's maximum context length is {self.max_model_len} tokens. However, "
            f"you requested {prompt_len + completion} tokens ({prompt_len} in the prompt, "
            f"{completion} in the completion). Please reduce the length of the prompt or "
            "completion.",
            param=param,
            code="context_length_exceeded",
        )
