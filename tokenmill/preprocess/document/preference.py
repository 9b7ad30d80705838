"""Preference data as TRL writes it: an implicit prompt made explicit, and the standard (text)
format told from the conversational one."""

from __future__ import annotations

import os
from typing import Any

from tokenmill.preprocess.config import PipelineConfig, Section
from tokenmill.preprocess.inputs.fields import record_error
from tokenmill.preprocess.inputs.records import Record


def with_shared_prompt(record: Record, config: PipelineConfig) -> Record:
    """An implicit prompt made explicit (TRL's `extract_prompt`): the longest prefix all
    sources' replies share, messages or text, moved into the `shared_prompt` field."""
    name = config.input.shared_prompt
    if name is None or record.data.get(name) is not None:
        return record
    fields = [s.sections[-1].field for s in (config.input.sources or {}).values()]
    values: list[Any] = [record.data.get(f) for f in fields]
    if len(values) < 2 or not all(isinstance(v, (str, list)) for v in values):
        return record
    if all(isinstance(v, str) for v in values):  # TRL's rule: up to the first difference,
        cut = len(os.path.commonprefix(values))  # less the space before it
        cut -= int(cut > 0 and values[0][cut - 1] == " ")
    elif all(isinstance(v, list) for v in values):
        cut = 0
        while all(cut < len(v) - 1 for v in values) and all(
            v[cut] == values[0][cut] for v in values
        ):
            cut += 1  # each reply keeps at least its last message
        if any(_role(v[cut]) != "assistant" for v in values):  # they part before a reply
            raise record_error(
                record,
                fields[1],
                f"the conversations of {' and '.join(fields)} differ at message {cut}, before "
                "their replies: a pair must share its prompt",
                "bad_value",
            )
    else:
        return record
    if cut <= 0:
        return record
    data = {
        **record.data,
        name: values[0][:cut],
        **{f: v[cut:] for f, v in zip(fields, values)},
    }
    return Record(record.source, record.line, data)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def is_standard(record: Record, config: PipelineConfig) -> bool:
    """Preference data in TRL's standard format: every chat field it has holds text."""
    if not config.multi_output:
        return False
    sources = (config.input.sources or {}).values()
    sections = [s for source in sources for s in source.sections]
    fields = {s.field for s in sections if s.template and record.data.get(s.field) is not None}
    return bool(fields) and all(isinstance(record.data[f], str) for f in fields)


def as_text(section: Section) -> Section:
    """A chat section given plain text (TRL's standard format): the text itself, a prompt
    masked, a reply trained and closed with EOS, as TRL tokenizes such data."""
    trains = section.action in ("train", "$role")
    return section.model_copy(
        update={"template": False, "action": "train" if trains else "mask", "eos": trains}
    )
