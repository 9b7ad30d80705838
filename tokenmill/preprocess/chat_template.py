"""The chat template sandbox: a conversation rendered as the tokenizer's own template renders it.

Same sandbox, helpers and variables as transformers' `apply_chat_template`, without
importing transformers; templates are compiled once per process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from functools import cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.preprocess.tokenizer import TokenizerBundle

Render = Callable[[list[dict], bool], str]  # messages, add_generation_prompt -> rendered text

# Names a message's reasoning arrives under; templates read the first (or `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot plant dunders."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


# While `render_generation_spans` runs: (the pieces rendered so far, the spans found).
_TRACKING: tuple[list[str], list[tuple[int, int]]] | None = None


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the text a template marks as the model's
    own (what transformers' `return_assistant_tokens_mask` reads). The output is unchanged;
    while spans are tracked, each block's character span is recorded."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller: Any) -> str:
        text = caller()
        if _TRACKING is not None:
            pieces, spans = _TRACKING
            start = sum(len(p) for p in pieces)
            spans.append((start, start + len(text)))
        return text


@cache
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _template_messages(messages: list[dict]) -> list[dict]:
    """Copy messages as transformers hands them over: None values dropped, reasoning aliased."""
    out = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"messages[{k}]: expected a dict with role and content, got {message!r}"
            )
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[f] for f in _REASONING_FIELDS if f in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def has_generation_blocks(template: str | None) -> bool:
    return template is not None and re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def render_generation_spans(
    bundle: TokenizerBundle,
    messages: list[dict],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    **template_kwargs: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendering, and the character spans of its `{% generation %}` blocks."""
    global _TRACKING
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    context = _context(bundle, messages, add_generation_prompt, tools, template_kwargs)
    _TRACKING = (pieces, spans)
    try:
        for piece in _compile(bundle.chat_template or "").generate(**context):
            pieces.append(piece)
    finally:
        _TRACKING = None
    return "".join(pieces), spans


def render_text(
    bundle: TokenizerBundle,
    messages: list[dict],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    **template_kwargs: Any,
) -> str:
    """The conversation exactly as the tokenizer's own chat template renders it, with the
    tool schemas and keyword arguments (`enable_thinking`, ...) transformers would pass."""
    return _compile(bundle.chat_template or "").render(
        **_context(bundle, messages, add_generation_prompt, tools, template_kwargs)
    )


def _context(
    bundle: TokenizerBundle,
    messages: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    template_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The variables the template sees, as transformers passes them."""
    if bundle.chat_template is None:
        raise ValueError(
            f"{bundle.path}: no chat template (tokenizer_config.json 'chat_template' "
            "or chat_template.jinja)"
        )
    if not messages:
        raise ValueError("messages: a conversation needs at least one message")
    return {
        **dict(bundle.special_tokens),
        **template_kwargs,
        "messages": _template_messages(messages),
        "tools": tools or None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
