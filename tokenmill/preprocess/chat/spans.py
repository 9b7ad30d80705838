"""Spans: one rendering of a conversation -> its ids and a loss mask per message.

Message k's span is what it adds to the rendering (its header and end-of-turn included);
each token takes the action of the span holding its first character, and a trained
assistant message trains its span past its role header (`train_spans: turn`). Contents are
found by content_spans.py, headers by probe_spans.py; every mask is proven against the real
rendering (mask_proof.py) before it is returned. parts.py calls `masked_rendering` for each
chat of a record.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import numpy as np

from tokenmill.preprocess.chat.content_spans import content_starts
from tokenmill.preprocess.chat.mask_proof import Item, MaskUnproven, dropped, message_items, prove
from tokenmill.preprocess.chat.probe_spans import (
    anchored_starts,
    assistant_header,
    header_opener,
    prefix_starts,
)
from tokenmill.preprocess.chat.template import Renderer, render_generation_spans
from tokenmill.preprocess.chat.token_offsets import TokenOffsets, encode_offsets
from tokenmill.preprocess.chat.tokenizer import TokenizerBundle

# What trains in a trained message: its turn past the role header (content, tool calls and
# end-of-turn, as TRL's training templates mark them), its whole span (the older rule), or
# exactly the template's `{% generation %}` blocks.
TrainSpans = Literal["turn", "roles", "generation"]


def render_conversation(
    bundle: TokenizerBundle,
    messages: list[dict],
    actions: list[bool],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    train_spans: TrainSpans = "turn",
) -> tuple[np.ndarray, np.ndarray]:
    """Ids (int32) of the full rendering and its loss mask (True = trained).

    Message k's span runs from its header to the next message's header; a message whose
    `actions[k]` is True trains its span, less its role header under `train_spans="turn"` (the
    content, tool calls and end-of-turn train), all of it under `"roles"`. BOS and the
    generation prompt never train. Every record's spans are proven against its rendering
    (mask_proof.py): MaskUnproven or ContentDropped otherwise. `tools` and `template_kwargs`
    (`enable_thinking`, ...) reach the template as transformers' `apply_chat_template` passes
    them.
    """
    return masked_rendering(
        bundle, messages, actions, add_generation_prompt, tools, template_kwargs, train_spans
    )


def masked_rendering(
    bundle: TokenizerBundle,
    messages: list[dict],
    actions: list[bool],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    template_kwargs: dict[str, Any] | None,
    train_spans: TrainSpans,
    premade: tuple[str, TokenOffsets | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`render_conversation`, given its rendering and the rendering's offsets (None where they
    are not derived) where `premade` holds them: made with the record's chunk (chunks.py)."""
    if train_spans == "generation":  # the template marks what trains: `{% generation %}` blocks
        text, spans = render_generation_spans(
            bundle, messages, add_generation_prompt, tools, **(template_kwargs or {})
        )
        dropped(text, messages, [message_items(m) for m in messages], tools)
        offsets = encode_offsets(bundle, text)
        mask = np.zeros(len(offsets.ids), dtype=bool)
        for a, b in spans:
            mask |= (offsets.starts >= a) & (offsets.starts < b)
        return _with_bos(bundle, offsets.ids, mask)
    if len(actions) != len(messages):
        raise ValueError(f"actions: {len(actions)} values for {len(messages)} messages")
    render = Renderer(bundle, tools, template_kwargs)
    text, made = premade if premade is not None else (render(messages, add_generation_prompt), None)
    prompt_start = len(text)  # where the generation prompt begins
    if add_generation_prompt:
        closed = render(messages, False)
        if text.startswith(closed):
            prompt_start = len(closed)
    offsets = encode_offsets(bundle, text) if made is None else made
    items = [message_items(m) for m in messages]
    dropped(text, messages, items, tools)
    header = assistant_header(render)
    opener = header_opener(render)
    span_starts = _probed_starts(render, bundle, messages, actions, text, prompt_start, offsets)
    span_starts = _past_end_of_turn(span_starts, text, bundle.eos_token, opener)
    proven = Proven(
        text,
        messages,
        items,
        actions,
        prompt_start,
        offsets,
        header,
        opener,
        bundle.eos_token,
        train_spans == "turn",
    )
    try:
        mask = _proven_mask(span_starts, proven)
    except MaskUnproven:
        # a template that renders by content (Qwen3.5 finds its last query by its text) can
        # fool the probes: the message's own text in the real rendering places it instead,
        # read from message 0's header on (not the tools block before it)
        anchored = None
        if opener and text.startswith(opener, span_starts[0]):
            anchored = anchored_starts(
                text, messages, actions, opener, span_starts[0], prompt_start
            )
        if anchored is None:
            raise
        mask = _proven_mask(anchored, proven)
    return _with_bos(bundle, offsets.ids, mask)


