"""Record shapes mapped onto the config's names, so data in another tool's shape needs no glue.

`input.columns` says which record key holds each field the sections read (LLaMA-Factory's
dataset_info `columns`, axolotl's `field_messages`), the first key a record has winning;
`input.message_fields` which message key holds each message property (axolotl's
`message_property_mappings`, LLaMA-Factory's `role_tag`/`content_tag`); `input.roles` which
names a record gives each role (LLaMA-Factory's `user_tag`, `assistant_tag`, ...). A record
is mapped once, before anything reads it; a field it already has is left as it is.
"""

from __future__ import annotations

from tokenmill.preprocess.config import InputConfig
from tokenmill.preprocess.inputs.records import Record


def remap(record: Record, config: InputConfig) -> Record:
    """The record as the config's sections name it; the record itself where nothing maps."""
    if not (config.columns or config.message_fields or config.roles):
        return record
    data = dict(record.data)
    for field, keys in config.columns.items():
        if data.get(field) is None:
            key = next((k for k in keys if data.get(k) is not None), None)
            if key is not None:
                data[field] = data[key]
    if config.message_fields or config.roles:
        for field in chat_fields(config):
            value = data.get(field)
            if isinstance(value, list):
                data[field] = [_message(m, config) for m in value]
    return Record(record.source, record.line, data)


def chat_fields(config: InputConfig) -> list[str]:
    """The fields chat sections read (rendered through the template)."""
    return list(dict.fromkeys(s.field for s in config.all_sections() if s.template))


def _message(message: object, config: InputConfig) -> object:
    if not isinstance(message, dict):
        return message  # check_messages names it
    out = dict(message)
    for prop, key in config.message_fields.items():
        if prop not in out and key in out:
            out[prop] = out.pop(key)
    role = out.get("role")
    for name, aliases in config.roles.items():
        if role in aliases:
            out["role"] = name
            break
    return out
