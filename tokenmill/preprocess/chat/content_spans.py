"""Spans from where each message's content sits in the one rendering of a conversation.

Contents are located through the template's own text around marker contents (exact), or
searched for where the template reshapes them (Qwen3's reasoning); message k's span runs from
the end of the previous content and its end-of-turn to the end of its own."""

from __future__ import annotations

import re
from itertools import pairwise

import numpy as np

from tokenmill.preprocess.chat.template import Renderer
from tokenmill.preprocess.chat.token_offsets import TokenOffsets
from tokenmill.preprocess.chat.tokenizer import TokenizerBundle

# Stands in for an empty content so its place in the rendering can be found.
_EMPTY_MARK = "\ue000{}\ue001"


def content_starts(
    render: Renderer,
    bundle: TokenizerBundle,
    messages: list[dict],
    actions: list[bool],
    text: str,
    prompt_start: int,
    offsets: TokenOffsets,
    add_generation_prompt: bool,
) -> list[int]:
    """Where each message's span starts, from where its content sits in the rendering: located
    through the template's own text around marker contents, or searched for."""
    shape = render.shape(messages)  # what the marker renderings below depend on, with these:
    prompt = add_generation_prompt
    trained = tuple(actions)
    glue = render.by_shape(
        shape, ("glue", prompt), lambda: _marker_glue(render, messages, add_generation_prompt)
    )
    located = _locate_by_glue(text, messages, glue) if glue else None
    if located is None:  # the template shapes its text around the content: search for it
        found = _locate_contents(text, messages, prompt_start, offsets.control)
        located = _place_empty_contents(render, messages, text, found, add_generation_prompt)
    tails = None
    if glue:
        tails = render.by_shape(
            shape, ("tails", prompt, trained), lambda: _role_tails(render, messages, actions, glue)
        )
    span_starts = _span_starts(text, located, prompt_start, offsets, tails)
    span_starts[0] = _first_header_start(text, messages, located, span_starts, offsets)
    if span_starts[0] == 0 and glue:
        header = render.by_shape(
            shape, ("first header", prompt), lambda: _first_header(render, messages, glue)
        )
        span_starts[0] = _first_header_at(header, glue, prompt_start, offsets)
    return span_starts


def _visible_forms(content: str) -> list[str]:
    """What a template may show of a content, most faithful first."""
    forms = [content, content.strip()]
    if "</think>" in content:  # Qwen3 keeps only the answer after the reasoning
        forms.append(content.split("</think>")[-1].lstrip("\n"))
    forms.append(content.lstrip("\n"))
    return list(dict.fromkeys(forms))


def _locate_contents(
    text: str, messages: list[dict], limit: int, control: tuple[np.ndarray, np.ndarray]
) -> list[tuple[int, int] | None]:
    """(start, end) of each message's content, searched forward; None for an empty one.

    Template words hold short contents ("e" is in `<|im_end|>` and in `user`), so an
    occurrence that cuts a control token is skipped, and one followed by a control
    token (`<|im_end|>`) is preferred; if preferring leaves a message unplaced, the
    first occurrences are used.
    """
    try:
        return _search_contents(text, messages, limit, control, prefer=True)
    except ValueError:
        return _search_contents(text, messages, limit, control, prefer=False)


def _search_contents(
    text: str,
    messages: list[dict],
    limit: int,
    control: tuple[np.ndarray, np.ndarray],
    prefer: bool,
) -> list[tuple[int, int] | None]:
    located: list[tuple[int, int] | None] = []
    cursor = 0
    for k, message in enumerate(messages):
        content = message.get("content") or ""  # None: a tool call with no text
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{k}] (role {message.get('role')!r}): content must be a string, "
                f"got {type(content).__name__}"
            )
        forms = _visible_forms(content)
        hit = None
        for form in filter(None, forms):
            start = _find(text, form, cursor, limit, control, prefer)
            if start >= 0:
                hit = (start, start + len(form))
                break
        if hit is None and all(forms):
            raise ValueError(
                f"messages[{k}] (role {message.get('role')!r}): content not found in the "
                "rendered template; the template rewrites it in a way tokenmill cannot follow"
            )
        located.append(hit)
        cursor = hit[1] if hit else cursor
    return located


