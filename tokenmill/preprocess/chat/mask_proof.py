"""The mask proof: every message's own text found in the one real rendering, inside its own span,
and trained exactly as its action says.

Span finders read the template through probe renderings (marker contents, prefixes), which a
template that looks at contents can render differently from the real conversation. The proof
reads only the real rendering: what a message says (its content, its reasoning, each tool call's
name and string arguments) must lie in the span given to it, in its trained part where it trains;
otherwise the record is refused by name (`mask_unproven`), never written with a guessed mask.
What a message says and the rendering does not show at all was dropped by the template
(`content_dropped`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tokenmill.preprocess.chat.token_offsets import TokenOffsets

# Names a message's reasoning arrives under (as chat/template.py hands them to templates).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class MaskUnproven(ValueError):
    """A message's text lies outside its span, or its tokens are not trained as its role says."""

    reason = "mask_unproven"


class ContentDropped(ValueError):
    """A message's content, reasoning or tool call does not appear in the rendering at all."""

    reason = "content_dropped"


Item = tuple[str, list[str]]  # (what it is, for errors; the forms a template may show it in)


def message_items(message: dict) -> list[Item]:
    """What of a message must show in its rendering, in the order templates write it: its
    reasoning (a field, or `<think>...</think>` in the content), its content (the answer
    after the reasoning), each tool call's name, then its string arguments."""
    items: list[Item] = []
    content = message.get("content")
    content = content if isinstance(content, str) else ""
    reasoning = next((message[f] for f in REASONING_FIELDS if message.get(f) is not None), None)
    if "</think>" in content and reasoning is None:
        head = content.split("</think>", 1)[0]
        content = content.split("</think>")[-1]
        reasoning = head.split("<think>")[-1]
    if isinstance(reasoning, str) and reasoning.strip():
        items.append(("reasoning", _forms(reasoning)))
    if content.strip():
        items.append(("content", _forms(content)))
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function", call) if isinstance(call, dict) else {}
        function = function if isinstance(function, dict) else {}
        name = function.get("name")
        if isinstance(name, str) and name:
            items.append((f"tool_calls[{j}].name", [name]))
        for key, value in _arguments(function.get("arguments")):
            items.append((f"tool_calls[{j}].arguments.{key}", [key]))
            if isinstance(value, str) and value.strip():
                items.append((f"tool_calls[{j}].arguments.{key}", _forms(value, escaped=True)))
    return items


def _arguments(arguments: Any) -> list[tuple[str, Any]]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return []
    if not isinstance(arguments, dict):
        return []
    return [(key, value) for key, value in arguments.items() if isinstance(key, str)]


def _forms(text: str, escaped: bool = False) -> list[str]:
    """A text as templates show it: as given, trimmed, and (for tool arguments) JSON-escaped."""
    forms = [text, text.strip(), text.strip("\n"), text.lstrip("\n")]
    if escaped:  # written into JSON once or twice (a JSON string passed through tojson)
        for once in (json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]):
            forms += [once, json.dumps(once, ensure_ascii=False)[1:-1]]
    return list(dict.fromkeys(f for f in forms if f))


def find_item(text: str, forms: list[str], start: int, end: int) -> tuple[int, int] | None:
    """(start, end) of the first form found in text[start:end]; None if none is there."""
    for form in forms:
        at = text.find(form, start, end)
        if at >= 0:
            return at, at + len(form)
    return None


