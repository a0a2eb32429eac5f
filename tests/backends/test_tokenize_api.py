"""vLLM's `/tokenize` and `/detokenize` on an emulated worker (a real process on 127.0.0.1):
vLLM's request and response shapes, the ids the worker runs, OpenAI-shaped 4xx for bad input;
and `--write-tokenizer`, whose files AutoTokenizer loads to the worker's own ids. (Against a
real vLLM engine's answers: tests/backends/test_vllm_tokenize.py.)"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.tokenizer import ByteTokenizer
from tests import processes
from urc.processes import Child

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "emu"
TOK = ByteTokenizer()
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Grüße 🎉"}]


@pytest.fixture(scope="module")
def worker() -> Iterator[Child]:
    with processes.running_worker(
        "backends.emulated.server", "--model", MODEL, "--max-model-len", "4096"
    ) as w:
        yield w


def post(worker: Child, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{worker.url}{path}", json=body, timeout=10)


def test_tokenize_a_prompt_as_vllm_answers(worker: Child) -> None:
    text = "Hello <|eos|> wörld"
    got = post(worker, "/tokenize", {"model": MODEL, "prompt": text}).json()
    ids = TOK.encode(text)
    assert got == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
    asked = post(worker, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert asked["tokens"] == ids and asked["token_strs"] == TOK.token_strs(ids)
    assert len(asked["token_strs"]) == asked["count"]
    plain = post(worker, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == ids  # the byte tokenizer adds none either way


def test_tokenize_a_chat_as_the_completions_run_it(worker: Child) -> None:
    got = post(worker, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert got["tokens"] == TOK.encode_chat(CHAT) and got["count"] == len(got["tokens"])
    body = {"messages": CHAT, "add_generation_prompt": False}
    bare = post(worker, "/tokenize", body).json()["tokens"]
    assert bare == TOK.encode_chat(CHAT, add_generation_prompt=False)
    assert got["tokens"][: len(bare)] == bare and len(bare) < got["count"]
    completion = httpx.post(
        f"{worker.url}/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 1},
        timeout=10,
    ).json()
    assert completion["usage"]["prompt_tokens"] == got["count"]


def test_detokenize_round_trips(worker: Child) -> None:
    text = "Grüße <|im_start|>assistant\n🎉"
    ids = post(worker, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(worker, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": text}
    assert post(worker, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
        ("/tokenize", {"messages": "not a list"}, 400, "messages"),
        ("/tokenize", {"messages": [5]}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": []}, 400, "chat_template_kwargs"),
        ("/tokenize", [1, 2], 400, None),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
    ],
)
def test_bad_input_is_an_openai_error(
    worker: Child, path: str, body: Any, status: int, param: str | None
) -> None:
    response = post(worker, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error.get("param") == param


def test_written_tokenizer_gives_the_workers_ids(worker: Child, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "byte-tokenizer"
    done = subprocess.run(
        [sys.executable, "-m", "urc.cli", "worker", "--engine", "emulated"]
        + ["--write-tokenizer", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(directory)
    auto = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in ["Hello there", "Grüße aus München 🎉 <|im_end|>", " x\n\ty "]:
        served = post(worker, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
        assert auto(text)["input_ids"] == served["tokens"]
        assert auto.convert_ids_to_tokens(served["tokens"]) == served["token_strs"]
        assert auto.decode(served["tokens"]) == text
    served = post(worker, "/tokenize", {"messages": CHAT}).json()["tokens"]
    chat = auto.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert (chat["input_ids"] if hasattr(chat, "keys") else chat) == served