def _find(
    text: str,
    form: str,
    cursor: int,
    limit: int,
    control: tuple[np.ndarray, np.ndarray],
    prefer: bool,
) -> int:
    """First occurrence of `form` from `cursor` that cuts no control token; -1 if none.

    With `prefer`, the first such occurrence that ends where a control token starts
    (or at `limit`) wins.
    """
    starts, ends = control
    first = -1
    at = text.find(form, cursor, limit)
    while at >= 0:
        end = at + len(form)
        i = int(np.searchsorted(starts, at, side="right")) - 1
        j = int(np.searchsorted(starts, end, side="right")) - 1
        cuts_start = i >= 0 and starts[i] < at < ends[i]
        cuts_end = j >= 0 and starts[j] < end < ends[j]
        if not (cuts_start or cuts_end):
            if not prefer or end == limit or (j >= 0 and starts[j] == end):
                return at
            first = at if first < 0 else first
        at = text.find(form, at + 1, limit)
    return first


def _place_empty_contents(
    render: Renderer,
    messages: list[dict],
    text: str,
    found: list[tuple[int, int] | None],
    add_generation_prompt: bool,
) -> list[tuple[int, int]]:
    """Give each empty content a zero-length place between its neighbours.

    Putting it at the end of the previous content would hand that message's
    end-of-turn to this one, so the place comes from a rendering with a marker in
    its stead; failing that, it is the end of the previous content.
    """
    pending = [k for k, hit in enumerate(found) if hit is None]
    marked = _marker_places(render, messages, text, pending, add_generation_prompt)
    placed: list[tuple[int, int]] = []
    for k, hit in enumerate(found):
        if hit is None:
            low = placed[-1][1] if placed else 0
            high = next((h[0] for h in found[k + 1 :] if h is not None), len(text))
            spot = marked[k] if low <= marked.get(k, -1) <= high else low
            hit = (spot, spot)
        placed.append(hit)
    return placed


def _marker_places(
    render: Renderer,
    messages: list[dict],
    text: str,
    pending: list[int],
    add_generation_prompt: bool,
) -> dict[int, int]:
    """Where the markers for `pending` contents sit in `text`; {} unless exact.

    Exact means removing the markers from the marked rendering gives back `text`
    (not so for a template that treats empty content specially).
    """
    if not pending:
        return {}
    marks = {k: _EMPTY_MARK.format(k) for k in pending}
    marked = [{**m, "content": marks[k]} if k in marks else m for k, m in enumerate(messages)]
    probe = render(marked, add_generation_prompt)
    places: dict[int, int] = {}
    parts, pos = [], 0
    for k in pending:
        at = probe.find(marks[k], pos)
        if at < 0:
            return {}
        parts.append(probe[pos:at])
        places[k] = at - sum(len(marks[j]) for j in places)
        pos = at + len(marks[k])
    return places if "".join(parts) + probe[pos:] == text else {}


def _span_starts(
    text: str,
    located: list[tuple[int, int]],
    limit: int,
    offsets: TokenOffsets,
    tails: list[str] | None = None,
) -> list[int]:
    """Where each message's span starts: after the previous content and its end-of-turn.

    The end-of-turn text is what follows the last content (before any generation
    prompt); between two contents, the part of the gap it shares is the end-of-turn,
    cut back to whole tokens (`<｜User｜>` and `<｜end▁of▁sentence｜>` share `<｜`).
    """
    last_tail = text[located[-1][1] : limit]
    ends, cuts = [], []  # each content's end, and where its end-of-turn ends
    for k, ((_, end), (next_start, _)) in enumerate(pairwise(located)):
        tail = tails[k] if tails is not None else last_tail
        ends.append(end)
        cuts.append(end + _shared_prefix(text[end:next_start], tail))
    token_starts = offsets.starts_at(cuts)
    return [0] + [
        max(end, token) if token >= 0 else cut for end, cut, token in zip(ends, cuts, token_starts)
    ]


def _shared_prefix(a: str, b: str) -> int:
    """Length of the common start of `a` and `b` (mostly all of `b`: a gap opens with the
    end-of-turn)."""
    if a.startswith(b):
        return len(b)
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    return shared


def _first_header_start(
    text: str,
    messages: list[dict],
    located: list[tuple[int, int]],
    starts: list[int],
    offsets: TokenOffsets,
) -> int:
    """Where message 0's header starts, so the preamble before it (a default system prompt) stays masked.

    The header is learned from a later message of the same role (the text between its span start
    and its content); when none exists, or the preamble does not end with it, the whole preamble
    belongs to message 0.
    """
    role = messages[0].get("role")
    content_start = located[0][0]
    for k in range(1, len(messages)):
        header = text[starts[k] : located[k][0]]
        if messages[k].get("role") == role and header and text[:content_start].endswith(header):
            at = content_start - len(header)
            token_start = offsets.start_at(at)
            return token_start if token_start >= 0 else at
    return 0


