"""A tiny random-weight Llama checkpoint that real engines load as any Hugging Face directory
(config.json, model.safetensors, a byte-level BPE tokenizer.json trained here, a chat
template). Nothing is downloaded; the same arguments write the same files."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from core.text import VOCAB

BOS, EOS, START, END = "<|bos|>", "<|eos|>", "<|start|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, START, END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)


def corpus(variant: str, lines: int = 400) -> list[str]:
    """Deterministic English-like lines (common words, punctuation, digits); another `variant`
    spells every word backwards, so its merges differ."""
    rng = random.Random(f"urc-tiny-checkpoint/{variant}")
    # the load generator's vocabulary: the tokenizer is trained on the words it will see
    words = list(VOCAB) if variant == "default" else [w[::-1] for w in VOCAB]
    out = []
    for i in range(lines):
        line = " ".join(rng.choices(words, k=rng.randint(5, 20)))
        out.append(f"{line.capitalize()}, {i}! {rng.choice(words)}?")
    return out


def write_tokenizer(directory: Path, vocab_size: int, variant: str = "default") -> None:
    """tokenizer.json (byte-level BPE; BOS added to completions by its post-processor) and
    tokenizer_config.json (special tokens, chat template, the plain fast tokenizer class)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(variant), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "additional_special_tokens": [START, END],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_checkpoint(
    directory: str | Path, seed: int = 0, vocab_size: int = 512, variant: str = "default"
) -> Path:
    """A Llama with hidden 128, 4 heads of 32 (vLLM's CPU attention wants head size >= 32),
    2 layers, random weights from `seed`, in bfloat16; and its tokenizer."""
    import torch
    from safetensors.torch import save_file

    from backends.torch_worker.model import LlamaConfig, LlamaForCausalLM

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in LlamaForCausalLM(config).state_dict().items():
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape)
        else:
            value = 0.05 * torch.randn(param.shape, generator=gen)
        weights[name] = value.to(torch.bfloat16).contiguous()
    save_file(weights, str(root / "model.safetensors"))
    hf = config.to_hf()
    hf.update(torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    (root / "config.json").write_text(json.dumps(hf, indent=1))
    write_tokenizer(root, vocab_size, variant)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--variant", default="default", help="'default' or any other corpus")
    args = parser.parse_args(argv)
    print(write_checkpoint(args.directory, args.seed, args.vocab_size, args.variant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
