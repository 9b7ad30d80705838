"""One record -> its output arrays (tokens, loss masks, values), as the config says.

Sits between records.py (validated raw JSON) and packing/shards: everything a
trainer will learn from is decided here, so every rule is explicit and every
bad record raises a RecordError naming file, line and field.
"""

from __future__ import annotations

import math
from typing import Any

import jinja2
import numpy as np

from tokenmill.preprocess.config import PipelineConfig, Section
from tokenmill.preprocess.fields import check_messages, get_field
from tokenmill.preprocess.records import Record, RecordError
from tokenmill.preprocess.spans import render_conversation
from tokenmill.preprocess.tokenizer import TokenizerBundle, encode_text

RecordArrays = dict[str, "np.ndarray | list[np.ndarray]"]


# Reasons that are filters (the record is fine, the config excludes it): always counted, never fatal.
FILTER_REASONS = ("too_short", "too_long")


def key_dtype(key: str, config: PipelineConfig, value_keys: set[str]) -> str:
    """Stored dtype of an output key: config override, else bool masks, float32 values, int32 ids."""
    if key in config.output.dtype:
        return config.output.dtype[key]
    if key in value_keys:
        return "float32"
    if key == "loss_mask" or key == "masks" or key.endswith("_mask"):
        return "bool"
    return "int32"


