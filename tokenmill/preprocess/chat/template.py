"""The chat template sandbox: a conversation rendered as the tokenizer's own template renders it.

Same sandbox, helpers and variables as transformers' `apply_chat_template`, without
importing transformers; templates are compiled once per process, and the marker renderings
spans are read from are cached per process (`Renderer.probe`).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
import time
from collections.abc import Callable, Hashable
from datetime import datetime
from functools import cache, cached_property
from typing import Any, TypeVar, cast

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.preprocess.chat.tokenizer import TokenizerBundle

T = TypeVar("T")

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


# While `render_generation_spans` runs in a thread: (the pieces rendered so far, the spans
# found), that thread's own (a run renders on several threads at once).
_TRACKING = threading.local()


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
        tracking = getattr(_TRACKING, "spans", None)
        if tracking is not None:
            pieces, spans = tracking
            start = sum(len(p) for p in pieces)
            spans.append((start, start + len(text)))
        return text


# Budgets of one rendering: a template that loops or allocates without bound is a bad record
# (template_error), not a hung or crashed run.
RENDER_SECONDS = 10.0
RENDER_CHARS = 64_000_000


class TemplateBudget(jinja2.exceptions.TemplateError):
    """A rendering went past its time or size budget."""


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` checked before they build a value past the size budget
    (`'a' * 10**10` would allocate 10 GB before any other check could run)."""

    intercepted_binops = frozenset({"*", "**"})

    def getattr(self, obj: Any, attribute: str) -> Any:
        """`message.role`: a plain dict has no such attribute, so the sandbox's answer is the
        item, found here without raising and catching an AttributeError (a third of a
        rendering's time went to that)."""
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    if len(seq) * times > RENDER_CHARS:
                        raise TemplateBudget(
                            f"the template builds a value of {len(seq) * times:,} items, over "
                            f"the budget of {RENDER_CHARS:,}"
                        )
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > 8 * RENDER_CHARS:
                raise TemplateBudget(f"the template computes {left} ** {right}, over the budget")
        return super().call_binop(context, operator, left, right)


class _Watchdog:
    """One thread per process that stops a rendering past its deadline: it raises
    TemplateBudget in the rendering thread (an asynchronous exception, delivered between
    bytecodes), which a loop with no output would otherwise never give a chance to check.
    Each rendering thread has its own deadline (a run renders on several threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watched: dict[int, tuple[float, object]] = {}  # thread -> (deadline, token)
        self.fired: dict[int, object] = {}  # thread -> token of an exception maybe undelivered
        self.pid = os.getpid()
        threading.Thread(target=self._run, daemon=True, name="tokenmill-render-watchdog").start()

    def _run(self) -> None:
        while True:
            time.sleep(0.05)
            with self.lock:
                now = time.monotonic()
                for thread, (deadline, token) in list(self.watched.items()):
                    if now > deadline:
                        del self.watched[thread]
                        self.fired[thread] = token
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(thread), ctypes.py_object(TemplateBudget)
                        )

    def watch(self, seconds: float) -> object:
        token = object()
        with self.lock:
            self.watched[threading.get_ident()] = (time.monotonic() + seconds, token)
        return token

    def release(self, token: object) -> None:
        thread = threading.get_ident()
        with self.lock:
            if self.watched.get(thread, (0, None))[1] is token:
                del self.watched[thread]
            if self.fired.get(thread) is token:  # fired, maybe not yet delivered: take it back
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
                del self.fired[thread]


_WATCHDOG: _Watchdog | None = None
_WATCHDOG_LOCK = threading.Lock()


def _rendered(template: jinja2.Template, context: dict[str, Any], pieces: list[str]) -> str:
    """The template's output, piece by piece, within the time and size budgets."""
    global _WATCHDOG
    with _WATCHDOG_LOCK:  # one per process, whichever thread renders first
        if _WATCHDOG is None or _WATCHDOG.pid != os.getpid():  # a forked child has no thread
            _WATCHDOG = _Watchdog()
        watchdog = _WATCHDOG
    token = watchdog.watch(RENDER_SECONDS)
    size = 0
    try:
        for piece in template.generate(**context):
            size += len(piece)
            if size > RENDER_CHARS:
                raise TemplateBudget(f"the rendering passed {RENDER_CHARS:,} characters")
            pieces.append(piece)
    except TemplateBudget as err:
        if err.message is None:  # raised by the watchdog, which cannot say why
            raise TemplateBudget(f"the rendering took longer than {RENDER_SECONDS:g} s") from None
        raise
    finally:
        watchdog.release(token)
    return "".join(pieces)


