"""A served model as the HTTP layer sees it (tokenizer, limits, KV identity), and one generation
between an HTTP handler and an engine: the engine side fills it in and sets `changed` after
every change, on the loop's thread; handlers only read."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
    base: ServedModel | None = None  # a LoRA adapter's base model (None: a model of its own)
    lora_path: str | None = None  # where a LoRA adapter was loaded from

    def adapter(self, name: str, path: str) -> ServedModel:
        """A LoRA adapter of this model served as `name`: the base's tokenizer and limits, its
        own kv_group `<base kv_group>+lora:<name>` (as the gateway's mirror files vLLM's)."""
        ident = json.dumps([self.fingerprint, "lora", name, path])
        return ServedModel(
            name=name,
            kv_group=f"{self.kv_group}+lora:{name}",
            fingerprint=hashlib.blake2b(ident.encode(), digest_size=16).hexdigest(),
            tokenizer=self.tokenizer,
            tokenizer_spec=self.tokenizer_spec,
            max_model_len=self.max_model_len,
            default_max_tokens=self.default_max_tokens,
            vocab_size=self.vocab_size,
            base=self,
            lora_path=path,
        )

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter a request for this model runs (None: the base model)."""
        return None if self.base is None else self.name

    def info(self) -> dict[str, Any]:
        """This model's entry in /urc/info (an adapter's with its "base" and "lora_path")."""
        doc: dict[str, Any] = {
            "name": self.name,
            "kv_group": self.kv_group,
            "fingerprint": self.fingerprint,
            "tokenizer": self.tokenizer_spec,
            "max_model_len": self.max_model_len,
        }
        if self.base is not None:
            doc["base"] = self.base.name
            doc["lora_path"] = self.lora_path
        return doc

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


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    ignore_eos: bool = False  # run to max_tokens whatever is sampled
    limit_set: bool = True  # the client asked for max_tokens (else the model's default applies)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need max_tokens >= 1, temperature >= 0 and 0 < top_p <= 1")


@dataclass(slots=True, eq=False)
class Generation:
    model: ServedModel
    prompt: list[int]
    sampling: SamplingParams
    cache_salt: str | None
    chat: bool = False
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    admitted: bool = False
    finish_reason: str | None = None  # "stop" or "length" once finished
    aborted: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    handle: Any = None  # the engine's own record of it
    public_tokens: int = 0  # `urc_public_tokens`: keyed in the shared namespace, then the salt
    priority: int = 0  # vLLM's `priority`: lower is scheduled earlier (docs/workers.md)
    protect: int | None = None  # `x-urc-protect`: a better rank active in the pool (workers.md)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def done(self) -> bool:
        return self.finished or self.aborted

    async def wait(self, admitted: bool = False) -> None:
        """Until it ends, or with `admitted` until it leaves the queue (cached_tokens known)."""
        while not (self.done or (admitted and self.admitted)):
            self.changed.clear()
            await self.changed.wait()

    async def progress(self) -> AsyncIterator[int]:
        """Its output length each time it grows; ends when the generation does."""
        sent = 0
        while True:
            done = self.done  # read before the length: a last token is never missed
            n = len(self.output)
            if n > sent:
                sent = n
                yield n
            if done:
                return
            self.changed.clear()
            if not self.done and len(self.output) == sent:
                await self.changed.wait()

    def usage(self) -> dict[str, Any]:
        completion = len(self.output) if self.finished else 0
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class WorkerLoad(NamedTuple):
    """The engine's load as the HTTP layer reports it (`/urc/load`, `/get_load`, /urc/info)."""

    running: int  # requests in the batch (prefilling or decoding)
    waiting: int  # requests queued, not yet admitted
    used_tokens: int  # KV tokens cached or held by requests
    capacity_tokens: int
    queued_prefill_tokens: int  # prompt tokens admitted or queued requests have yet to compute
    decoding: int  # running requests past their first token
    lora_active: tuple[str, ...] = ()  # LoRA adapters resident in slots, most recent last
    max_loras: int = 0  # adapter slots (0: adapters off)


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Text of `ids`; ids the tokenizer does not know (a random model may sample any id of its
    vocabulary) are left out."""
    try:
        return tokenizer.decode(ids)
    except ValueError:
        return tokenizer.decode([i for i in ids if 0 <= i < tokenizer.vocab_size])


class TextStream:
    """Incremental text of a growing output: each call returns what is new since the last,
    holding back a trailing incomplete UTF-8 sequence until its rest arrives (or the end)."""

    __slots__ = ("tokenizer", "sent")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sent = 0

    def piece(self, ids: list[int], final: bool = False) -> str:
        text = decode(self.tokenizer, ids)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) <= self.sent:
            return ""
        out = text[self.sent :]
        self.sent = len(text)
        return out
