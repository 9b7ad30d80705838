"""Spans from prefix probes: where each message of a tool conversation starts.

The conversation before message k is rendered followed by a user and by an assistant message;
where those renderings part (and stop agreeing with the full rendering) is where message k's
header starts. So a tool call stays in its assistant turn and a tool result keeps its closing
markup, even where the template groups results or looks at the next message's role."""

from __future__ import annotations

import os
import re

import numpy as np

from tokenmill.preprocess.chat.content_spans import CONTENT_MARK
from tokenmill.preprocess.chat.mask_proof import find_item, message_items
from tokenmill.preprocess.chat.template import Renderer
from tokenmill.preprocess.chat.token_offsets import TokenOffsets


def prefix_starts(
    render: Renderer,
    messages: list[dict],
    text: str,
    first: int,
    offsets: TokenOffsets,
    opener: str | None,
) -> list[int]:
    """Where messages 1..n-1 start: where the rendering of the messages before each one stops
    agreeing with the full rendering. So a tool call stays in its assistant turn and a tool
    result's closing markup (`</tool_response><|im_end|>`, DeepSeek's
    `<｜tool▁outputs▁end｜>`) in the tool turn, even when the template groups several
    results into one block and closes it only after the last.

    The messages before k are rendered followed by a user and by an assistant message (so
    message k-1 is not the last one: templates render a last turn differently); the two
    renderings part where message k's header would start."""
    token_starts, token_ends, control = offsets.starts, offsets.ends, offsets.is_control
    starts, previous = [], first
    for k in range(1, len(messages)):
        mark = CONTENT_MARK.format(k)
        try:
            a = render([*messages[:k], {"role": "user", "content": mark}], False)
            b = render([*messages[:k], {"role": "assistant", "content": mark}], False)
        except Exception:  # a template refusing that shape: the plain prefix instead
            try:
                a = b = render(messages[:k], False)
            except Exception:  # nor that (Qwen3.5 wants a user query): nothing learned here
                a = b = text[:previous]
        at = _snap(len(os.path.commonprefix([a, b])), token_starts, token_ends, control)
        agree_a, agree_b = (len(os.path.commonprefix([x, text])) for x in (a, b))
        if min(agree_a, agree_b) < at or (opener and not text.startswith(opener, at)):
            # a probe changed the text before message k (Qwen3 moves its last query to a user
            # probe): the probe that reproduces the text furthest parts from it inside message
            # k's header or content; k starts at the header opening (`<|im_start|>`) before
            furthest = max(agree_a, agree_b)
            found = text.rfind(opener, previous, furthest + 1) if opener else -1
            at = found if found >= 0 else _snap(furthest, token_starts, token_ends, control)
        previous = max(previous, at)
        if messages[k - 1].get("role") == "tool":  # DeepSeek closes the results in the next turn
            previous = _past_tool_markup(text, previous, token_starts, token_ends, control)
        starts.append(previous)
    return starts


def _snap(at: int, token_starts: np.ndarray, token_ends: np.ndarray, control: np.ndarray) -> int:
    """A header boundary moved to whole tokens: inside a token (`<｜User｜>`), its start; right
    after a control token that opens a header (`<|im_start|>`), that token's start."""
    token = int(np.searchsorted(token_starts, at, side="right")) - 1
    if token >= 0 and token_starts[token] < at < token_ends[token]:
        return int(token_starts[token])
    before = token if token >= 0 and token_ends[token] == at else token - 1
    if before >= 0 and token_ends[before] == at and control[before]:
        return int(token_starts[before])
    return at


