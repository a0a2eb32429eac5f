"""The tokenizer layer: a real BPE tokenizer built here (nothing downloaded) and the byte one."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from core.chat_template import ChatTemplateError, detect_content_format
from core.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

SPECIALS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "Hello there, how are you today?",
    "You are a terse assistant. Answer in one word.",
    "The quick brown fox jumps over the lazy dog.",
    "system user assistant tools weather city",
    "Grüße aus München, ça va? 日本語も少し。",
] * 20

# Llama-3 style; indented block tags exercise lstrip_blocks, tags ending lines trim_blocks.
TEMPLATE = """{{ bos_token -}}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unsupported role: ' + message['role']) }}
    {% endif %}
    {% if message['content'] == '' %}
        {% continue %}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}
<|start_header_id|>system<|end_header_id|>

You are terse.<|eot_id|>
    {% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if tools is not none %}
<|start_header_id|>tools<|end_header_id|>

{{ tools | tojson(indent=2) }}<|eot_id|>
{% endif %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TOOL_TEMPLATE = "TOOLS {{ tools | tojson }}|{% for m in messages %}{{ m.content }}{% endfor %}"

MESSAGES = [
    {"role": "user", "content": "  Hello there "},
    {"role": "assistant", "content": ""},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "How are you today?"},
]
EXPECTED = (
    "<s><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\n"
    "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>\n"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHi!<|eot_id|>\n"
    "<|start_header_id|>user<|end_header_id|>\n\nHow are you today?<|eot_id|>\n"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


def _train(directory: Path, post_processor: bool = True) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if post_processor:
        bos = ("<s>", tok.token_to_id("<s>"))
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return tok


def _model_dir(tmp_path: Path, chat_template: Any = TEMPLATE, **config: Any) -> Path:
    directory = tmp_path / "model"
    _train(directory, post_processor=config.pop("post_processor", True))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "<|eot_id|>",
        "chat_template": chat_template,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFTokenizer:
    return HFTokenizer(model_dir)


def test_render_matches_hand_written_prompt(hf: HFTokenizer) -> None:
    assert hf.render_chat(MESSAGES) == EXPECTED


def test_chat_is_encoded_without_added_special_tokens(hf: HFTokenizer, model_dir: Path) -> None:
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = hf.encode_chat(MESSAGES)
    assert ids == raw.encode(EXPECTED, add_special_tokens=False).ids
    bos, eot = raw.token_to_id("<s>"), raw.token_to_id("<|eot_id|>")
    assert ids[0] == bos and ids[1] != bos  # the template's BOS, not a second one
    assert ids.count(eot) == 4  # special tokens in the text are single ids
    assert hf.decode(ids) == EXPECTED


def test_completion_encode_adds_bos_and_round_trips(hf: HFTokenizer) -> None:
    text = "Grüße aus München, 日本語 and the lazy dog!"
    ids = hf.encode(text)
    assert ids[0] == hf.encode("")[0] and len(hf.encode("")) == 1
    assert hf.decode(ids) == "<s>" + text
    assert hf.eos_token_id == hf.encode("<|eot_id|>")[1]
    assert hf.stop_token_ids == {hf.eos_token_id}
    assert max(ids) < hf.vocab_size <= 500
    assert hf.prompt_ids(text) == ids  # the gateway's view of a prompt


def test_list_of_text_parts_is_joined_with_newlines(hf: HFTokenizer) -> None:
    parts = [{"type": "text", "text": "Hello"}, "there", {"type": "text", "text": "you"}]
    as_parts = hf.render_chat([{"role": "user", "content": parts}])
    assert as_parts == hf.render_chat([{"role": "user", "content": "Hello\nthere\nyou"}])


def test_openai_content_format_keeps_parts_for_templates_that_loop_over_them(
    tmp_path: Path,
) -> None:
    looping = "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    assert detect_content_format(TEMPLATE) == "string"
    assert detect_content_format(looping) == "openai"
    hf = HFTokenizer(_model_dir(tmp_path, chat_template=looping))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert hf.render_chat([{"role": "user", "content": parts}]) == "ab"
    assert hf.render_chat([{"role": "user", "content": "plain"}]) == "plain"
    assert hf.render_chat([{"role": "assistant", "content": None}]) == ""


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        None,
        ["hello"],
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{"}}]}],
        [{"role": "tool", "content": "x"}],  # the template's raise_exception
    ],
)
def test_bad_messages_raise_value_error(hf: HFTokenizer, messages: Any) -> None:
    with pytest.raises(ValueError):
        hf.encode_chat(messages)


