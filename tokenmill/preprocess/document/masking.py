"""Masking: one record -> one document, its output arrays (tokens, loss masks, values), as the
config says.

Sits between records.py and fields.py (raw JSON, checked fields) and packing: everything a
trainer will learn from is decided here (which tokens train, what a too-long record keeps),
so every rule is explicit, every bad record raises a RecordError naming file, line and
field, and every token rendered or cut is tallied for the ledger. `RecordMasker` holds the
config's `OutputLayout` (layout.py: the keys it writes) and a `PartMaker` (parts.py: its
sections made into parts); here the parts become the document's sequences, groups and
values.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tokenmill.preprocess.chat.template import record_budget
from tokenmill.preprocess.chat.tokenizer import TokenizerBundle
from tokenmill.preprocess.config import PipelineConfig, Section
from tokenmill.preprocess.document.filters import check_chars, raw_chars
from tokenmill.preprocess.document.layout import OutputLayout, can_train
from tokenmill.preprocess.document.parts import PartMaker, Premade, present
from tokenmill.preprocess.document.preference import is_standard, with_shared_prompt
from tokenmill.preprocess.document.truncation import Part, fit, resolve, shared_turns
from tokenmill.preprocess.inputs.columns import remap
from tokenmill.preprocess.inputs.fields import get_field, get_values, record_error
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.ledger import Tally

DocumentArrays = dict[str, "np.ndarray | list[np.ndarray]"]


def check_label(record: Record, field: str) -> None:
    """A KTO label (the `label` key, as TRL names it) says good or bad: true/false, or the
    integers 1/0, nothing else (2, 0.5, -1 and [true] were stored as given)."""
    value = get_field(record, field)
    if not (isinstance(value, bool) or (type(value) is int and value in (0, 1))):
        raise record_error(
            record, field, f"a label must be true or false (or 1 or 0), got {value!r}", "bad_value"
        )


class RecordMasker:
    """Turns record dicts into output arrays for one config and tokenizer: `layout` says what
    a record becomes (keys, dtypes), `parts` makes its sections' tokens and masks, `bundle`
    is the tokenizer they are made with (the config's chat template in it)."""

    def __init__(self, config: PipelineConfig, bundle: TokenizerBundle):
        self.config = config
        self.layout = OutputLayout(config)
        self.parts = PartMaker(config, bundle)
        self.bundle = self.parts.bundle
        self._dtypes = self.layout.dtypes()

    def take_premade(self, premade: Premade) -> None:
        """What a chunk preencoded and prerendered for its records (chunks.py), each taken once
        by its record's own pass."""
        self.parts.take_premade(premade)

    # --- processing ----------------------------------------------------------------------
    def process(
        self, data: dict | Record, source: str = "<record>", line: int = 0
    ) -> DocumentArrays:
        record = data if isinstance(data, Record) else Record(source, line, data)
        return self.process_counted(record)[0]

    def process_counted(self, record: Record) -> tuple[DocumentArrays, Tally]:
        """The record's arrays and its tally; a RecordError carries the tokens rendered so far.
        Its renderings share one time budget (chat/template.py)."""
        with record_budget():
            return self._process_counted(record)

    def _process_counted(self, record: Record) -> tuple[DocumentArrays, Tally]:
        if not isinstance(record.data, dict):
            raise record_error(record, None, "expected a JSON object", "not_object")
        record = remap(record, self.config.input)
        tally = Tally()
        try:
            # too long before a token is made: a 50 MB record is never tokenized
            check_chars(record, self.config, 0, raw_chars(record, self.config))
            try:
                out = self._outputs(record, tally)
            except RecordError as err:
                if err.reason == "no_trained_tokens":  # a filtered record counts as filtered
                    check_chars(record, self.config, tally.chars)
                raise
            check_chars(record, self.config, tally.chars)
        except RecordError as err:
            err.tokens = tally.tokens
            raise
        return out, tally

    def _outputs(self, record: Record, tally: Tally) -> DocumentArrays:
        if self.config.multi_output:
            return self._sources(record, tally)
        sections = self.config.input.sections
        ids, mask = self._fit(record, sections, self.parts.sections(record, sections, tally), tally)
        out: DocumentArrays = {"sequence": ids}
        if self.layout.single_needs_mask():
            out["loss_mask"] = mask
        if can_train(sections) and not mask.any():
            raise record_error(
                record,
                sections[0].field,
                "no token is trained after masking and truncation",
                "no_trained_tokens",
            )
        if self.config.output.position_ids_mode != "none":
            out["position_ids"] = np.arange(len(ids), dtype=np.int32)
        return out

    def _sources(self, record: Record, tally: Tally) -> DocumentArrays:
        record = with_shared_prompt(record, self.config)
        out: DocumentArrays = {}
        group_sizes: dict[str, int] = {}
        values: dict[str, np.ndarray] = {}
        untrained: RecordError | None = None  # raised once every source is rendered (the ledger)
        rendered = {
            key: self.parts.sections(record, sections, tally)
            for key, sections in self._joined_sources(record).items()
        }
        rendered = self._shared_turns(record, rendered, tally)
        for key, source in (self.config.input.sources or {}).items():
            section = source.sections[0]
            mask_key = self.layout.source_mask_key(key)
            if not present(record, source.sections):
                continue  # e.g. GRPO prompts without responses yet: prompts for online generation
            if section.action == "value":
                if key == "label":
                    check_label(record, section.field)
                values[key] = get_values(record, section.field, np.dtype(self._dtypes[key]))
                out[key] = values[key]
                continue
            if source.list_field:
                items = get_field(record, section.field)
                if not isinstance(items, list):
                    raise record_error(
                        record, section.field, f"expected a list, got {type(items).__name__}"
                    )
                if not items:
                    raise record_error(record, section.field, "empty group", "empty")
                pairs = [
                    self._fit(
                        record,
                        source.sections,
                        [
                            self.parts.one(
                                record, section, f"{section.field}[{j}]", item, True, tally
                            )
                        ],
                        tally,
                    )
                    for j, item in enumerate(items)
                ]
                out[key] = [ids for ids, _ in pairs]
                masks = [mask for _, mask in pairs]
                if can_train(source.sections) and not all(m.any() for m in masks):
                    untrained = untrained or record_error(
                        record, section.field, "an item trains no token", "no_trained_tokens"
                    )
                if mask_key:
                    out[mask_key] = masks
                group_sizes[key] = len(items)
            else:
                ids, mask = self._fit(record, source.sections, rendered[key], tally)
                out[key] = ids
                if can_train(source.sections) and not mask.any():
                    untrained = untrained or record_error(
                        record,
                        source.sections[0].field,
                        "no token is trained after masking and truncation",
                        "no_trained_tokens",
                    )
                if mask_key:
                    out[mask_key] = mask
        groups = [k for k, source in (self.config.input.sources or {}).items() if source.list_field]
        for vkey, vals in values.items():
            if groups and not group_sizes:  # GRPO's rewards score responses: none here
                raise record_error(
                    record,
                    vkey,
                    f"{len(vals)} value(s) but no {groups[0]!r} for them to score",
                    "bad_value",
                )
            for gkey, size in group_sizes.items():
                if len(vals) != size:
                    raise record_error(
                        record,
                        vkey,
                        f"{len(vals)} values for {size} items of {gkey!r}",
                        "bad_value",
                    )
        if untrained is not None:
            raise untrained
        if "chosen" in out and "rejected" in out and np.array_equal(out["chosen"], out["rejected"]):
            raise record_error(
                record,
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
            and present(record, source.sections)
        }

    def conversations(self, record: Record) -> list[Part]:
        """The conversations this record's own pass renders first, in order, not rendered yet:
        one per sequence (SFT's, each reply's of a preference pair), or none where a sequence
        holds text. What a chunk prerenders in one batch (chunks.py); raises what the
        record's own pass would."""
        record = remap(record, self.config.input)
        groups = [self.config.input.sections]
        if self.config.multi_output:
            record = with_shared_prompt(record, self.config)
            if is_standard(record, self.config):
                return []
            groups = list(self._joined_sources(record).values())
        tally = Tally()  # the record's own pass counts what it renders
        parts = []
        for sections in groups:
            chats = present(record, sections)
            if not chats or not all(s.template for s in chats):
                return []
            first = chats[0]
            value = get_field(record, first.field)
            chat = self.parts.chat(record, first, first.field, value, True, tally)
            for section in chats[1:]:
                value = get_field(record, section.field)
                chat = self.parts.continue_chat(record, chat, section, value, tally)
            parts.append(chat)
        return parts

    # --- truncation: what a record longer than max_seq_len keeps ------------------------
    def truncation(self, sections: list[Section]) -> str:
        """The policy for these sections (see truncation.resolve)."""
        return resolve(self.config.preprocessing.truncation_mode, sections)

    def _fit(
        self, record: Record, sections: list[Section], parts: list[Part], tally: Tally
    ) -> tuple[np.ndarray, np.ndarray]:
        """The parts joined and cut to max_seq_len by the sections' policy; cuts are tallied."""
        return fit(
            parts,
            self.config.preprocessing.max_seq_len,
            self.truncation(sections),
            can_train(sections),
            self.bundle.bos_id,
            self._rerender(record),
            tally,
            self.parts.header_ids,
        )

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
        return lambda part, kept: self.parts.with_messages(record, part, kept)