def header_opener(render: Renderer) -> str | None:
    """The text that opens every header (`<|im_start|>`), from two renderings whose last
    message's role differs: what they share before their roles part, back to where the last
    token began. One message first; after a user message where the template refuses a lone
    assistant (Qwen3.5 wants a user query)."""
    for before in ([], [{"role": "user", "content": "\ue002"}]):
        try:
            user = render.probe([*before, {"role": "user", "content": "\ue000"}], False)
            assistant = render.probe([*before, {"role": "assistant", "content": "\ue000"}], False)
        except Exception:
            continue
        shared = os.path.commonprefix([user, assistant])
        opener = re.findall(r"<[^<>]*>$|<\|[^|]*\|>$", shared)
        return opener[0] if opener else None
    return None


def _past_tool_markup(
    text: str, at: int, token_starts: np.ndarray, token_ends: np.ndarray, control: np.ndarray
) -> int:
    """`at` moved past the control tokens of tool markup that open the turn after a tool
    result (`<｜tool▁outputs▁end｜>`): they close the result, so they are masked with it."""
    token = int(np.searchsorted(token_starts, at, side="left"))
    while (
        token < len(token_starts)
        and control[token]
        and "tool" in text[token_starts[token] : token_ends[token]].lower()
    ):
        at = int(token_ends[token])
        token += 1
    return at


def assistant_header(render: Renderer) -> str:
    """The text that opens an assistant turn (`<|im_start|>assistant\\n`, `<｜Assistant｜>`): what
    the model is prompted with and never writes, so it is not trained. It is the longest end of
    the text between a user's content and the next assistant's content that the generation
    prompt starts with; "" where the template shows none."""

    def compute() -> str:
        marks = [CONTENT_MARK.format(k) for k in range(3)]
        roles = ("user", "assistant", "user")
        chat = [{"role": role, "content": mark} for role, mark in zip(roles, marks)]
        try:
            probe = render.probe(chat, False)
            closed, opened = render.probe(chat[:1], False), render.probe(chat[:1], True)
        except Exception:  # a template refusing that shape: no header to leave out
            return ""
        after, before = probe.find(marks[0]), probe.find(marks[1])
        if after < 0 or before < after or not opened.startswith(closed):
            return ""
        glue = probe[after + len(marks[0]) : before]
        prompt = opened[len(closed) :]
        return next((glue[i:] for i in range(len(glue)) if prompt.startswith(glue[i:])), "")

    return render.by_shape("assistant header", "header", compute)


def anchored_starts(
    text: str, messages: list[dict], actions: list[bool], opener: str, first: int, limit: int
) -> list[int] | None:
    """Where each message starts, read from the real rendering alone: each message's own text
    (mask_proof.message_items) is found in order, and the message starts at the last header
    opening (`<|im_start|>`) before it. A message with no text of its own takes an opening
    between its neighbours'. None where the openings do not tell: too few of them, or none
    between a trained and an untrained message. The search starts at `first`, message 0's
    header: the tools block before it may hold a message's words."""
    regions: list[tuple[int, int] | None] = []
    cursor = first
    for message in messages:
        found = None
        for _, forms in message_items(message):
            hit = find_item(text, forms, cursor, limit)
            if hit is None:
                return None
            found = hit[0] if found is None else found
            cursor = hit[1]
        regions.append(None if found is None else (found, cursor))
    starts: list[int] = []
    end, waiting = first, []  # where the last placed message's text ends; messages not placed
    for k, region in enumerate([*regions, (limit, limit)]):
        waiting.append(k)
        if region is None:
            continue
        openings = _all(text, opener, end, region[0])
        placed = [k for k in waiting if k < len(messages)]
        if len(openings) >= len(placed):
            starts += openings[len(openings) - len(placed) :]
        elif len(placed) == 1 and actions[k] == (actions[k - 1] if k else False):
            starts.append(end)  # folded turns (tool results in one block) of one action
        else:
            return None
        end, waiting = region[1], []
    return starts


def _all(text: str, sub: str, start: int, end: int) -> list[int]:
    """Every place `sub` starts in text[start:end]."""
    found = []
    at = text.find(sub, start, end)
    while at >= 0:
        found.append(at)
        at = text.find(sub, at + 1, end)
    return found
