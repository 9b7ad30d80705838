"""Truncation: what a document longer than max_seq_len keeps, by policy.

The masker renders a record's sections into parts; `fit` joins them and cuts them to the
limit: `latest_turns` re-renders a chat with its system prompt and the latest complete turns
that fit (through the masker's re-render callback, so the kept ids are the template's own
rendering of those turns), `cut_prompt` cuts the end of the prompt for the response, and
`keep_start` / `keep_end` cut an end. Every cut token is tallied for the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenmill.preprocess.config import Section
from tokenmill.preprocess.ledger import Tally

Rerender = Callable[["Part", list[int]], "Part"]  # a chat part rendered with these messages


@dataclass
class Part:
    """One section of one record, rendered: its tokens and mask, and for a chat its messages
    and their actions (so that truncation can render fewer turns)."""

    section: Section
    field: str
    first: bool
    ids: np.ndarray
    mask: np.ndarray
    messages: list[dict] | None = None
    actions: list[bool] | None = None


def join(parts: list[Part]) -> tuple[np.ndarray, np.ndarray]:
    if len(parts) == 1:  # most records: nothing to copy
        return parts[0].ids.astype(np.int32, copy=False), parts[0].mask.astype(bool, copy=False)
    ids = np.concatenate([p.ids for p in parts]).astype(np.int32, copy=False)
    return ids, np.concatenate([p.mask for p in parts]).astype(bool, copy=False)


def cut(
    ids: np.ndarray,
    mask: np.ndarray,
    mode: str,
    limit: int,
    bos: int | None,
    header: tuple[int, ...] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """ids and mask cut to `limit` tokens. keep_start / keep_end keep that end (keep_end keeps
    a leading BOS, masked). cut_prompt (as LLaMA-Factory does) cuts the end of the prompt (the
    tokens before the first trained one, keeping its start) to make room for the response; a
    response longer than the room keeps its start, after at most half the room of prompt. The
    response's role header (`header`, masked, right before its first trained token) stays with
    it: a cut prompt never leaves a reply without the header that opens it."""
    has_bos = bos is not None and len(ids) > 0 and ids[0] == bos and limit > 1
    if mode == "keep_start":
        return ids[:limit], mask[:limit]
    if mode == "keep_end":
        if has_bos:
            return np.concatenate([ids[:1], ids[-(limit - 1) :]]), np.concatenate(
                [[False], mask[-(limit - 1) :]]
            )
        return ids[-limit:], mask[-limit:]
    trained = np.flatnonzero(mask)
    if not len(trained):
        return ids[:limit], mask[:limit]
    first = int(trained[0])
    excess = len(ids) - limit
    head = int(has_bos)  # a leading BOS is kept
    start = first - len(header)
    if header and start >= head:
        opened = ids[start:first].tolist()
        # the header's last token may have merged with the reply's first characters ("\n\n\n")
        if opened == list(header) or opened[:-1] == list(header[:-1]) != []:
            first = start
    if first - head >= excess:
        keep = np.r_[0 : first - excess, first : len(ids)]
    else:
        prompt = max(head, min(first, limit // 2))
        keep = np.r_[0:prompt, first : first + limit - prompt]
    return ids[keep], mask[keep]


def resolve(mode: str, sections: list[Section]) -> str:
    """The policy for these sections; `auto`: latest_turns for chats, cut_prompt for a
    prompt and a response, none for plain text (pretraining keeps every token)."""
    if mode != "auto":
        return mode
    if any(s.template for s in sections):
        return "latest_turns"
    if any(s.action == "mask" for s in sections):
        return "cut_prompt"
    return "none"


def fit(
    parts: list[Part],
    limit: int,
    mode: str,
    trains: bool,
    bos: int | None,
    rerender: Rerender,
    tally: Tally,
    header: tuple[int, ...] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """The parts joined and cut to `limit` by `mode` (`header`: the ids of the trained role's
    header, kept with its reply); cuts are tallied."""
    ids, mask = join(parts)
    if len(ids) <= limit or mode == "none":
        return ids, mask
    if mode == "latest_turns":
        kept, kept_mask = join(latest_turns(parts, limit, trains, rerender))
        if len(kept) > limit:
            kept, kept_mask = cut(kept, kept_mask, "cut_prompt", limit, bos, header)
    else:
        kept, kept_mask = cut(ids, mask, mode, limit, bos, header)
    tally.truncated += len(ids) - len(kept)
    return kept, kept_mask


def latest_turns(parts: list[Part], limit: int, trains: bool, rerender: Rerender) -> list[Part]:
    """The first chat part re-rendered with its leading system messages and the latest
    complete turns (a user message and what follows it) that fit beside the other parts,
    with a trained token when the sections train. When no suffix of turns fits, the
    latest turn that trains (or the latest turn) is kept, for cut_prompt to cut."""
    chat = next((i for i, p in enumerate(parts) if p.messages is not None), None)
    if chat is None:
        return parts
    part = parts[chat]
    messages = part.messages or []
    actions = part.actions or []
    others = sum(len(p.ids) for i, p in enumerate(parts) if i != chat)
    # a trained section beside the chat (a text response) already trains: then the chat
    # keeps its latest turns whatever they train
    trains = trains and not any(p.mask.any() for i, p in enumerate(parts) if i != chat)
    head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    starts = [head] + [i for i in range(head + 1, len(messages)) if messages[i]["role"] == "user"]
    fallback = None
    for k in range(1, len(starts)):
        kept = list(range(head)) + list(range(starts[k], len(messages)))
        if trains and not any(actions[i] for i in kept):
            break  # the turns left train nothing, and shorter suffixes train less
        candidate = rerender(part, kept)
        fallback = candidate
        if others + len(candidate.ids) <= limit and (not trains or candidate.mask.any()):
            return [candidate if i == chat else p for i, p in enumerate(parts)]
    if fallback is None:
        return parts
    return [fallback if i == chat else p for i, p in enumerate(parts)]


def shared_turns(
    rendered: dict[str, list[Part]],
    prompt_messages: int,
    limit: int,
    rerender: Rerender,
    tally: Tally,
) -> dict[str, list[Part]]:
    """Preference data over max_seq_len under latest_turns: every reply keeps the same
    latest turns of the shared prompt (as many as let the longest conversation fit), so
    the prompt stays byte-identical between chosen and rejected."""
    chats = {
        k: next((p for p in parts if p.messages is not None), None) for k, parts in rendered.items()
    }
    if (
        len(rendered) < 2
        or any(c is None for c in chats.values())
        or all(sum(len(p.ids) for p in parts) <= limit for parts in rendered.values())
    ):
        return rendered
    first = chats[next(iter(chats))]
    messages = (first.messages if first is not None else None) or []
    head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    last = prompt_messages - 1  # the prompt's own turns only: the replies stay whole
    starts = [i for i in range(head + 1, last + 1) if messages[i]["role"] == "user"]
    best = rendered
    for start in starts:
        best = {}
        for key, parts in rendered.items():
            chat = chats[key]
            assert chat is not None
            kept = [i for i in range(len(chat.messages or [])) if i < head or i >= start]
            best[key] = [rerender(p, kept) if p is chat else p for p in parts]
        if all(sum(len(p.ids) for p in parts) <= limit for parts in best.values()):
            break
    for key, parts in best.items():  # the turns dropped here are cut tokens too
        tally.truncated += sum(len(p.ids) for p in rendered[key]) - sum(len(p.ids) for p in parts)
    return best
