"""Spans: one rendering of a conversation -> its ids and a loss mask per message.

Message k's span is what it adds to the rendering (its header and end-of-turn included);
each token takes the action of the span holding its first character. Contents are found by
content_spans.py, headers by probe_spans.py; masking.py calls `render_conversation` for
each chat section of a record.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np

from tokenmill.preprocess.chat_template import Renderer, render_generation_spans
from tokenmill.preprocess.content_spans import content_starts
from tokenmill.preprocess.probe_spans import header_opener, prefix_starts
from tokenmill.preprocess.token_offsets import TokenOffsets, encode_offsets
from tokenmill.preprocess.tokenizer import TokenizerBundle


def render_conversation(
    bundle: TokenizerBundle,
    messages: list[dict],
    actions: list[bool],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    generation: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Ids (int32) of the full rendering and its loss mask (True = trained).

    Message k's span runs from its header to the next message's header; each token takes
    `actions[k]` of the span holding its first character. BOS and the generation prompt
    are never trained. `tools` and `template_kwargs` (`enable_thinking`, ...) reach the
    template as transformers' `apply_chat_template` passes them.
    """
    return masked_rendering(
        bundle, messages, actions, add_generation_prompt, tools, template_kwargs, generation
    )


def masked_rendering(
    bundle: TokenizerBundle,
    messages: list[dict],
    actions: list[bool],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    template_kwargs: dict[str, Any] | None,
    generation: bool,
    ahead: tuple[str, TokenOffsets | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`render_conversation`, given its rendering and the rendering's offsets (None where they
    are not derived) where `ahead` holds them: made with the record's chunk (chunks.py)."""
    if generation:  # the template marks what trains: `{% generation %}` blocks, not roles
        text, spans = render_generation_spans(
            bundle, messages, add_generation_prompt, tools, **(template_kwargs or {})
        )
        offsets = encode_offsets(bundle, text)
        mask = np.zeros(len(offsets.ids), dtype=bool)
        for a, b in spans:
            mask |= (offsets.starts >= a) & (offsets.starts < b)
        return _with_bos(bundle, offsets.ids, mask)
    if len(actions) != len(messages):
        raise ValueError(f"actions: {len(actions)} values for {len(messages)} messages")
    render = Renderer(bundle, tools, template_kwargs)
    text, made = ahead if ahead is not None else (render(messages, add_generation_prompt), None)
    prompt_start = len(text)  # where the generation prompt begins
    if add_generation_prompt:
        closed = render(messages, False)
        if text.startswith(closed):
            prompt_start = len(closed)
    offsets = encode_offsets(bundle, text) if made is None else made
    tooling = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    opener = header_opener(render) if tooling else None
    if opener:  # tool calls and results: each message's span is what it adds to the rendering
        later = prefix_starts(render, messages, text, 0, offsets, opener)
        # message 0 starts at its header: the preamble before it (a default system prompt,
        # the tools block) is never trained
        head = text.rfind(opener, 0, later[0] if later else prompt_start)
        span_starts = [max(head, 0), *later]
    else:
        try:
            span_starts = content_starts(
                render, bundle, messages, actions, text, prompt_start, offsets,
                add_generation_prompt,
            )  # fmt: skip
        except ValueError:
            if not tooling:
                raise
            span_starts = [0] * len(messages)  # message 0 owns the preamble: never trained
        if tooling:  # no header opening to find (DeepSeek): the prefix probes alone
            span_starts[1:] = prefix_starts(render, messages, text, span_starts[0], offsets, None)
    return _with_bos(bundle, offsets.ids, _span_mask(offsets, span_starts, actions, prompt_start))


def _span_mask(
    offsets: TokenOffsets, span_starts: list[int], actions: list[bool], prompt_start: int
) -> np.ndarray:
    """Each token takes the action of the span holding its first character (span 0, the
    template's preamble, never trains); the generation prompt never trains. Spans in order
    are token ranges, found by binary search; otherwise every token is looked up."""
    starts = [0, *span_starts]
    if any(a > b for a, b in pairwise(starts)):
        owner = np.searchsorted(starts, offsets.starts, side="right") - 1
        return np.asarray([False, *actions], dtype=bool)[owner] & (offsets.starts < prompt_start)
    mask = np.zeros(len(offsets.ids), dtype=bool)
    *bounds, prompt = offsets.counts_before([*span_starts, prompt_start])
    for trains, first, end in zip(actions, bounds, [*bounds[1:], len(mask)]):
        if trains:
            mask[first:end] = True
    mask[prompt:] = False
    return mask


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