@cache
def _compile(template: str) -> jinja2.Template:
    env = _BudgetedSandbox(
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
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    context = _context(bundle, messages, add_generation_prompt, tools, template_kwargs)
    _TRACKING.spans = (pieces, spans)
    try:
        text = _rendered(_compile(bundle.chat_template or ""), context, pieces)
    finally:
        _TRACKING.spans = None
    return text, spans


def render_text(
    bundle: TokenizerBundle,
    messages: list[dict],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    **template_kwargs: Any,
) -> str:
    """The conversation exactly as the tokenizer's own chat template renders it, with the
    tool schemas and keyword arguments (`enable_thinking`, ...) transformers would pass."""
    context = _context(bundle, messages, add_generation_prompt, tools, template_kwargs)
    return _rendered(_compile(bundle.chat_template or ""), context, [])


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


class Renderer:
    """Renders conversations in one context: the tokenizer's template, and the tool schemas and
    keyword arguments transformers would pass (`render_text`)."""

    def __init__(
        self,
        bundle: TokenizerBundle,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.bundle = bundle
        self.tools = tools
        self.template_kwargs = template_kwargs or {}

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return render_text(
            self.bundle, messages, add_generation_prompt, self.tools, **self.template_kwargs
        )

    def probe(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """A rendering of marker contents: the same for every conversation of the same roles and
        fields, so it is kept (bounded, per process) instead of rendered once per record."""
        try:
            key = ("probe", _frozen(messages), add_generation_prompt)
        except TypeError:  # not JSON-like data: render it
            return self(messages, add_generation_prompt)
        return self._memo(key, lambda: self(messages, add_generation_prompt))

    @staticmethod
    def shape(messages: list[dict]) -> Hashable | None:
        """The messages' roles and other fields, without their contents: what renderings of
        marker contents depend on. None for data that is not JSON-like."""
        try:
            return _frozen([{**m, "content": ""} for m in messages])
        except TypeError:
            return None

    def by_shape(self, shape: Hashable | None, what: Hashable, compute: Callable[[], T]) -> T:
        """What `compute` reads from renderings of marker contents for messages of this `shape`,
        kept like `probe`'s renderings (`what` names it and anything else it reads)."""
        return compute() if shape is None else self._memo((what, shape), compute)

    def _memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        if self._context_key is None:
            return compute()
        key = (self._context_key, key)
        value = _PROBES.get(key, _PROBES)
        if value is _PROBES:
            value = compute()
            with _PROBES_LOCK:  # chunks render on several threads
                if len(_PROBES) >= _PROBES_MAX:
                    del _PROBES[next(iter(_PROBES))]  # the oldest
                _PROBES[key] = value
        return cast(T, value)

    @cached_property
    def _context_key(self) -> Hashable | None:
        """What the template sees besides the messages; None where renderings cannot be kept
        (a template that reads the clock, tool schemas that are not JSON-like)."""
        template = self.bundle.chat_template or ""
        if "strftime_now" in template:
            return None
        try:
            frozen = (_frozen(self.tools), _frozen(self.template_kwargs))
        except TypeError:
            return None
        return (template, self.bundle.special_tokens, frozen)


_PROBES: dict[Hashable, Any] = {}  # renderings of marker contents, and what is read from them
_PROBES_LOCK = threading.Lock()
_PROBES_MAX = 4096


def _frozen(value: Any) -> Hashable:
    """A hashable copy of JSON-like data, equal only where a template renders alike: types and
    key order kept (1, 1.0 and True render differently; floats by repr, so 0.0 is not -0.0);
    TypeError for anything else."""
    kind = type(value)
    if kind is str:  # most of it: keys, roles, markers
        return value
    if kind is dict:
        items = tuple(value.items())
        for k, v in items:
            if type(k) is not str or type(v) is not str:
                return (dict, tuple((_frozen(k), _frozen(v)) for k, v in items))
        return (dict, items)  # strings only (a message): already its frozen form
    if kind is list or kind is tuple:
        return (kind, tuple(map(_frozen, value)))
    if kind is float:
        return (float, repr(value))
    if kind is int or kind is bool or value is None:
        return (kind, value)
    raise TypeError(f"{kind.__name__} is not JSON-like")
