"""Our `/tokenize` and `/detokenize` against a real vLLM CPU engine's (`make test-vllm`; skipped
without URC_VLLM_PYTHON): our torch worker and vLLM on the same tiny checkpoint (tokenizer, chat
template, max_model_len), the same requests, the same answers field for field; bad input the same
4xx, OpenAI-shaped, naming the same field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import httpx
import pytest

from backends.tiny_checkpoint import write_checkpoint
from tests import processes
from tests.backends.vllm_fleet import MODEL, VLLM_PYTHON, start_vllm_engines

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON, reason="URC_VLLM_PYTHON unset (make test-vllm)"),
    pytest.mark.timeout(600),
]
MAX_MODEL_LEN = 1024  # both configured alike: the field is the engine's, not the tokenizer's
PROMPT = "Hello there, 12 cats! <|eos|> wörld 🎉"
CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Grüße 🎉 the cat"},
]
PARTS = [
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class Pair(NamedTuple):
    ours: str
    vllm: str


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("vllm-tokenize")
    model_dir = write_checkpoint(root / "model")
    args = ["--model", f"{MODEL}={model_dir}", "--max-model-len", str(MAX_MODEL_LEN)]
    with processes.running_worker(
        "backends.torch_worker.server", "--threads", "1", "--num-pages", "64", *args
    ) as worker:
        (engine,) = start_vllm_engines(model_dir, root, 1, num_blocks=64)
        try:
            yield Pair(worker.url, engine.endpoints.url)
        finally:
            engine.stop()


def both(pair: Pair, path: str, body: Any) -> tuple[httpx.Response, httpx.Response]:
    return tuple(httpx.post(f"{url}{path}", json=body, timeout=60) for url in pair)  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": MODEL, "prompt": PROMPT}),
        ("/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False}),
        ("/tokenize", {"prompt": PROMPT, "add_special_tokens": True, "return_token_strs": True}),
        ("/tokenize", {"prompt": ""}),
        ("/tokenize", {"prompt": "a b", "not_a_field": 1}),  # unknown fields ignored
        ("/tokenize", {"model": MODEL, "messages": CHAT}),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True, "return_token_strs": True}),
        ("/tokenize", {"messages": PARTS}),
        ("/tokenize", {"messages": CHAT, "tools": TOOLS, "chat_template_kwargs": {"x": 1}}),
        ("/tokenize", {"messages": [{"role": "user"}]}),
        # specials kept, a broken UTF-8 sequence, an id past the vocab (dropped by both)
        ("/detokenize", {"model": MODEL, "tokens": [0, 1, 2, 3, 50, 100, 300, 10**6]}),
        ("/detokenize", {"tokens": []}),
    ],
)
def test_same_answer_as_vllm(pair: Pair, path: str, body: Any) -> None:
    ours, theirs = both(pair, path, body)
    assert theirs.status_code == 200, theirs.text
    assert ours.status_code == 200, ours.text
    assert ours.json() == theirs.json()


def test_the_flags_change_the_ids_and_detokenize_round_trips(pair: Pair) -> None:
    """The comparisons above compare answers that differ where they should."""
    plain = httpx.post(
        f"{pair.vllm}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}
    ).json()["tokens"]
    special = httpx.post(f"{pair.vllm}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert special[1:] == plain and special[0] not in plain  # BOS
    bare, prompted = (
        httpx.post(f"{pair.vllm}/tokenize", json={"messages": CHAT, **flag}).json()["tokens"]
        for flag in ({"add_generation_prompt": False}, {})
    )
    assert prompted[: len(bare)] == bare and len(prompted) > len(bare)
    ours, theirs = both(pair, "/detokenize", {"tokens": plain})
    assert ours.json() == theirs.json() == {"prompt": PROMPT}


def error_field(param: str | None) -> str | None:
    """vLLM's param is pydantic's location (`body.tokens.0`); ours names the field (`tokens`)."""
    if param is None or not param.startswith("body"):
        return param
    parts = param.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "x", "model": "nope"}),
        ("/detokenize", {"tokens": [1], "model": "nope"}),
        ("/tokenize", {"model": MODEL}),
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {"messages": []}),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}),
        ("/tokenize", [1, 2]),
        ("/detokenize", {"tokens": "abc"}),
        ("/detokenize", {}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": [2**33]}),  # past the tokenizer's u32
    ],
)
def test_bad_input_same_status_as_vllm(pair: Pair, path: str, body: Any) -> None:
    ours, theirs = both(pair, path, body)
    assert 400 <= theirs.status_code < 500, theirs.text
    assert ours.status_code == theirs.status_code, ours.text
    mine, vllm = ours.json()["error"], theirs.json()["error"]
    assert set(mine) == set(vllm) == {"message", "type", "param", "code"}
    assert all(isinstance(e["message"], str) and e["message"] for e in (mine, vllm))
    assert all(isinstance(e["type"], str) for e in (mine, vllm))
    if vllm["param"] is not None:
        assert mine["param"] == error_field(vllm["param"])