def test_raise_exception_message_reaches_the_caller(hf: HFTokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="Unsupported role: tool"):
        hf.render_chat([{"role": "tool", "content": "x"}])


def test_tools_use_tojson_and_template_list_picks_tool_use(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    templates = [
        {"name": "default", "template": TEMPLATE},
        {"name": "tool_use", "template": TOOL_TEMPLATE},
    ]
    hf = HFTokenizer(_model_dir(tmp_path, chat_template=templates))
    assert hf.render_chat(MESSAGES) == EXPECTED
    rendered = hf.render_chat([{"role": "user", "content": "hi"}], tools=tools)
    assert rendered == f"TOOLS {json.dumps(tools, ensure_ascii=False)}|hi"
    assert "météo" in rendered  # not \\u-escaped, unlike json.dumps' default


def test_tools_in_default_template_with_indent(hf: HFTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "weather"}}]
    rendered = hf.render_chat([{"role": "user", "content": "hi"}], tools=tools)
    assert json.dumps(tools, indent=2) + "<|eot_id|>\n" in rendered


def test_tool_call_arguments_become_dicts_without_touching_the_request(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.tool_calls %}"
        "{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}{% endfor %}"
        "{{ strftime_now('%Y') }}{% generation %}!{% endgeneration %}"
    )
    hf = HFTokenizer(_model_dir(tmp_path, chat_template=template))
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    year = str(datetime.datetime.now().year)
    assert hf.render_chat(messages) == '{"x": 1}' + year + "!"
    assert call["function"]["arguments"] == '{"x": 1}'


def test_add_bos_token_flag_rebuilds_the_post_processor(tmp_path: Path) -> None:
    with_flag = HFTokenizer(_model_dir(tmp_path / "a", post_processor=False, add_bos_token=True))
    bos = with_flag.encode("<s>")[-1]
    assert with_flag.encode("hello")[0] == bos
    without = HFTokenizer(_model_dir(tmp_path / "b", add_bos_token=False))
    assert bos not in without.encode("hello")
    assert with_flag.fingerprint != without.fingerprint


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path) -> None:
    directory = _model_dir(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert HFTokenizer(directory).render_chat([{"role": "user", "content": "x"}]) == "x"


def test_fingerprint_is_stable_and_tracks_the_template(tmp_path: Path, model_dir: Path) -> None:
    assert HFTokenizer(model_dir).fingerprint == HFTokenizer(model_dir).fingerprint
    other = HFTokenizer(_model_dir(tmp_path, chat_template=TEMPLATE.replace("terse", "kind")))
    assert other.fingerprint != HFTokenizer(model_dir).fingerprint
    assert ByteTokenizer().fingerprint == ByteTokenizer().fingerprint != other.fingerprint


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    hf = HFTokenizer(_model_dir(tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        hf.render_chat([{"role": "user", "content": "x"}])


def test_load_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(model_dir)), HFTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        load_tokenizer("gpt-17")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_byte_tokenizer_round_trips_text_and_special_tokens() -> None:
    tok = ByteTokenizer()
    text = "héllo, 日本 🙂"
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text)) == text
    marked = "<|im_start|>user\nx<|im_end|><|eos|><|bos|> <|not_special|>"
    ids = tok.encode(marked)
    assert ids == [258, *b"user\nx", 259, 257, 256, *b" <|not_special|>"]
    assert tok.decode(ids) == marked
    for prompt in (text, marked):  # the gateway's view: the same ids, bytes where it can
        assert list(tok.prompt_ids(prompt)) == tok.encode(prompt)
    assert isinstance(tok.prompt_ids(text), bytes)
    assert tok.decode([0xC3]) == "\ufffd"
    with pytest.raises(ValueError):
        tok.decode([260])
    assert tok.vocab_size == 260 and tok.eos_token_id == 257
    assert tok.stop_token_ids == {257, 259}


def test_byte_tokenizer_chat_is_chatml() -> None:
    tok = ByteTokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "x"}],
        },
    ]
    rendered = tok.render_chat(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhéllo\nx<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(rendered) and ids[0] == 258 and ids.count(259) == 2
    assert tok.decode(ids) == rendered
    with pytest.raises(ValueError):
        tok.encode_chat([{"role": "user"}, "oops"])


def test_matches_transformers_apply_chat_template(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ours = HFTokenizer(model_dir)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        text = reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours.render_chat(MESSAGES, **kwargs) == text
        ids = reference(text, add_special_tokens=False)["input_ids"]
        assert ours.encode_chat(MESSAGES, **kwargs) == ids
    assert ours.encode("hello there") == reference("hello there")["input_ids"]
