"""Chat templates rendered as the serving engines render them: transformers' jinja environment,
vLLM's message normalisation and content-format detection (docs/block-keys.md)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.strict_json import BodyError, decode_object

ContentFormat = Literal["string", "openai"]
Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed on it: a client error."""


class _GenerationTag(Extension):
    """transformers' `{% generation %}` (an assistant-mask marker): its body, unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, **kwargs: Any) -> str:
    # transformers' override (indent, separators, sort_keys): jinja's own HTML-escapes
    return json.dumps(x, ensure_ascii=ensure_ascii, **kwargs)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template of `source`; identical sources share one compiled object."""
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e} (line {e.lineno})") from e


# --- content format: vLLM's `_detect_content_format`, on the template's AST ----------------------


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_var_or_elems(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`name` (or `name[key]` / `name.key`), possibly filtered, tested or sliced."""
    sliced = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    if sliced or isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if key is None:
        return _is_var(node, name)
    if isinstance(node, nodes.Getitem):
        arg = node.arg
        return _is_var(node.node, name) and isinstance(arg, nodes.Const) and arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned from it (`{% set m = messages[1:] %}`), transitively."""
    names = [name]
    for current in names:  # grows while it is walked
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if (
                isinstance(target, nodes.Name)
                and target.name not in names
                and _is_var_or_elems(assign.node, current)
            ):
                names.append(target.name)
    return names


def _loop_targets(root: nodes.Template, names: list[str], key: str | None) -> Iterator[str]:
    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(
            _is_var_or_elems(loop.iter, n, key) for n in names
        ):
            yield loop.target.name


@lru_cache(maxsize=64)
def detect_content_format(source: str) -> ContentFormat:
    """vLLM's: "openai" when the template loops over `message['content']`, else "string"."""
    root = _ENV.parse(source)
    message_vars = list(_loop_targets(root, _aliases(root, "messages"), None))
    content_loop = next(_loop_targets(root, message_vars, "content"), None)
    return "string" if content_loop is None else "openai"


# --- messages: vLLM's parse + postprocess of OpenAI chat messages --------------------------------


def _content_texts(content: Any, where: str) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string, a list of parts or null")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}.content[{j}]: unsupported content part {kind!r}")
    return texts


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """A deep copy whose `function.arguments` are dicts: what tool-use templates expect."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = copy.deepcopy(calls)
    for j, call in enumerate(out):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ValueError(f"{where}.tool_calls[{j}] must be an object with a 'function'")
        arguments = call["function"].get("arguments")
        if not arguments:
            call["function"]["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                call["function"]["arguments"] = decode_object(arguments.encode())
            except (BodyError, UnicodeEncodeError) as e:
                raise ValueError(f"{where}.tool_calls[{j}].function.arguments: {e}") from e
    return out


def normalise_messages(messages: Any, content_format: ContentFormat) -> list[dict[str, Any]]:
    """The conversation as vLLM hands it to the template (a copy; docs/block-keys.md)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of message objects")
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string")
        texts = _content_texts(message.get("content"), where)
        out: dict[str, Any] = {"role": role}
        if content_format == "string":
            out["content"] = "\n".join(texts)
        else:
            out["content"] = [{"type": "text", "text": t} for t in texts]
        if role == "assistant" and message.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(message["tool_calls"], where)
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)
    return conversation


class ChatTemplate:
    """One chat template, compiled once, with the special tokens it is rendered with."""

    __slots__ = ("content_format", "_template", "_special_tokens")

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        self._template = compile_template(source)
        self.content_format = detect_content_format(source)
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text, with the generation prompt unless told otherwise (`template_kwargs`:
        vLLM's `chat_template_kwargs`); ValueError on bad input (ChatTemplateError: the
        template's)."""
        conversation = normalise_messages(messages, self.content_format)
        if tools is not None and (
            not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError("tools must be a list of objects")
        context = {
            **self._special_tokens,
            **(template_kwargs or {}),
            "messages": conversation,
            "tools": None if tools is None else list(tools),
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except (jinja2.TemplateError, TypeError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"chat template failed on this conversation: {e}") from e
