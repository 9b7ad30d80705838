"""The chat template sandbox: a conversation rendered as the tokenizer's own template renders it.

Same sandbox, helpers and variables as transformers' `apply_chat_template`, without
importing transformers; templates are compiled once per process, and the marker renderings
spans are read from are cached per process (`Renderer.probe`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from datetime import datetime
from functools import cache, cached_property
from typing import Any, TypeVar, cast

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.utils
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


# Budgets: a template that loops, computes or allocates without bound is a bad record
# (template_error), not a hung or crashed run. Sizes are checked before a value is built
# (`'a' * 10**10` would allocate 10 GB before any later check could run); time is watched by
# a thread. The time budget is one record's, all its renderings together (`record_budget`);
# a rendering stopped by a budget is remembered, so the record's other passes fail at once.
RENDER_SECONDS = 10.0  # one record's renderings, together
RENDER_CHARS = 64_000_000  # a rendering's output, and any one value a template builds
RENDER_SPEND = 4 * RENDER_CHARS  # every value one rendering builds, together
INT_BITS = 1 << 16  # an integer a template computes (chat templates need small ones)
RUN_SECONDS = 300.0  # renderings stopped by a budget, in all, per process and run


class TemplateBudget(jinja2.exceptions.TemplateError):
    """A rendering went past its time or size budget: the record is a template_error."""


class TemplateRunBudget(ValueError):
    """Renderings stopped by their budgets took longer than the run allows (RUN_SECONDS): the
    template is too slow or hostile for the data, and the run stops instead of spending
    RENDER_SECONDS on every record."""


_DICT_ATTRIBUTES = frozenset(dir(dict))
_SPENT = threading.local()  # the rendering's `spent` items; the record's `deadline`


def _spend(items: int, what: str) -> None:
    """Counts a value of `items` (about bytes: a character, a list's pointer is 8) the
    template is about to build."""
    if items > RENDER_CHARS:
        raise TemplateBudget(
            f"{what} would build a value of {items:,} items, over the budget of {RENDER_CHARS:,}"
        )
    spent = getattr(_SPENT, "spent", 0) + items
    _SPENT.spent = spent
    if spent > RENDER_SPEND:
        raise TemplateBudget(
            f"the rendering built {spent:,} items in all ({what} last), over the budget of "
            f"{RENDER_SPEND:,}"
        )


def _size(value: Any) -> int:
    """About how many characters `value` takes as text (or items, for a container), shared
    parts counted each time they appear (as text repeats them); stops counting past the
    budget, and a long container measured by its first items, so its own cost is bounded."""
    total, stack, limit = 0, [value], RENDER_CHARS
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, (dict, list, tuple, set, frozenset)):
            total += 2 + 4 * len(item)
            items = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            if len(items) > _SAMPLE:  # a long one: its first items, as many times as it has
                total += _size(list(itertools.islice(items, _SAMPLE))) * (len(items) // _SAMPLE)
            else:
                stack.extend(items)
        else:
            total += 24
    return total


_SAMPLE = 1024


def _check_int(value: Any, what: str) -> None:
    if isinstance(value, int) and value.bit_length() > INT_BITS:
        raise TemplateBudget(
            f"{what} computes an integer of {value.bit_length():,} bits, over "
            f"the budget of {INT_BITS:,}"
        )


def _format_size(fmt: str, args: Any, kwargs: Any = None) -> int:
    """What `fmt % args` or `fmt.format(*args)` can build, at most: the format, its arguments
    as text, and every width or precision it names (a `*` or a nested field takes it from an
    argument, so then the integer arguments count too)."""
    values = (
        list(args.values())
        if isinstance(args, dict)
        else (list(args) if isinstance(args, (list, tuple)) else [args])
    )
    values += list((kwargs or {}).values())
    widths = sum(int(w) for w in re.findall(r"\d+", fmt))
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):
        widths += sum(abs(v) for v in values if isinstance(v, int))
    return len(fmt) + widths + sum(_size(v) for v in values)


def _binop_size(operator: str, left: Any, right: Any) -> None:
    """Refuses an operation whose result would be over a budget, before it is computed."""
    what = f"'{operator}'"
    if operator == "+" and type(left) is type(right) and isinstance(left, (str, list, tuple)):
        _spend((len(left) + len(right)) * _item_bytes(left), what)
    elif operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                _spend(len(seq) * max(times, 0) * _item_bytes(seq), what)
        if isinstance(left, int) and isinstance(right, int):
            _check_int(1 << (left.bit_length() + right.bit_length()), what)
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1 and (abs(left).bit_length() - 1) * right > INT_BITS:
            raise TemplateBudget(
                f"{left} ** {right} computes an integer of at least "
                f"{(abs(left).bit_length() - 1) * right:,} bits, over the budget of {INT_BITS:,}"
            )
    elif operator == "%" and isinstance(left, str):
        _spend(_format_size(left, right), what)


def _item_bytes(seq: Any) -> int:
    """A list's item is a pointer (8 bytes); a character of text about one byte."""
    return 1 if isinstance(seq, str) else 8


def _materialized(value: Any) -> Any:
    """An iterator (a filter's generator) as a list, so that it can be measured and still used."""
    if isinstance(value, (str, list, tuple, dict, set, frozenset)) or not hasattr(
        value, "__iter__"
    ):
        return value
    return list(value)


def _text_len(value: Any) -> int:
    return len(value) if isinstance(value, str) else _size(value)


def _width(width: Any) -> int:
    return len(width) if isinstance(width, str) else max(int(width), 0)


# What a filter or str method can build, from its arguments, before it runs (the first argument
# is the value filtered, or the string whose method it is).
_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda s, width=80, *_: max(_text_len(s), _width(width)),
    "ljust": lambda s, width, *_: max(len(s), _width(width)),
    "rjust": lambda s, width, *_: max(len(s), _width(width)),
    "zfill": lambda s, width: max(len(s), _width(width)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * _width(tabsize),
    "indent": lambda s, width=4, *_, **__: _text_len(s) + (str(s).count("\n") + 1) * _width(width),
    "wordwrap": lambda s, width=79, b=True, wrapstring=None, *_, **kw: (
        _text_len(s) * (8 + len(wrapstring or kw.get("wrapstring") or "\n"))
    ),
    "format": lambda s, *args, **kwargs: _format_size(str(s), args, kwargs),
    "join": lambda d, sep="", *_, **kw: (
        _size(d) + len(d) * len(str(kw.get("d", sep))) if hasattr(d, "__len__") else 0
    ),
    "replace": lambda s, old, new, count=None, *_: (
        _text_len(s)
        + (_text_len(s) + 1 if str(old) == "" else _text_len(s) // len(str(old))) * len(str(new))
        if count is None or count < 0
        else _text_len(s) + count * len(str(new))
    ),
    "batch": lambda v, linecount, fill_with=None: _size(v) + max(int(linecount), 0),
    "slice": lambda v, slices, fill_with=None: _size(v) + 2 * max(int(slices), 0),
    "tojson": lambda v, *args, **kwargs: _size(v) * _json_spread(*args, **kwargs),
    "pprint": lambda v, *_: _size(v),
    "string": lambda v: _size(v),
    "list": lambda v: _size(v),
    "sum": lambda v, attribute=None, start=0: _size(v) if not isinstance(start, int) else 0,
}
_MEASURED_FIRST = {"join", "sum", "list"}  # their value may be an iterator: made a list first


def _json_spread(ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> int:
    """How many times its data's size JSON text can take: indent and separators repeat on every
    item (an indent is refused past 64: `tojson(indent=10**9)` builds a gigabyte a line)."""
    if indent is not None and _width(indent) > 64:
        raise TemplateBudget(f"tojson: an indent of {_width(indent):,}, over the budget of 64")
    seps = sum(len(s) for s in separators) if separators else 2
    return 2 + seps + (_width(indent) if indent is not None else 0)


def _budgeted_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """The filter, refused before it runs when what it would build is over the budget."""
    extra = 0 if jinja2.utils._PassArg.from_obj(func) is None else 1  # context/environment first
    size = _SIZES[name]

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if name in _MEASURED_FIRST and len(args) > extra:
            args = (*args[:extra], _materialized(args[extra]), *args[extra + 1 :])
        _spend(size(*args[extra:], **kwargs), f"the filter {name}")
        return func(*args, **kwargs)

    return checked


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    _spend(max_words(n, max), "lipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def max_words(paragraphs: Any, words: Any) -> int:
    return 16 * _width(paragraphs) * _width(words)


def _finalized(value: Any) -> Any:
    """A `{{ value }}` that is not text: measured before it is made text (`{{ [s] * 1000 }}`
    is small as a list, a thousand times s as text)."""
    if not isinstance(value, str):
        _spend(_size(value), "the output")
    return value


class _BudgetedCodeGenerator(jinja2.compiler.CodeGenerator):
    """`a ~ b` as `environment.concat_checked(...)`: measured before it is joined."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with every operation that can build a large value measured first: `+`, `*`,
    `**`, `%`, `~`, the filters and str methods that grow text (`_SIZES`), and the output."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BudgetedCodeGenerator

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
        _binop_size(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def concat_checked(self, values: tuple) -> str:
        _spend(sum(_text_len(v) for v in values), "'~'")
        return "".join(map(str, values))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name in _SIZES and name != "format":
            if name == "join" and args:
                args = (_materialized(args[0]), *args[1:])
                _spend(_size(args[0]) + len(args[0]) * len(owner), "str.join")
            else:
                _spend(_SIZES[name](owner, *args, **kwargs), f"str.{name}")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _spend(_format_size(fmt, args, kwargs), "str.format")
            return wrapped(*args, **kwargs)

        return checked


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
    if _RUN["seconds"] > RUN_SECONDS:
        raise _run_budget_error()
    key = _failure_key(template, context) if _FAILED else None
    if key is not None and key in _FAILED:  # the record's earlier pass went past a budget
        raise TemplateBudget(_FAILED[key])
    start = time.monotonic()
    deadline = getattr(_SPENT, "deadline", None)
    seconds = RENDER_SECONDS if deadline is None else max(deadline - start, 0.0)
    token = watchdog.watch(seconds)
    _SPENT.spent = 0
    size = 0
    try:
        try:
            for piece in template.generate(**context):
                size += len(piece)
                if size > RENDER_CHARS:
                    raise TemplateBudget(f"the rendering passed {RENDER_CHARS:,} characters")
                pieces.append(piece)
        finally:
            watchdog.release(token)
    except (TemplateBudget, MemoryError) as err:
        if isinstance(err, MemoryError):
            message = "the rendering ran out of memory"
        elif err.message is None:  # raised by the watchdog, which cannot say why
            message = f"the record's renderings took longer than {RENDER_SECONDS:g} s"
        else:
            message = err.message
        _over_budget(template, context, key, message, time.monotonic() - start)
        raise TemplateBudget(message) from None
    return "".join(pieces)


@contextlib.contextmanager
def record_budget() -> Iterator[None]:
    """One record's renderings share one time budget (RENDER_SECONDS), however many its
    passes make (prerendered, probes, truncation)."""
    outer = getattr(_SPENT, "deadline", None)
    if outer is None:
        _SPENT.deadline = time.monotonic() + RENDER_SECONDS
    try:
        yield
    finally:
        _SPENT.deadline = outer


def start_run() -> None:
    """A run starts: its budget of renderings stopped by their budgets (RUN_SECONDS) is whole."""
    with _FAILED_LOCK:
        _RUN["seconds"], _RUN["renderings"] = 0.0, 0
        _FAILED.clear()


_RUN = {"seconds": 0.0, "renderings": 0}  # this process's renderings stopped by a budget
_FAILED: dict[Hashable, str] = {}  # (template, context) -> why it went past a budget
_FAILED_LOCK = threading.Lock()
_FAILED_MAX = 1024


def _failure_key(template: jinja2.Template, context: dict[str, Any]) -> Hashable | None:
    try:
        return (template, _frozen(context))
    except TypeError:
        return None


def _over_budget(
    template: jinja2.Template, context: dict[str, Any], key: Hashable | None, why: str, took: float
) -> None:
    """A rendering went past a budget: remembered (its record's other passes fail at once) and
    counted against the run's budget."""
    key = key if key is not None else _failure_key(template, context)
    with _FAILED_LOCK:
        if key is not None:
            if len(_FAILED) >= _FAILED_MAX:
                del _FAILED[next(iter(_FAILED))]
            _FAILED[key] = why
        _RUN["seconds"] += took
        _RUN["renderings"] += 1
    if _RUN["seconds"] > RUN_SECONDS:
        raise _run_budget_error()


def _run_budget_error() -> TemplateRunBudget:
    return TemplateRunBudget(
        f"the chat template went past its budget on {_RUN['renderings']:,} renderings, "
        f"{_RUN['seconds']:,.0f} s in all (over the run's budget of {RUN_SECONDS:g} s): it is "
        "too slow or hostile for this data; fix the template or the records"
    )


@cache
def _compile(template: str) -> jinja2.Template:
    env = _BudgetedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks],
        finalize=_finalized,
    )
    env.filters["tojson"] = _tojson
    for name in _SIZES.keys() & env.filters.keys():
        env.filters[name] = _budgeted_filter(name, env.filters[name])
    env.globals["lipsum"] = _lipsum
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