def dropped(
    text: str, messages: list[dict], items: list[list[Item]], tools: list[dict] | None
) -> None:
    """Raise ContentDropped for the first message item (`items[k]`: message k's) or tool
    schema the rendering lacks."""
    for k, message in enumerate(messages):
        for what, forms in items[k]:
            if find_item(text, forms, 0, len(text)) is None:
                raise ContentDropped(
                    f"messages[{k}] (role {message.get('role')!r}): its {what} does not appear "
                    "in the rendering: the chat template drops it"
                )
    holders: dict[str, list[tuple[int, str, list[str]]]] = {}  # a text several messages hold
    for k, message_items_k in enumerate(items):
        for what, forms in message_items_k:
            holders.setdefault(forms[0], []).append((k, what, forms))
    for text_held, held in holders.items():
        shown = max((text.count(form) for form in held[0][2]), default=0)
        if len(held) > 1 and shown < len(held):
            who = ", ".join(f"messages[{k}] ({what})" for k, what, _ in held)
            raise ContentDropped(
                f"{who}: {text_held[:40]!r} shows {shown} time(s) in the rendering "
                f"for {len(held)} messages: the chat template drops it"
            )
    for j, tool in enumerate(tools or []):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name and name not in text:
            raise ContentDropped(
                f"tools[{j}] ({name!r}) does not appear in the rendering: the chat template "
                "ignores the tools list"
            )


def prove(
    text: str,
    messages: list[dict],
    items: list[list[Item]],
    actions: list[bool],
    spans: list[tuple[int, int]],
    trained: list[tuple[int, int]],
    offsets: TokenOffsets,
    mask: np.ndarray,
    opener: str | None,
) -> None:
    """Raise MaskUnproven unless the spans tile the rendered tokens in order, each message's
    items (`items[k]`) lie in its own span (in `trained[k]`, its trained part, where it
    trains) with the tokens that start inside them trained exactly when the message trains,
    and every span beside a trained one opens a turn: at a header opening (`opener`,
    `<|im_start|>`), or, for a template without one, beside a control token (`<｜Assistant｜>`)
    where it writes any. Token positions are looked up in one search."""
    hits: list[tuple[int, str, int, int]] = []  # (message, what, start, end)
    for k, message in enumerate(messages):
        start, end = trained[k] if actions[k] else spans[k]
        for what, forms in items[k]:
            hit = find_item(text, forms, start, end)
            if hit is None:
                where = "trained part of its turn" if actions[k] else "span"
                raise MaskUnproven(
                    f"messages[{k}] (role {message.get('role')!r}): its {what} is not inside the "
                    f"{where} the template's probes gave it"
                )
            hits.append((k, what, *hit))
    starts = [start for start, _ in spans]
    positions = [*starts, *(s + 1 for s in starts), *(h[2] for h in hits), *(h[3] for h in hits)]
    counts = offsets.counts_before(positions)
    n, m = len(starts), len(hits)
    tokens, after = counts[:n], counts[n : 2 * n]  # tokens before each start, and before start+1
    previous = 0
    for k, (start, end) in enumerate(spans):
        if start < previous or end < start:
            raise MaskUnproven(f"messages[{k}]: its span [{start}, {end}) is out of order")
        previous = end
        beside_trained = actions[k] or (k > 0 and actions[k - 1])
        if not beside_trained or not 0 < start < len(text):
            continue
        if after[k] == tokens[k]:  # no token starts at `start`
            raise MaskUnproven(f"messages[{k}]: its span starts inside a token")
        if opener is not None:
            opens = text.startswith(opener, start)
        else:
            control = offsets.is_control
            opens = not control.any() or bool(control[tokens[k]])
            opens = opens or bool(tokens[k] and control[tokens[k] - 1])
        if not opens:
            role = messages[k].get("role")
            raise MaskUnproven(f"messages[{k}] (role {role!r}): its span does not open a turn")
    if not hits:
        return
    firsts = np.asarray(counts[2 * n : 2 * n + m])
    lasts = np.asarray(counts[2 * n + m :])
    trained_before = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    got = trained_before[lasts] - trained_before[firsts]
    trains = np.asarray([actions[h[0]] for h in hits])
    wrong = np.flatnonzero(got != np.where(trains, lasts - firsts, 0))
    if len(wrong):
        k, what = hits[wrong[0]][:2]
        state = "masked" if actions[k] else "trained"
        role = messages[k].get("role")
        raise MaskUnproven(f"messages[{k}] (role {role!r}): tokens of its {what} are {state}")
