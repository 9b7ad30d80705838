"""Parts: a record's sections made into parts (truncation.Part), each chat section's messages
checked and rendered as one conversation with those that continue it, each text encoded, one
BOS per record and each section's EOS, every character and token tallied.

`PartMaker` is what RecordMasker (masking.py) holds to make them. A chunk encodes its texts
and prerenders its conversations in one batch (chunks.py) and hands them to the masker as
a `Premade`; a part takes its ids or rendering from there where one was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jinja2
import numpy as np

from tokenmill.preprocess.chat.mask_proof import ContentDropped, MaskUnproven
from tokenmill.preprocess.chat.probe_spans import assistant_header
from tokenmill.preprocess.chat.spans import masked_rendering
from tokenmill.preprocess.chat.template import Renderer, TemplateRunBudget, has_generation_blocks
from tokenmill.preprocess.chat.token_offsets import TokenOffsets, encode_offsets
from tokenmill.preprocess.chat.tokenizer import TokenizerBundle, encode_text
from tokenmill.preprocess.chat.training_templates import template_name, with_chat_template
from tokenmill.preprocess.config import PipelineConfig, Section
from tokenmill.preprocess.document.preference import as_text, is_standard
from tokenmill.preprocess.document.truncation import Part
from tokenmill.preprocess.inputs.fields import (
    check_messages,
    get_field,
    get_tools,
    record_error,
)
from tokenmill.preprocess.inputs.records import Record
from tokenmill.preprocess.ledger import Tally

# a conversation prerendered (chunks.py): its section (the last, as `continue_chat` keeps
# it), messages, tools, rendering and offsets (None: not derived)
Rendering = tuple[Section, list[dict], "list[dict] | None", str, "TokenOffsets | None"]


@dataclass
class Premade:
    """What a chunk premade for its records, in one batch (chunks.py), each taken once by
    its record's own pass: plain texts encoded (`encoded`: id(text) -> (text, ids)) and
    conversations rendered (`rendered`: (source, line) -> the record's renderings). A
    (source, line) names one record of a chunk (prerender leaves out a name two records
    share)."""

    encoded: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    rendered: dict[tuple[str, int], list[Rendering]] = field(default_factory=dict)

    def ids(self, text: str) -> list[int] | None:
        """The ids of this very text (not an equal one), taken; None where none was made."""
        made, ids = self.encoded.pop(id(text), (None, None))
        return ids if made is text else None

    def rendering(
        self, record: Record, section: Section, messages: list[dict], tools: list[dict] | None
    ) -> tuple[str, TokenOffsets | None] | None:
        """This conversation's rendering and offsets, taken; None where none was made (a
        truncated record's re-rendering renders other messages)."""
        key = (record.source, record.line)
        made = self.rendered.get(key, [])
        for k, (made_for, *inputs, text, offsets) in enumerate(made):
            if made_for is section and inputs == [messages, tools]:
                del made[k]
                if not made:
                    del self.rendered[key]
                return text, offsets
        return None


def _last_turn(section: Section, messages: list[dict], actions: list[bool]) -> list[bool]:
    """`train_turns: last`: only the messages after the last user message keep their action
    (the last turn: a reply, or its tool calls, results and answer); all of them where no
    user message is given. Kept with the part, so a truncated record's re-rendering keeps it."""
    if section.train_turns != "last":
        return actions
    users = [k for k, m in enumerate(messages) if m.get("role") == "user"]
    return [trains and k > (users[-1] if users else -1) for k, trains in enumerate(actions)]


def present(record: Record, sections: list[Section]) -> list[Section]:
    """The sections this record has: an optional one it lacks (or gives as null) is left out."""
    return [s for s in sections if not s.optional or record.data.get(s.field) is not None]


class PartMaker:
    """Sections -> parts, for one config and tokenizer (the config's chat template, if it names
    one, in place of the tokenizer's own: `bundle`)."""

    def __init__(self, config: PipelineConfig, bundle: TokenizerBundle):
        self.config = config
        sections = config.all_sections()
        self.bundle = bundle = with_chat_template(bundle, config.chat_template)
        # the ids of the assistant's role header, which a cut prompt keeps with its reply
        self.header_ids: tuple[int, ...] = ()
        if bundle.chat_template and any(s.template and s.train_spans == "turn" for s in sections):
            header = assistant_header(Renderer(bundle))
            self.header_ids = tuple(encode_offsets(bundle, header).ids.tolist()) if header else ()
        self.roles = config.known_roles()
        self.premade = Premade()  # the chunk's, handed over by `take_premade`
        if any(s.train_spans == "generation" for s in sections):
            if not has_generation_blocks(bundle.chat_template):
                raise ValueError(
                    f"{bundle.path}: its chat template has no {{% generation %}} blocks, "
                    "which train_spans: generation reads"
                )

    def take_premade(self, premade: Premade) -> None:
        """What a chunk premade for its records (what an earlier chunk left is dropped)."""
        self.premade = premade

    def sections(self, record: Record, sections: list[Section], tally: Tally) -> list[Part]:
        """Each section rendered; chat sections that follow one another are one conversation
        (a TRL prompt and its reply), rendered once, when no later section continues it."""
        parts: list[Part] = []
        chat: Part | None = None  # the open conversation: its messages, not rendered yet
        standard = is_standard(record, self.config)  # TRL's text (non-conversational) format
        for section in present(record, sections):
            value = get_field(record, section.field)
            if section.template and standard:
                section = as_text(section)
            if section.template and chat is not None:
                chat = self.continue_chat(record, chat, section, value, tally)
                continue
            if chat is not None:
                parts.append(self._rendered(record, chat, tally))
                chat = None
            if section.template:
                chat = self.chat(record, section, section.field, value, not parts, tally)
            else:
                parts.append(self.one(record, section, section.field, value, not parts, tally))
        if chat is not None:
            parts.append(self._rendered(record, chat, tally))
        if not parts:
            raise record_error(record, sections[0].field, "missing field", "missing_field")
        return parts

    def chat(
        self, record: Record, section: Section, field: str, value: Any, first: bool, tally: Tally
    ) -> Part:
        """A chat section's messages and actions, not rendered yet (no ids)."""
        messages = check_messages(record, field, value, self.roles)
        actions = self._actions(record, section, field, messages)
        tally.chars += sum(len(m["content"] or "") for m in messages)
        empty = np.empty(0, dtype=np.int32)
        actions = _last_turn(section, messages, actions)
        return Part(section, field, first, empty, empty.astype(bool), messages, actions)

    def continue_chat(
        self, record: Record, part: Part, section: Section, value: Any, tally: Tally
    ) -> Part:
        """The conversation of `part` continued by this chat section's messages, not rendered
        yet. Messages that repeat the conversation so far (a reply given with its prompt) are
        not doubled."""
        messages = check_messages(record, section.field, value, self.roles)
        actions = self._actions(record, section, section.field, messages)
        before = part.messages or []
        if messages[: len(before)] == before:
            messages = messages[len(before) :]
            actions = actions[len(before) :]
        tally.chars += sum(len(m["content"] or "") for m in messages)
        messages = before + messages
        actions = _last_turn(section, messages, (part.actions or []) + actions)
        return Part(section, part.field, part.first, part.ids, part.mask, messages, actions)

    def _rendered(self, record: Record, part: Part, tally: Tally) -> Part:
        """A chat part with its tokens and mask: one rendering of all its messages."""
        messages = part.messages or []
        actions = part.actions or []
        ids, mask = self._render(record, part.section, part.field, messages, actions, part.first)
        tally.tokens += len(ids)
        return replace(part, ids=ids, mask=mask)

    def with_messages(self, record: Record, part: Part, kept: list[int]) -> Part:
        """A chat part rendered again with only its messages `kept` (truncation's re-render)."""
        messages = [(part.messages or [])[i] for i in kept]
        actions = [(part.actions or [])[i] for i in kept]
        ids, mask = self._render(record, part.section, part.field, messages, actions, part.first)
        return Part(part.section, part.field, part.first, ids, mask, messages, actions)

    def _actions(
        self, record: Record, section: Section, field: str, messages: list[dict]
    ) -> list[bool]:
        """Each message's action: its role's (`$role`) or the section's, unless the message
        says otherwise in its `message_train_field` (true or false)."""
        if section.action == "$role":
            actions = [self.config.role_trains(m["role"]) for m in messages]
        else:
            actions = [section.action == "train"] * len(messages)
        flag = section.message_train_field
        for k, message in enumerate(messages if flag else []):
            value = message.get(flag)
            if value is not None and not isinstance(value, bool):
                where = f"{field}[{k}].{flag}"
                raise record_error(record, where, f"expected true or false, got {value!r}")
            actions[k] = actions[k] if value is None else value
        return actions

    def one(
        self,
        record: Record,
        section: Section,
        field: str,
        value: Any,
        first: bool,
        tally: Tally,
    ) -> Part:
        """Tokens and mask of one section value (a chat or a text)."""
        if section.template:
            return self._rendered(
                record, self.chat(record, section, field, value, first, tally), tally
            )
        if not isinstance(value, str):
            raise record_error(record, field, f"expected a string, got {type(value).__name__}")
        value = section.prefix + value if value else value  # an empty input adds nothing
        tally.chars += len(value)
        add_special = (
            section.add_special_tokens if section.add_special_tokens is not None else first
        )
        ids = encode_text(self.bundle, value, add_special, self.premade.ids(value))
        mask = np.full(len(ids), section.action == "train", dtype=bool)
        if (
            add_special
            and self.bundle.bos_id is not None
            and len(ids)
            and ids[0] == self.bundle.bos_id
        ):
            mask[0] = False
        if section.eos:
            ids, mask = self._eos(section, ids, mask)
        tally.tokens += len(ids)
        return Part(section, field, first, ids.astype(np.int32, copy=False), mask)

    def _render(
        self,
        record: Record,
        section: Section,
        field: str,
        messages: list[dict],
        actions: list[bool],
        first: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """A chat section's tokens and mask, its EOS included (one rendering of the messages,
        with the record's tool schemas and the section's template keyword arguments)."""
        tools = get_tools(record, section.tools_field)
        try:
            ids, mask = masked_rendering(
                self.bundle,
                messages,
                actions,
                section.generation_prompt,
                tools,
                section.template_kwargs,
                section.train_spans,
                self.premade.rendering(record, section, messages, tools),
            )
        except (MaskUnproven, ContentDropped) as err:
            name = template_name(self.bundle, self.config.chat_template)
            message = f"{err} (chat template: {name})"
            raise record_error(record, field, message, err.reason) from None
        except TemplateRunBudget:  # the run's budget: the run stops, not only this record
            raise
        except (
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            IndexError,
            OverflowError,  # the sandbox's range() limit
            RecursionError,  # a macro that calls itself
            MemoryError,  # an allocation no size check foresaw
            jinja2.TemplateError,  # raise_exception(), the budgets (TemplateBudget)
        ) as err:
            # raise_exception() in a template, or a template tripping over odd message fields
            raise record_error(record, field, f"chat template: {err}", "template_error") from None
        if (
            not first
            and self.bundle.bos_id is not None
            and len(ids)
            and ids[0] == self.bundle.bos_id
        ):
            ids, mask = ids[1:], mask[1:]  # one BOS per record: only the first section's
        if section.eos:
            ids, mask = self._eos(section, ids, mask)
        return ids, mask

    def _eos(
        self, section: Section, ids: np.ndarray, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.bundle.eos_id is None:
            raise ValueError(
                f"section {section.field!r} asks for eos but the tokenizer has no eos token"
            )
        ids = np.append(ids, np.int32(self.bundle.eos_id))
        return ids, np.append(mask, section.action != "mask")
