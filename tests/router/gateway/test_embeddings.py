"""`/v1/embeddings` end to end: workers and a gateway as real processes on 127.0.0.1, the
official `openai` client through the gateway; the emulated worker's deterministic vectors, the
torch worker's mean-pooled hidden states against the textbook forward pass, OpenAI's four
shapes of `input`, bad input a 400 naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest

from backends.emulated.embedding import EMBEDDING_SIZE
from tests.gateway import all_exact, assert_400s, gateway_fleet, route
from tests.gateway import openai_client as client
from tests.processes import running_worker, wait_for
from urc.processes import Child, start_gateway

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, list[Child]]]:
    with gateway_fleet(2, "--admin-key", "admin-secret") as running:
        yield running


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


def test_the_openai_client_through_the_gateway(fleet) -> None:
    url, _ = fleet
    c = client(url)  # asks for base64 unless told otherwise
    one = c.embeddings.create(model="emulated", input="the river runs to the sea")
    assert len(one.data) == 1 and len(one.data[0].embedding) == EMBEDDING_SIZE
    assert abs(norm(one.data[0].embedding) - 1) < 1e-5
    assert one.usage.prompt_tokens == len("the river runs to the sea")  # the byte tokenizer
    texts = ["the river runs to the sea", "the river runs to the ocean", "zzzz qqqq"]
    many = c.embeddings.create(model="emulated", input=texts, encoding_format="float")
    vectors = [d.embedding for d in many.data]
    assert [d.index for d in many.data] == [0, 1, 2]
    assert vectors[0] == pytest.approx(one.data[0].embedding, abs=1e-6)  # deterministic
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])  # shared tokens
    assert many.usage.prompt_tokens == sum(len(t) for t in texts)
    ids = list(b"the river runs to the sea")
    by_ids = c.embeddings.create(model="emulated", input=ids, encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)
    lists = c.embeddings.create(model="emulated", input=[ids, [1, 2, 3]], encoding_format="float")
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == len(ids) + 3


def test_the_gateway_picks_the_least_loaded_worker(fleet) -> None:
    url, _ = fleet
    body = {"model": "emulated", "input": "hello"}
    answer = httpx.post(f"{url}/v1/embeddings", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    r = route(answer)
    assert r["reason"] == "least_load" and r["matched_tokens"] == "0"
    assert r["prompt_tokens"] == "5"


BAD = [
    ({"input": "hi"}, "model"),
    ({"model": "emulated"}, "input"),
    ({"model": "emulated", "input": ""}, "input"),
    ({"model": "emulated", "input": []}, "input"),
    ({"model": "emulated", "input": [[]]}, "input"),
    ({"model": "emulated", "input": ["a", ""]}, "input"),
    ({"model": "emulated", "input": [1, "a"]}, "input"),
    ({"model": "emulated", "input": [-1]}, "input"),
    ({"model": "emulated", "input": {"text": "a"}}, "input"),
    ({"model": "emulated", "input": ["a"] * 2049}, "input"),
    ({"model": "emulated", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "emulated", "input": "a", "dimensions": 3}, "dimensions"),
]


@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_bad_input_is_a_400_naming_the_field(fleet, target: str) -> None:
    url, workers = fleet
    base = url if target == "gateway" else workers[0].url
    assert_400s(base, "/v1/embeddings", BAD, target == "worker")
    unknown = httpx.post(f"{base}/v1/embeddings", json={"model": "x", "input": "a"}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_the_torch_worker_embeds_with_its_model() -> None:
    """Mean-pooled last hidden states, normalised: as the textbook forward pass computes them."""
    torch = pytest.importorskip("torch")
    from backends.torch_worker.loader import load_model
    from tests.backends.test_engine_models import dense_hidden

    module = "backends.torch_worker.server"
    with running_worker(module, "--threads", "1", "--model", "tiny", "--num-pages", "64") as w:
        gateway = start_gateway([w.url], "--admin-key", "admin-secret")
        try:
            assert wait_for(lambda: all_exact(gateway.url, 1), 20)
            texts = ["a short one", "a somewhat longer text, longer than one page of KV"]
            out = client(gateway.url).embeddings.create(model="tiny", input=texts)
        finally:
            gateway.stop()
    model = load_model("tiny", device=torch.device("cpu")).model
    for text, got in zip(texts, out.data, strict=True):
        pooled = dense_hidden(model, list(text.encode())).float().mean(dim=0)
        expected = torch.nn.functional.normalize(pooled, dim=0)
        assert torch.allclose(torch.tensor(got.embedding), expected, atol=1e-4), text
    assert out.usage.prompt_tokens == sum(len(t) for t in texts)
