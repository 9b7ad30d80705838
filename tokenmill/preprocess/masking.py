"""One record -> one document: its output arrays (tokens, loss masks, values), as the config says.

Sits between records.py and fields.py (raw JSON, checked fields) and packing: everything a
trainer will learn from is decided here (which tokens train, what a too-long record keeps),
so every rule is explicit, every bad record raises a RecordError naming file, line and
field, and every token rendered or cut is tallied for the ledger."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jinja2
import numpy as np

from tokenmill.preprocess.chat_template import has_generation_blocks
from tokenmill.preprocess.config import PipelineConfig, Section
from tokenmill.preprocess.fields import check_messages, get_field, get_tools, get_values
from tokenmill.preprocess.filters import check_chars, raw_chars
from tokenmill.preprocess.layout import OutputLayout, can_train
from tokenmill.preprocess.ledger import Tally
from tokenmill.preprocess.preference import as_text, is_standard, with_shared_prompt
from tokenmill.preprocess.records import Record, RecordError
from tokenmill.preprocess.spans import masked_rendering
from tokenmill.preprocess.token_offsets import TokenOffsets
from tokenmill.preprocess.tokenizer import TokenizerBundle, encode_text
from tokenmill.preprocess.truncation import Part, fit, resolve, shared_turns

DocumentArrays = dict[str, "np.ndarray | list[np.ndarray]"]
# a conversation rendered ahead (chunks.py): its section (the last, as `_continue_chat` keeps
# it), messages, tools, rendering and offsets (None: not derived)
Ahead = tuple[Section, list[dict], "list[dict] | None", str, "TokenOffsets | None"]


class RecordMasker(OutputLayout):
    """Turns record dicts into output arrays for one config (its layout) and tokenizer."""

    def __init__(self, config: PipelineConfig, bundle: TokenizerBundle):
        super().__init__(config)
        self.bundle = bundle
        self._dtypes = self.dtypes()
        self.roles = config.known_roles()
        self.encoded: dict[int, tuple[str, list[int]]] = {}  # id(text) -> text, ids: chunks.py
        # (source, line) -> the record's conversations rendered ahead, each used once: chunks.py
        self.rendered: dict[tuple[str, int], list[Ahead]] = {}
        sections = [*config.input.sections]
        sections += [s for src in (config.input.sources or {}).values() for s in src.sections]
        if any(s.train_spans == "generation" for s in sections):
            if not has_generation_blocks(bundle.chat_template):
                raise ValueError(
                    f"{bundle.path}: its chat template has no {{% generation %}} blocks, "
                    "which train_spans: generation reads"
                )

    # --- processing ----------------------------------------------------------------------
    def process(
        self, data: dict | Record, source: str = "<record>", line: int = 0
    ) -> DocumentArrays:
        record = data if isinstance(data, Record) else Record(source, line, data)
        return self.process_counted(record)[0]

    def process_counted(self, record: Record) -> tuple[DocumentArrays, Tally]:
        """The record's arrays and its tally; a RecordError carries the tokens rendered so far."""
        if not isinstance(record.data, dict):
            raise RecordError(
                record.source, record.line, None, "expected a JSON object", "not_object"
            )
        tally = Tally()
        try:
            # too long before a token is made: a 50 MB record is never tokenized
            check_chars(record, self.config, 0, raw_chars(record, self.config))
            try:
                out = self._outputs(record, tally)
            except RecordError as err:
                if err.reason == "no_trained_tokens":
                    check_chars(
                        record, self.config, tally.chars
                    )  # a filtered record counts as filtered
                raise
            check_chars(record, self.config, tally.chars)
        except RecordError as err:
            err.tokens = tally.tokens
            raise
        return out, tally

    def _outputs(self, record: Record, tally: Tally) -> DocumentArrays:
        if not self.config.multi_output:
            sections = self.config.input.sections
            ids, mask = self._fit(record, sections, self._sections(record, sections, tally), tally)
            out: DocumentArrays = {"sequence": ids}
            if self.single_needs_mask():
                out["loss_mask"] = mask
            if can_train(self.config.input.sections) and not mask.any():
                raise RecordError(
                    record.source,
                    record.line,
                    self.config.input.sections[0].field,
                    "no token is trained after masking and truncation",
                    "no_trained_tokens",
                )
            if self.config.output.position_ids_mode != "none":
                out["position_ids"] = np.arange(len(ids), dtype=np.int32)
        else:
            out = self._sources(record, tally)
        return out

    def _sources(self, record: Record, tally: Tally) -> DocumentArrays:
        record = with_shared_prompt(record, self.config)
        out: DocumentArrays = {}
        group_sizes: dict[str, int] = {}
        values: dict[str, np.ndarray] = {}
        untrained: RecordError | None = None  # raised once every source is rendered (the ledger)
        rendered = {
            key: self._sections(record, sections, tally)
            for key, sections in self._joined_sources(record).items()
        }
        rendered = self._shared_turns(record, rendered, tally)
        for key, source in (self.config.input.sources or {}).items():
            section = source.sections[0]
            mask_key = self.source_mask_key(key)
            if all(s.optional and record.data.get(s.field) is None for s in source.sections):
                continue  # e.g. GRPO prompts without responses yet: prompts for online generation
            if section.action == "value":
                values[key] = get_values(record, section.field, np.dtype(self._dtypes[key]))
                out[key] = values[key]
                continue
            if source.list_field:
                items = get_field(record, section.field)
                if not isinstance(items, list):
                    raise RecordError(
                        record.source,
                        record.line,
                        section.field,
                        f"expected a list, got {type(items).__name__}",
                        "wrong_type",
                    )
                if not items:
                    raise RecordError(
                        record.source, record.line, section.field, "empty group", "empty"
                    )
                pairs = [
                    self._fit(
                        record,
                        source.sections,
                        [self._one(record, section, f"{section.field}[{j}]", item, True, tally)],
                        tally,
                    )
                    for j, item in enumerate(items)
                ]
                out[key] = [ids for ids, _ in pairs]
                masks = [mask for _, mask in pairs]
                if can_train(source.sections) and not all(m.any() for m in masks):
                    untrained = untrained or RecordError(
                        record.source,
                        record.line,
                        section.field,
                        "an item trains no token",
                        "no_trained_tokens",
                    )
                if mask_key:
                    out[mask_key] = masks
                group_sizes[key] = len(items)
            else:
                parts = rendered[key]
                ids, mask = self._fit(record, source.sections, parts, tally)
                out[key] = ids
                if can_train(source.sections) and not mask.any():
                    untrained = untrained or RecordError(
                        record.source,
                        record.line,
                        source.sections[0].field,
                        "no token is trained after masking and truncation",
                        "no_trained_tokens",
                    )
                if mask_key:
                    out[mask_key] = mask
        for vkey, vals in values.items():
            for gkey, size in group_sizes.items():
                if len(vals) != size:
                    raise RecordError(
                        record.source,
                        record.line,
                        vkey,
                        f"{len(vals)} values for {size} items of {gkey!r}",
                        "bad_value",
                    )
        if untrained is not None:
            raise untrained
        if "chosen" in out and "rejected" in out and np.array_equal(out["chosen"], out["rejected"]):
            raise RecordError(
                record.source,
                record.line,
                "rejected",
                "chosen and rejected are the same tokens: the pair teaches nothing",
                "identical_pair",
            )
        return out

    def _joined_sources(self, record: Record) -> dict[str, list[Section]]:
        """The sources whose sections join into one sequence: not a group, not values, and not
        every section absent."""
        return {
            key: source.sections
            for key, source in (self.config.input.sources or {}).items()
            if not source.list_field
            and source.sections[0].action != "value"
            and not all(s.optional and record.data.get(s.field) is None for s in source.sections)
        }

    def conversations(self, record: Record) -> list[Part]:
        """The conversations this record's own pass renders first, in order, not rendered yet:
        one per sequence (SFT's, each reply's of a preference pair), or none where a sequence
        holds text. What a chunk renders ahead in one batch (chunks.py); raises what the
        record's own pass would."""
        groups = [self.config.input.sections]
        if self.config.multi_output:
            record = with_shared_prompt(record, self.config)
            if is_standard(record, self.config):
                return []
            groups = list(self._joined_sources(record).values())
        tally, parts = Tally(), []  # the record's own pass counts what it renders
        for sections in groups:
            present = [
                s for s in sections if not s.optional or record.data.get(s.field) is not None
            ]
            if not present or not all(s.template for s in present):
                return []
            first = present[0]
            chat = self._chat(
                record, first, first.field, get_field(record, first.field), True, tally
            )
            for section in present[1:]:
                value = get_field(record, section.field)
                chat = self._continue_chat(record, chat, section, value, tally)
            parts.append(chat)
        return parts

    def _sections(self, record: Record, sections: list[Section], tally: Tally) -> list[Part]:
        """Each section rendered; chat sections that follow one another are one conversation
        (a TRL prompt and its reply), rendered once, when no later section continues it."""
        parts: list[Part] = []
        chat: Part | None = None  # the open conversation: its messages, not rendered yet
        standard = is_standard(record, self.config)  # TRL's text (non-conversational) format
        for section in sections:
            data = record.data
            if section.optional and (section.field not in data or data[section.field] is None):
                continue
            value = get_field(record, section.field)
            if section.template and standard:
                section = as_text(section)
            if section.template and chat is not None:
                chat = self._continue_chat(record, chat, section, value, tally)
                continue
            if chat is not None:
                parts.append(self._rendered(record, chat, tally))
                chat = None
            if section.template:
                chat = self._chat(record, section, section.field, value, not parts, tally)
            else:
                parts.append(self._one(record, section, section.field, value, not parts, tally))
        if chat is not None:
            parts.append(self._rendered(record, chat, tally))
        if not parts:
            raise RecordError(
                record.source, record.line, sections[0].field, "missing field", "missing_field"
            )
        return parts

    def _chat(
        self, record: Record, section: Section, field: str, value: Any, first: bool, tally: Tally
    ) -> Part:
        """A chat section's messages and actions, not rendered yet (no ids)."""
        messages = check_messages(record, field, value, self.roles)
        actions = self._actions(section, messages)
        tally.chars += sum(len(m["content"] or "") for m in messages)
        empty = np.empty(0, dtype=np.int32)
        return Part(section, field, first, empty, empty.astype(bool), messages, actions)

    def _continue_chat(
        self, record: Record, part: Part, section: Section, value: Any, tally: Tally
    ) -> Part:
        """The conversation of `part` continued by this chat section's messages, not rendered
        yet. Messages that repeat the conversation so far (a reply given with its prompt) are
        not doubled."""
        messages = check_messages(record, section.field, value, self.roles)
        actions = self._actions(section, messages)
        before = part.messages or []
        if messages[: len(before)] == before:
            messages, actions = messages[len(before) :], actions[len(before) :]
        tally.chars += sum(len(m["content"] or "") for m in messages)
        messages, actions = before + messages, (part.actions or []) + actions
        return Part(section, part.field, part.first, part.ids, part.mask, messages, actions)

    def _rendered(self, record: Record, part: Part, tally: Tally) -> Part:
        """A chat part with its tokens and mask: one rendering of all its messages."""
        messages, actions = part.messages or [], part.actions or []
        ids, mask = self._render(record, part.section, part.field, messages, actions, part.first)
        tally.tokens += len(ids)
        return replace(part, ids=ids, mask=mask)

    def _actions(self, section: Section, messages: list[dict]) -> list[bool]:
        if section.action == "$role":
            return [self.config.role_trains(m["role"]) for m in messages]
        return [section.action == "train"] * len(messages)

    def _one(
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
                record, self._chat(record, section, field, value, first, tally), tally
            )
        if not isinstance(value, str):
            raise RecordError(
                record.source,
                record.line,
                field,
                f"expected a string, got {type(value).__name__}",
                "wrong_type",
            )
        tally.chars += len(value)
        add_special = (
            section.add_special_tokens if section.add_special_tokens is not None else first
        )
        text, ahead = self.encoded.pop(id(value), (None, None))  # encoded with its chunk
        ids = encode_text(self.bundle, value, add_special, ahead if text is value else None)
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
        ahead = self._ahead(record, section, messages, tools)
        try:
            ids, mask = masked_rendering(
                self.bundle, messages, actions, section.generation_prompt, tools,
                section.template_kwargs, section.train_spans == "generation", ahead,
            )  # fmt: skip
        except (
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            IndexError,
            OverflowError,  # the sandbox's range() limit
            RecursionError,  # a macro that calls itself
            jinja2.TemplateError,  # raise_exception(), the budgets (TemplateBudget)
        ) as err:
            # raise_exception() in a template, or a template tripping over odd message fields
            raise RecordError(
                record.source, record.line, field, f"chat template: {err}", "template_error"
            ) from None
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

    def _ahead(
        self, record: Record, section: Section, messages: list[dict], tools: list[dict] | None
    ) -> tuple[str, TokenOffsets | None] | None:
        """This conversation's rendering and offsets, where its chunk made them: a truncated
        record's re-rendering (other messages) finds none. A (source, line) names one record
        of a chunk (render_ahead leaves out a name two records share)."""
        key = (record.source, record.line)
        made = self.rendered.get(key, [])
        for k, (made_for, *inputs, text, offsets) in enumerate(made):
            if made_for is section and inputs == [messages, tools]:
                del made[k]
                if not made:
                    del self.rendered[key]
                return text, offsets
        return None

    def _eos(
        self, section: Section, ids: np.ndarray, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.bundle.eos_id is None:
            raise ValueError(
                f"section {section.field!r} asks for eos but the tokenizer has no eos token"
            )
        return np.append(ids, np.int32(self.bundle.eos_id)), np.append(
            mask, section.action != "mask"
        )

    # --- truncation: what a record longer than max_seq_len keeps ------------------------
    def truncation(self, sections: list[Section]) -> str:
        """The policy for these sections (see truncation.resolve)."""
        return resolve(self.config.preprocessing.truncation_mode, sections)

    def _fit(
        self, record: Record, sections: list[Section], parts: list[Part], tally: Tally
    ) -> tuple[np.ndarray, np.ndarray]:
        """The parts joined and cut to max_seq_len by the sections' policy; cuts are tallied."""
        return fit(
            parts, self.config.preprocessing.max_seq_len, self.truncation(sections),
            can_train(sections), self.bundle.bos_id, self._rerender(record), tally,
        )  # fmt: skip

    def _shared_turns(
        self, record: Record, rendered: dict[str, list[Part]], tally: Tally
    ) -> dict[str, list[Part]]:
        """Preference data: one kept prompt for every reply (see truncation.shared_turns)."""
        name = self.config.input.shared_prompt
        prompt = record.data.get(name) if name else None
        sources = self.config.input.sources or {}
        if not isinstance(prompt, list) or any(
            self.truncation(sources[k].sections) != "latest_turns" for k in rendered
        ):
            return rendered
        limit = self.config.preprocessing.max_seq_len
        return shared_turns(rendered, len(prompt), limit, self._rerender(record), tally)

    def _rerender(self, record: Record) -> Callable[[Part, list[int]], Part]:
        return lambda part, kept: self._with_messages(record, part, kept)

    def _with_messages(self, record: Record, part: Part, kept: list[int]) -> Part:
        messages = [(part.messages or [])[i] for i in kept]
        actions = [(part.actions or [])[i] for i in kept]
        ids, mask = self._render(record, part.section, part.field, messages, actions, part.first)
        return Part(part.section, part.field, part.first, ids, mask, messages, actions)