class RecordMasker:
    """Turns record dicts into output arrays for one config and tokenizer."""

    def __init__(self, config: PipelineConfig, bundle: TokenizerBundle):
        self.config = config
        self.bundle = bundle
        self.roles = config.known_roles()

    # --- what this config writes -------------------------------------------------------
    def output_keys(self) -> list[str]:
        if not self.config.multi_output:
            keys = ["sequence"]
            if self.single_needs_mask():
                keys.append("loss_mask")
            if self.config.output.position_ids_mode != "none":
                keys.append("position_ids")
            return keys
        keys = []
        for key in self.config.input.sources or {}:
            keys.append(key)
            mask_key = self.source_mask_key(key)
            if mask_key:
                keys.append(mask_key)
        return keys

    def value_keys(self) -> set[str]:
        sources = self.config.input.sources or {}
        return {k for k, s in sources.items() if s.sections[0].action == "value"}

    def dtypes(self) -> dict[str, str]:
        values = self.value_keys()
        return {k: key_dtype(k, self.config, values) for k in self.output_keys()}

    def primary_key(self) -> str:
        return self.output_keys()[0]

    def single_needs_mask(self) -> bool:
        return _needs_mask(self.config.input.sections)

    def source_mask_key(self, key: str) -> str | None:
        source = (self.config.input.sources or {})[key]
        if source.sections[0].action == "value":
            return None
        if source.mask_key:
            return source.mask_key
        return (
            f"{key}_mask" if _needs_mask(source.sections) and _can_train(source.sections) else None
        )

    # --- processing ----------------------------------------------------------------------
    def process(self, data: dict | Record, source: str = "<record>", line: int = 0) -> RecordArrays:
        record = data if isinstance(data, Record) else Record(source, line, data)
        if not isinstance(record.data, dict):
            raise RecordError(
                record.source, record.line, None, "expected a JSON object", "not_object"
            )
        counter = [0]
        try:
            out = self._outputs(record, counter)
        except RecordError as err:
            if err.reason == "no_trained_tokens":
                self._check_chars(record, counter[0])  # a filtered record is counted as filtered
            raise
        self._check_chars(record, counter[0])
        return out

    def _outputs(self, record: Record, counter: list[int]) -> RecordArrays:
        if not self.config.multi_output:
            ids, mask = self._sections(record, self.config.input.sections, counter)
            ids, mask = self._truncate(ids, mask)
            out: RecordArrays = {"sequence": ids}
            if self.single_needs_mask():
                out["loss_mask"] = mask
            if _can_train(self.config.input.sections) and not mask.any():
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
            out = self._sources(record, counter)
        return out

    def _sources(self, record: Record, counter: list[int]) -> RecordArrays:
        out: RecordArrays = {}
        group_sizes: dict[str, int] = {}
        values: dict[str, np.ndarray] = {}
        for key, source in (self.config.input.sources or {}).items():
            section = source.sections[0]
            mask_key = self.source_mask_key(key)
            if section.action == "value":
                values[key] = self._value(record, section)
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
                    self._one(record, section, f"{section.field}[{j}]", item, True, counter)
                    for j, item in enumerate(items)
                ]
                pairs = [self._truncate(ids, mask) for ids, mask in pairs]
                out[key] = [ids for ids, _ in pairs]
                masks = [mask for _, mask in pairs]
                if _can_train(source.sections) and not all(m.any() for m in masks):
                    raise RecordError(
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
                ids, mask = self._sections(record, source.sections, counter)
                ids, mask = self._truncate(ids, mask)
                out[key] = ids
                if _can_train(source.sections) and not mask.any():
                    raise RecordError(
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
        return out

    def _sections(
        self, record: Record, sections: list[Section], counter: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        ids_parts, mask_parts = [], []
        for i, section in enumerate(sections):
            value = get_field(record, section.field)
            ids, mask = self._one(record, section, section.field, value, i == 0, counter)
            ids_parts.append(ids)
            mask_parts.append(mask)
        ids = np.concatenate(ids_parts).astype(np.int32, copy=False)
        mask = np.concatenate(mask_parts).astype(bool, copy=False)
        return ids, mask

    def _one(
        self,
        record: Record,
        section: Section,
        field: str,
        value: Any,
        first: bool,
        counter: list[int],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and mask of one section value (a chat or a text)."""
        if section.template:
            messages = check_messages(record, field, value, self.roles)
            if section.action == "$role":
                actions = [self.config.role_trains(m["role"]) for m in messages]
            else:
                actions = [section.action == "train"] * len(messages)
            counter[0] += sum(len(m["content"]) for m in messages)
            try:
                ids, mask = render_conversation(
                    self.bundle, messages, actions, add_generation_prompt=section.generation_prompt
                )
            except (
                ValueError,
                TypeError,
                KeyError,
                AttributeError,
                IndexError,
                jinja2.TemplateError,
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
        else:
            if not isinstance(value, str):
                raise RecordError(
                    record.source,
                    record.line,
                    field,
                    f"expected a string, got {type(value).__name__}",
                    "wrong_type",
                )
            counter[0] += len(value)
            add_special = (
                section.add_special_tokens if section.add_special_tokens is not None else first
            )
            ids = encode_text(self.bundle, value, add_special_tokens=add_special)
            mask = np.full(len(ids), section.action == "train", dtype=bool)
            if (
                add_special
                and self.bundle.bos_id is not None
                and len(ids)
                and ids[0] == self.bundle.bos_id
            ):
                mask[0] = False
        if section.eos:
            if self.bundle.eos_id is None:
                raise ValueError(
                    f"section {section.field!r} asks for eos but the tokenizer has no eos token"
                )
            ids = np.append(ids, np.int32(self.bundle.eos_id))
            mask = np.append(mask, section.action != "mask")
        return ids.astype(np.int32, copy=False), mask

    def _value(self, record: Record, section: Section) -> np.ndarray:
        value = get_field(record, section.field)
        items = value if isinstance(value, list) else [value]
        for j, v in enumerate(items):
            where = f"{section.field}[{j}]" if isinstance(value, list) else section.field
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RecordError(
                    record.source,
                    record.line,
                    where,
                    f"expected a number, got {type(v).__name__}",
                    "wrong_type",
                )
            if not math.isfinite(v):
                raise RecordError(
                    record.source, record.line, where, f"not a finite number: {v}", "bad_value"
                )
        return np.asarray(items, dtype=np.float32)

    def _truncate(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cut to max_seq_len; keep_end keeps a leading BOS (masked) so a record still starts with one."""
        limit = self.config.preprocessing.max_seq_len
        if len(ids) <= limit:
            return ids, mask
        if self.config.preprocessing.truncation_mode == "keep_start":
            return ids[:limit], mask[:limit]
        bos = self.bundle.bos_id
        if bos is not None and ids[0] == bos and limit > 1:
            return np.concatenate([ids[:1], ids[-(limit - 1) :]]), np.concatenate(
                [[False], mask[-(limit - 1) :]]
            )
        return ids[-limit:], mask[-limit:]

    def _check_chars(self, record: Record, chars: int) -> None:
        pre = self.config.preprocessing
        if chars < pre.min_chars:
            raise RecordError(
                record.source,
                record.line,
                None,
                f"{chars} characters, fewer than min_chars={pre.min_chars}",
                "too_short",
            )
        if chars > pre.max_chars:
            raise RecordError(
                record.source,
                record.line,
                None,
                f"{chars} characters, more than max_chars={pre.max_chars}",
                "too_long",
            )


def _needs_mask(sections: list[Section]) -> bool:
    return any(s.template or s.action == "mask" for s in sections)


def _can_train(sections: list[Section]) -> bool:
    return any(s.action in ("train", "$role") for s in sections)
