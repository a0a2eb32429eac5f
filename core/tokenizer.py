"""Prompt -> token ids, exactly as the serving engine tokenizes it (docs/block-keys.md: a
completion prompt with special tokens, a chat rendered by its template then encoded without)."""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFBackend
from tokenizers import processors

from core.chat_template import ChatTemplate, Message

Tools = Sequence[Mapping[str, Any]]


class Tokenizer(ABC):
    """What decides a prompt's ids; chat is one path for all: the template, then `encode_plain`."""

    fingerprint: str  # a digest of all that decides the ids: part of a model's KV identity
    eos_token_id: int | None
    vocab_size: int  # ids are in [0, vocab_size)
    stop_token_ids: frozenset[int]  # generation ends on any of these
    _templates: dict[str, ChatTemplate]  # by name, as transformers keeps them

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Completion prompt -> ids, special tokens added (BOS if the tokenizer has one)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def encode_plain(self, text: str) -> list[int]:
        """Text -> ids, no special tokens added (special tokens in the text still match)."""

    @abstractmethod
    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as its tokenizer.json names it (vLLM's `token_strs`); ValueError
        on an id outside the vocabulary."""

    def _template_for(self, tools: Tools | None) -> ChatTemplate:
        """transformers' `get_chat_template`: "tool_use" when tools are given, else "default"."""
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        if name in self._templates:
            return self._templates[name]
        if not self._templates:
            raise ValueError("this model has no chat template: use the completions API")
        raise ValueError(f"no 'default' chat template among {sorted(self._templates)}")

    def prompt_ids(self, text: str) -> Sequence[int]:
        """`encode`'s ids as the cheapest read-only sequence (the gateway only counts, hashes)."""
        return self.encode(text)

    def render_chat(
        self,
        messages: Sequence[Message],
        tools: Tools | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text (with the generation prompt unless told otherwise);
        ValueError on bad messages."""
        template = self._template_for(tools)
        return template.render(messages, tools, template_kwargs, add_generation_prompt)

    def encode_chat(
        self,
        messages: Sequence[Message],
        tools: Tools | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """`render_chat` encoded without special tokens added; ValueError on bad messages."""
        text = self.render_chat(messages, tools, template_kwargs, add_generation_prompt)
        return self.encode_plain(text)


BYTE_SPECIAL_TOKENS: dict[str, int] = {
    "<|bos|>": 256,  # reserved: nothing adds it (no BOS on either path)
    "<|eos|>": 257,
    "<|im_start|>": 258,
    "<|im_end|>": 259,
}
BYTE_VOCAB_SIZE = 260
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character map (HF `ByteLevel`), indexed by byte: printable
    Latin-1 bytes stand for themselves, the rest for U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = iter(range(0x100, 0x200))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


class ByteTokenizer(Tokenizer):
    """id = UTF-8 byte, one id per special token wherever its text appears, no BOS; chat: ChatML."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_token_id = BYTE_SPECIAL_TOKENS["<|eos|>"]
    stop_token_ids = frozenset({BYTE_SPECIAL_TOKENS["<|eos|>"], BYTE_SPECIAL_TOKENS["<|im_end|>"]})
    fingerprint = hashlib.blake2b(
        json.dumps(["byte-v1", BYTE_SPECIAL_TOKENS, BYTE_CHAT_TEMPLATE]).encode(), digest_size=16
    ).hexdigest()

    _SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in BYTE_SPECIAL_TOKENS) + ")")
    _SPECIAL_TEXT = {i: t.encode() for t, i in BYTE_SPECIAL_TOKENS.items()}
    # the token strings of write_byte_tokenizer's tokenizer.json, by id
    TOKEN_STRS = [*_byte_level_chars(), *sorted(BYTE_SPECIAL_TOKENS, key=BYTE_SPECIAL_TOKENS.get)]

    def __init__(self) -> None:
        special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
        self._templates = {"default": ChatTemplate(BYTE_CHAT_TEMPLATE, special)}

    def encode(self, text: str) -> list[int]:
        ids = self.prompt_ids(text)
        return ids if isinstance(ids, list) else list(ids)

    def prompt_ids(self, text: str) -> Sequence[int]:
        """Text without special tokens: its UTF-8 `bytes` (block keys hash them as they are)."""
        if "<|" not in text:
            return text.encode()
        ids: list[int] = []
        for i, piece in enumerate(self._SPECIAL_RE.split(text)):
            if i % 2:  # odd pieces are the captured special tokens
                ids.append(BYTE_SPECIAL_TOKENS[piece])
            elif piece:
                ids.extend(piece.encode())
        return ids

    encode_plain = encode  # the byte tokenizer adds no special tokens

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. ValueError on ids outside the vocab."""
        raw = bytearray()
        for i in ids:
            if 0 <= i < 256:
                raw.append(i)
            elif i in self._SPECIAL_TEXT:  # ASCII: it ends any broken sequence before it
                raw += self._SPECIAL_TEXT[i]
            else:
                raise ValueError(f"token id {i} is outside the byte vocabulary")
        return raw.decode(errors="replace")

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        if any(not 0 <= i < BYTE_VOCAB_SIZE for i in ids):
            raise ValueError(f"a token id is outside the byte vocabulary [0, {BYTE_VOCAB_SIZE})")
        return [self.TOKEN_STRS[i] for i in ids]


def write_byte_tokenizer(directory: str | Path) -> Path:
    """Write the byte tokenizer as a Hugging Face fast tokenizer (`tokenizer.json`,
    `tokenizer_config.json`) into `directory`, created if missing, and return it:
    `AutoTokenizer.from_pretrained(directory)` (and `HFTokenizer`) then give ByteTokenizer's
    ids, chats included: each byte its own id through `ByteLevel` and a merge-free BPE, the
    special tokens as added tokens, no BOS (docs/workers.md)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    chars = ByteTokenizer.TOKEN_STRS[:256]
    special = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for t, i in BYTE_SPECIAL_TOKENS.items()
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    model = {"type": "BPE", "vocab": {c: i for i, c in enumerate(chars)}, "merges": []}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {**byte_level, "use_regex": True},
        "post_processor": None,
        "decoder": {**byte_level, "use_regex": True},
        "model": model,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "chat_template": BYTE_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    (root / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return root


_SPECIAL_TOKEN_KEYS = [f"{k}_token" for k in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")]


def _token_text(value: Any) -> str | None:
    """A special token as configured: a string, an AddedToken dict with "content", or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


class HFTokenizer(Tokenizer):
    """A Hugging Face directory's fast tokenizer, set up as in transformers (docs/block-keys.md)."""

    def __init__(self, directory: str | Path) -> None:
        root = Path(directory)
        tokenizer_json = root / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ValueError(f"{root}: no tokenizer.json (only fast tokenizers are supported)")
        raw = tokenizer_json.read_bytes()
        self._backend = _HFBackend.from_str(raw.decode("utf-8"))
        config = _read_json(root / "tokenizer_config.json")
        config.update(_read_json(root / "special_tokens_map.json"))

        texts = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        special: dict[str, Any] = {k: t for k, t in texts.items() if t is not None}
        extra = [_token_text(t) for t in config.get("additional_special_tokens") or []]
        if extra:
            special["additional_special_tokens"] = [t for t in extra if t is not None]
        self.special_tokens: dict[str, Any] = special

        add_flags = {k: config[k] for k in ("add_bos_token", "add_eos_token") if k in config}
        if add_flags:
            self._set_post_processor(
                bool(add_flags.get("add_bos_token")), bool(add_flags.get("add_eos_token"))
            )

        sources = self._template_sources(root, config.get("chat_template"))
        self._templates = {name: ChatTemplate(src, special) for name, src in sources.items()}

        eos = special.get("eos_token")
        self.eos_token_id: int | None = None if eos is None else self._backend.token_to_id(eos)
        stops = _read_json(root / "generation_config.json").get("eos_token_id")
        stops = stops if isinstance(stops, list) else [stops]
        self.stop_token_ids: frozenset[int] = frozenset(
            i for i in [self.eos_token_id, *stops] if isinstance(i, int)
        )
        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        digest = hashlib.blake2b(raw, digest_size=16)
        digest.update(json.dumps([sources, special, add_flags], sort_keys=True).encode())
        self.fingerprint: str = digest.hexdigest()

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """What transformers' LlamaTokenizerFast.update_post_processor does with explicit flags."""
        single, pair, specials = "$A:0", "$B:1", []
        for flag, key in ((add_bos, "bos_token"), (add_eos, "eos_token")):
            if not flag:
                continue
            token = self.special_tokens.get(key)
            token_id = None if token is None else self._backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"add_{key} is true but the tokenizer has no {key}")
            specials.append((token, token_id))
            if key == "bos_token":
                single, pair = f"{token}:0 {single}", f"{token}:1 {pair}"
            else:
                single, pair = f"{single} {token}:0", f"{pair} {token}:1"
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {pair}", special_tokens=specials
        )

    @staticmethod
    def _template_sources(root: Path, configured: Any) -> dict[str, str]:
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():  # transformers: clobbers any template in the config
            return {"default": jinja_file.read_text(encoding="utf-8")}
        if configured is None:
            return {}
        if isinstance(configured, str):
            return {"default": configured}
        if isinstance(configured, list) and all(
            isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
            for t in configured
        ):
            return {t["name"]: t["template"] for t in configured}
        raise ValueError(f"{root}: chat_template must be a string or a list of {{name, template}}")

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=True).ids

    def encode_plain(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        strs = [self._backend.id_to_token(i) for i in ids]
        if any(s is None for s in strs):
            raise ValueError(f"a token id is outside the vocabulary [0, {self.vocab_size})")
        return strs  # type: ignore[return-value]


def load_tokenizer(spec: str) -> Tokenizer:
    """ "byte" -> ByteTokenizer; a Hugging Face model directory -> HFTokenizer; else ValueError."""
    if spec == "byte":
        return ByteTokenizer()
    if Path(spec).is_dir():
        return HFTokenizer(spec)
    raise ValueError(
        f"unknown tokenizer {spec!r}: expected 'byte' or a directory holding tokenizer.json"
    )