def _probed_starts(
    render: Renderer,
    bundle: TokenizerBundle,
    messages: list[dict],
    actions: list[bool],
    text: str,
    prompt_start: int,
    offsets: TokenOffsets,
) -> list[int]:
    """Where each message's span starts, as probe renderings of the template place it."""
    tooling = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    opener = header_opener(render) if tooling else None
    if opener:  # tool calls and results: each message's span is what it adds to the rendering
        later = prefix_starts(render, messages, text, 0, offsets, opener)
        # message 0 starts at its header: the preamble before it (a default system prompt,
        # the tools block) is never trained
        head = text.rfind(opener, 0, later[0] if later else prompt_start)
        return [max(head, 0), *later]
    add_generation_prompt = prompt_start < len(text)
    try:
        span_starts = content_starts(
            render, bundle, messages, actions, text, prompt_start, offsets, add_generation_prompt
        )
    except ValueError:
        if not tooling:
            raise
        span_starts = [0] * len(messages)  # message 0 owns the preamble: never trained
    if tooling:  # no header opening to find (DeepSeek): the prefix probes alone
        span_starts[1:] = prefix_starts(render, messages, text, span_starts[0], offsets, None)
    return span_starts


def _past_end_of_turn(
    span_starts: list[int], text: str, eos: str | None, opener: str | None
) -> list[int]:
    """A span that opens with the end-of-sequence token (`<｜end▁of▁sentence｜>` after
    DeepSeek's tool calls, `<|im_end|>`) gives it to the message before, whose turn it closes,
    with the line breaks after it where the next header opening follows them."""
    if not eos:
        return span_starts
    moved = []
    for k, start in enumerate(span_starts):
        if k and text.startswith(eos, start):
            start += len(eos)
            after = start
            while text.startswith("\n", after):
                after += 1
            if opener and text.startswith(opener, after):
                start = after
        moved.append(start)
    return moved


@dataclass(frozen=True)
class Proven:
    """What a mask is made from and proven against, besides the span starts."""

    text: str
    messages: list[dict]
    items: list[list[Item]]
    actions: list[bool]
    prompt_start: int
    offsets: TokenOffsets
    header: str  # the assistant's role header
    opener: str | None
    eos: str | None
    turn: bool  # train_spans: turn (the header masked)


def _proven_mask(span_starts: list[int], p: Proven) -> np.ndarray:
    """The mask of these spans, proven (mask_proof.py). Message k's span runs to the next
    one's start (the last to the generation prompt); a trained assistant message trains its
    span, past its role header (where the span opens with it) under `turn`; each token takes
    the action of the span holding its first character; the preamble before message 0 and the
    generation prompt never train."""
    ends = [*span_starts[1:], p.prompt_start]
    spans = list(zip(span_starts, ends))
    header = p.header if p.turn else ""
    trained = [
        (start + len(header), end)
        if header and message.get("role") == "assistant" and p.text.startswith(header, start)
        else (start, end)
        for message, (start, end) in zip(p.messages, spans)
    ]
    mask = np.zeros(len(p.offsets.ids), dtype=bool)
    if all(a <= b for a, b in spans) and all(b <= c for (_, b), (c, _) in pairwise(spans)):
        bounds = p.offsets.counts_before([x for span in trained for x in span])
        for trains, first, end in zip(p.actions, bounds[0::2], bounds[1::2]):
            if trains:
                mask[first:end] = True
    prove(p.text, p.messages, p.items, p.actions, spans, trained, p.offsets, mask, p.opener)
    _prove_turns(p, spans)
    return mask


def _prove_turns(p: Proven, spans: list[tuple[int, int]]) -> None:
    """What a turn's text proves beyond its items: a trained assistant span of a template with
    a header opening opens with the assistant's header (not another role's), and no span
    beside a trained one opens with the end-of-sequence token that closes the turn before."""
    for k, (start, _) in enumerate(spans):
        role = p.messages[k].get("role")
        if p.actions[k] and role == "assistant" and p.opener and p.header:
            if not p.text.startswith(p.header, start):
                raise MaskUnproven(f"messages[{k}] (role 'assistant'): its span opens another turn")
        beside_trained = p.actions[k] or (k > 0 and p.actions[k - 1])
        if k and beside_trained and p.eos and p.text.startswith(p.eos, start):
            raise MaskUnproven(
                f"messages[{k}] (role {role!r}): its span opens with the end of the turn before"
            )


def _with_bos(
    bundle: TokenizerBundle, ids: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """At most one leading BOS, masked: the template's own, or prepended where it renders
    none and the tokenizer's own encode adds one (`add_bos_token`); never a BOS the
    tokenizer would not put there (a GPT-2-style folder that only names one)."""
    if bundle.bos_id is not None and (bundle.add_bos_token or ids[:1].tolist() == [bundle.bos_id]):
        if ids[:1].tolist() != [bundle.bos_id]:
            ids = np.concatenate([np.asarray([bundle.bos_id], dtype=np.int32), ids])
            mask = np.concatenate([[False], mask])
        mask[0] = False
    return ids, mask
