"""The byte tokenizer written as a Hugging Face tokenizer (`write_byte_tokenizer`): loaded by
transformers' AutoTokenizer and by our HFTokenizer, it gives ByteTokenizer's own ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.tokenizer import BYTE_SPECIAL_TOKENS, ByteTokenizer, HFTokenizer, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

OURS = ByteTokenizer()
TEXTS = [
    "",
    "Hello there, how are you today?",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "Grüße aus München, ça va? 日本語も少し。 🎉",
    "<|im_start|>user\nhi<|im_end|>\n<|eos|> and <|bos|> mid-text, <|not_special|>",
    "'s 't 're numbers 12345 and symbols !@#$%^&*()",
]
CHATS = [
    [{"role": "user", "content": "hi é"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Grüße 🎉"},
        {"role": "assistant", "content": "ok"},
    ],
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_tokenizer(tmp_path_factory.mktemp("byte") / "tok")


@pytest.fixture(scope="module")
def auto(directory: Path):  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("text", TEXTS)
def test_auto_tokenizer_gives_the_byte_ids(auto, directory: Path, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = OURS.encode(text)
    assert auto(text)["input_ids"] == ids
    assert auto.encode(text, add_special_tokens=False) == ids
    assert HFTokenizer(directory).encode(text) == ids
    assert auto.decode(ids) == OURS.decode(ids) == text
    assert auto.convert_ids_to_tokens(ids) == OURS.token_strs(ids)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("generation", [True, False])
def test_the_chat_template_travels(auto, messages: list, generation: bool) -> None:  # type: ignore[no-untyped-def]
    ids = auto.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 answers a BatchEncoding
        ids = ids["input_ids"]
    assert ids == OURS.encode_chat(messages, add_generation_prompt=generation)


def test_special_tokens_and_vocabulary(auto) -> None:  # type: ignore[no-untyped-def]
    assert len(auto) == OURS.vocab_size
    assert auto.eos_token_id == OURS.eos_token_id and auto.bos_token == "<|bos|>"
    for text, token_id in BYTE_SPECIAL_TOKENS.items():
        assert auto.convert_tokens_to_ids(text) == token_id
    with pytest.raises(ValueError):
        OURS.token_strs([OURS.vocab_size])


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text(auto, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = OURS.encode(text)
    assert auto.encode(text, add_special_tokens=False) == ids
    assert auto.decode(ids) == OURS.decode(ids)
