"""Filters: the valid records a config excludes (too short, too long, nothing to train, a
preference pair whose two sides are the same tokens).

A filtered record is dropped and counted by reason under any `--on-error`; only a
malformed record is an error. The length filter runs twice: on the raw characters before
anything is rendered (a 50 MB record is never tokenized), and on the rendered text's.
"""

from __future__ import annotations

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.inputs.fields import record_error
from tokenmill.preprocess.inputs.records import Record

# Reasons that are filters (the record is fine, the config excludes it): always counted, never fatal.
FILTER_REASONS = ("too_short", "too_long", "no_trained_tokens", "identical_pair")


def raw_chars(record: Record, config: PipelineConfig) -> int:
    """The characters of the record's text fields, counted without rendering anything."""
    total = 0
    for section in config.all_sections():
        value = record.data.get(section.field) if "." not in section.field else None
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, dict):  # a chat message: its text
                text = item.get("content", item.get("value"))
                total += len(text) if isinstance(text, str) else 0
    return total


def check_chars(record: Record, config: PipelineConfig, chars: int, raw: int | None = None) -> None:
    """The length filter: on the rendered text's characters, or (`raw`) before any
    rendering, where only a record too long to tokenize is dropped."""
    pre = config.preprocessing
    if raw is not None:
        chars = raw
        if chars <= pre.max_chars:
            return
    if chars < pre.min_chars:
        message = f"{chars} characters, fewer than min_chars={pre.min_chars}"
        raise record_error(record, None, message, "too_short")
    if chars > pre.max_chars:
        message = f"{chars} characters, more than max_chars={pre.max_chars}"
        raise record_error(record, None, message, "too_long")