CONTENT_MARK = "\ue000{}\ue001"  # private-use characters: never template text


def _marker_glue(
    render: Renderer, messages: list[dict], add_generation_prompt: bool
) -> list[str] | None:
    """The template's own text around the contents: rendered once with a marker for each content.

    Returns n + 1 pieces (before content 0, between contents, after the last), or None when
    the template does not place every marker once and in order.
    """
    marks = [CONTENT_MARK.format(k) for k in range(len(messages))]
    try:
        probe = render.probe(
            [{**m, "content": marks[k]} for k, m in enumerate(messages)], add_generation_prompt
        )
    except Exception:  # a template may refuse marker content; the search path still works
        return None
    pieces = re.split("(\ue000\\d+\ue001)", probe)
    if pieces[1::2] != marks:
        return None
    return pieces[0::2]


def _locate_by_glue(
    text: str, messages: list[dict], glue: list[str]
) -> list[tuple[int, int]] | None:
    """Content spans by walking the real rendering: glue, a visible form of the content, glue, ...

    Exact whenever the template's text does not depend on the content (then nothing inside a
    default system prompt or a header can be mistaken for a message); None otherwise.
    """
    if not text.startswith(glue[0]):
        return None
    pos = len(glue[0])
    located = []
    for k, message in enumerate(messages):
        content = message.get("content")
        form = content if isinstance(content, str) else ""
        after = glue[k + 1]
        if not _shows(text, pos, form, after):  # most templates show the content as it is
            found = (f for f in _visible_forms(form)[1:] if _shows(text, pos, f, after))
            other = next(found, None)
            if other is None:
                return None
            form = other
        located.append((pos, pos + len(form)))
        pos += len(form) + len(glue[k + 1])
    return located if pos == len(text) else None


def _shows(text: str, pos: int, form: str, after: str) -> bool:
    """Whether `text` has `form` at `pos`, then `after`."""
    return text.startswith(form, pos) and text.startswith(after, pos + len(form))


def _first_header(render: Renderer, messages: list[dict], glue: list[str]) -> str:
    """Message 0's header, learned by rendering message 0 twice (its end-of-turn + header then sit
    between the two copies); "" when the template refuses that or the header is not found."""
    marks = [CONTENT_MARK.format(k) for k in range(len(messages) + 1)]
    doubled = [messages[0], *messages]
    try:
        probe = render.probe([{**m, "content": marks[k]} for k, m in enumerate(doubled)], False)
    except Exception:
        return ""
    pieces = re.split("(\ue000\\d+\ue001)", probe)
    if pieces[1::2] != marks:
        return ""
    between, tail = pieces[2], pieces[-1]
    header = between[_shared_prefix(between, tail) :]
    return header if glue[0].endswith(header) else ""


def _first_header_at(header: str, glue: list[str], limit: int, offsets: TokenOffsets) -> int:
    """Where message 0's header starts (the token holding its start); 0 where it is unknown."""
    if not header or len(glue[0]) > limit:
        return 0
    at = len(glue[0]) - len(header)
    token_start = offsets.start_at(at)
    return token_start if token_start >= 0 else at


def _role_tails(
    render: Renderer, messages: list[dict], actions: list[bool], glue: list[str]
) -> list[str] | None:
    """The end-of-turn text of each message's role, where it differs from the last message's.

    The text after the last content shows only the last role's end-of-turn (DeepSeek's user
    turn has none, its assistant turn ends with EOS). For a trained role other than the last
    one, render once more with a marker message of that role appended and read its tail.
    """
    last_role = messages[-1].get("role")
    tails = {last_role: glue[-1]}
    for message, trains in zip(messages[:-1], actions[:-1]):
        role = message.get("role")
        if not trains or role in tails:
            continue
        marks = [CONTENT_MARK.format(k) for k in range(len(messages) + 1)]
        probe_messages = [*messages, {"role": role, "content": ""}]
        try:
            probe = render.probe(
                [{**m, "content": marks[k]} for k, m in enumerate(probe_messages)], False
            )
        except Exception:  # the template refuses that shape: keep the last message's tail
            continue
        pieces = re.split("(\ue000\\d+\ue001)", probe)
        if pieces[1::2] == marks:
            tails[role] = pieces[-1]
    if len(tails) == 1:
        return None
    return [tails.get(m.get("role"), glue[-1]) for m in messages[:-1]]
