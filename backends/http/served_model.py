"""A served model name as the HTTP layer sees it: its tokenizer, limits and KV identity."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import APIError
from core.tokenizer import Tokenizer


@dataclass(slots=True)
class ServedModel:
    name: str
    kv_group: str
    fingerprint: str
    tokenizer: Tokenizer
    tokenizer_spec: str  # what core.tokenizer.load_tokenizer takes: "byte" or a directory
    max_model_len: int
    default_max_tokens: int  # when a chat request sets none
    vocab_size: int  # ids the model accepts (at least the tokenizer's)

    def info(self) -> dict[str, Any]:
        """This model's entry in /urc/info."""
        return {
            "name": self.name,
            "kv_group": self.kv_group,
            "fingerprint": self.fingerprint,
            "tokenizer": self.tokenizer_spec,
            "max_model_len": self.max_model_len,
        }

    def check_ids(self, ids: Sequence[object], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"'{param}' must not be empty", param=param)
        vocab = self.vocab_size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                raise APIError(400, f"'{param}' holds a token id outside [0, {vocab})", param=param)
        return list(ids)  # type: ignore[arg-type]

    def max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        """The output length: the request's, or the default shortened to fit the context."""
        room = self.max_model_len - prompt_len
        completion = 1 if requested is None else requested
        if completion > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + completion} tokens ({prompt_len} in the prompt, "
                f"{completion} in the completion). Please reduce the length of the prompt or "
                "completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return min(self.default_max_tokens, room) if requested is None else requested


def pick_model(models: dict[str, ServedModel], requested: object) -> ServedModel:
    """The model a request names (none named: the worker's first). 404 for an unknown name."""
    if requested is None:
        return next(iter(models.values()))
    model = models.get(requested) if isinstance(requested, str) else None
    if model is None:
        raise APIError(
            404,
            f"The model `{requested}` does not exist.",
            param="model",
            code="model_not_found",
        )
    return model
