"""The torch engine's models: Hugging Face directories written here (config.json, safetensors,
a BPE tokenizer.json trained here) load for real; the paged forward agrees with a dense
reference written independently; fingerprints group exactly the KV-identical models.

`write_model` is shared with the other engine tests."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from backends.torch_worker.engine import EngineConfig, TorchEngine
from backends.torch_worker.loader import LoadedModel, load_model, on_kv_path
from backends.torch_worker.model import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    apply_rope,
    inv_frequencies,
)
from backends.torch_worker.request import SamplingParams

torch.set_num_threads(2)
CPU = torch.device("cpu")
SMALL = LlamaConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
    rope_scaling=json.dumps(
        {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        sort_keys=True,
    ),
    max_position_embeddings=2048,
)
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello there, how are you?"] * 10
TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def random_weights(config: LlamaConfig, seed: int, std: float = 0.1) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under Hugging Face's names."""
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            out[name] = std * torch.randn(param.shape, generator=gen)
    return out


def write_model(
    directory: Path,
    config: LlamaConfig = SMALL,
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A Hugging Face model directory: config.json, model.safetensors, tokenizer.json (a byte
    BPE trained here, with its chat template and EOS)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf()))
    save_file(weights or random_weights(config, seed), str(directory / "model.safetensors"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size - 8,
        special_tokens=["<|end|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"eos_token": "<|end|>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def dense_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position by the textbook computation (`dense_hidden`)."""
    with torch.no_grad():
        return model.lm_head(dense_hidden(model, ids)).float()


def dense_hidden(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """The last hidden state of every position (after the final norm) by the textbook
    computation: one causal attention over the whole sequence, K/V repeated for GQA, no pages."""
    cfg = model.config
    m = model.model
    with torch.no_grad():
        h = m.embed_tokens(torch.tensor(ids))
        cos, sin = model.cos_sin(torch.arange(len(ids)), h.dtype)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        for layer in m.layers:
            x = layer.input_layernorm(h)
            att = layer.self_attn
            q = apply_rope(att.q_proj(x).view(len(ids), -1, cfg.head_dim), cos, sin)
            k = apply_rope(att.k_proj(x).view(len(ids), -1, cfg.head_dim), cos, sin)
            v = att.v_proj(x).view(len(ids), -1, cfg.head_dim)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
            mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
            probs = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            o = torch.einsum("hqk,khd->qhd", probs, v).reshape(len(ids), -1)
            h = h + att.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.norm(h)


def generate(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, **engine: object):
    eng = TorchEngine({"m": loaded}, EngineConfig(num_pages=64, record_logits=True, **engine))
    reqs = []
    for prompt in prompts:
        req = eng.new_request("m", prompt, SamplingParams(max_tokens, ignore_eos=True))
        eng.submit(req)
        reqs.append(req)
    while eng.has_work():
        eng.step()
        eng.check()
    return reqs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("hf") / "small")


def test_a_checkpoint_loads_with_its_tokenizer_and_matches_the_dense_reference(
    model_dir: Path,
) -> None:
    loaded = load_model(str(model_dir), device=CPU)
    assert loaded.config == SMALL and loaded.tokenizer_spec == str(model_dir.resolve())
    state = loaded.model.state_dict()
    for name, tensor in random_weights(SMALL, 0).items():
        assert torch.equal(state[name], tensor), name
    prompts = [loaded.tokenizer.encode(text) for text in ("The quick brown fox", "Hello " * 30)]
    reqs = generate(loaded, prompts, max_tokens=12)
    for req in reqs:
        assert req.logits is not None and len(req.output) == 12
        dense = dense_logits(loaded.model, req.tokens[:-1])
        start = len(req.prompt) - 1
        for i, row in enumerate(req.logits):
            assert torch.allclose(row, dense[start + i], atol=1e-4), (i, req.rid)
        assert req.output == [int(dense[start + i].argmax()) for i in range(12)]


def test_the_tiny_preset_is_the_same_model_everywhere() -> None:
    a = load_model("tiny", device=CPU)
    b = load_model("tiny", device=CPU)
    assert a.fingerprint == b.fingerprint and a.tokenizer_spec == "byte"
    assert a.config == PRESETS["tiny"]
    assert all(
        torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )
    assert load_model("tiny", device=CPU, seed=1).kv_group != a.kv_group


def test_fingerprints_group_exactly_the_kv_identical_models(
    model_dir: Path, tmp_path: Path
) -> None:
    base = load_model(str(model_dir), device=CPU)
    copy = shutil.copytree(model_dir, tmp_path / "copy")  # another path, the same files
    assert load_model(str(copy), device=CPU).kv_group == base.kv_group

    weights = random_weights(SMALL, 0)
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1.0  # not on the KV path
    head = write_model(tmp_path / "head", weights=weights)
    assert load_model(str(head), device=CPU).kv_group == base.kv_group

    weights = random_weights(SMALL, 0)
    weights["model.layers.1.self_attn.k_proj.weight"] += 1e-3  # on it
    other = write_model(tmp_path / "other", weights=weights)
    assert load_model(str(other), device=CPU).kv_group != base.kv_group
    assert load_model(str(model_dir), device=CPU, dtype="bfloat16").kv_group != base.kv_group
    assert load_model(str(model_dir), device=CPU, page_size=8).kv_group != base.kv_group


def test_which_tensors_are_on_the_kv_path() -> None:
    assert on_kv_path("model.embed_tokens.weight", 2)
    assert on_kv_path("model.layers.0.mlp.down_proj.weight", 2)
    assert on_kv_path("model.layers.1.self_attn.v_proj.weight", 2)
    assert not on_kv_path("model.layers.1.self_attn.q_proj.weight", 2)
    assert not on_kv_path("model.layers.1.mlp.up_proj.weight", 2)
    assert not on_kv_path("model.norm.weight", 2) and not on_kv_path("lm_head.weight", 2)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies() -> None:
    scaling = json.loads(SMALL.rope_scaling or "{}")
    plain = inv_frequencies(16, 10_000.0, None)
    scaled = inv_frequencies(16, 10_000.0, scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < 64 / 4  # shorter than original / high_freq_factor: untouched
    low = wavelen > 64 / 1  # longer than original / low_freq_factor: divided by the factor
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8)
    with pytest.raises(ValueError):
        inv_frequencies(16, 10_000.0, {"rope_type": "yarn", "factor": 2.0})


def test_bad_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_model(str(tmp_path), device=CPU)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_hf()))
    shutil.copy(write_model(tmp_path / "t") / "tokenizer.json", tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(tmp_path), device=CPU)
    assert load_model(str(tmp_path), device=CPU, load_format="dummy").config == SMALL
