"""Fields of a record: dotted-path lookup and the checks of chat messages.

Every failure is a `RecordError` naming the record's file, line and field.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tokenmill.preprocess.records import Record, RecordError, show_value, type_name


def get_field(record: Record, path: str) -> Any:
    """Value at `path` ("text" or dotted "meta.lang"); missing and null are both missing_field."""
    value: Any = record.data
    walked: list[str] = []
    for key in path.split("."):
        if not isinstance(value, dict):
            raise _error(record, ".".join(walked), f"expected an object, got {type_name(value)}")
        walked.append(key)
        if key not in value:
            keys = ", ".join(list(value)[:10]) + (", ..." if len(value) > 10 else "")
            message = f"missing field (record has: {keys or 'no fields'})"
            raise _error(record, ".".join(walked), message, "missing_field")
        value = value[key]
        if value is None:
            raise _error(record, ".".join(walked), "is null", "missing_field")
    return value


def check_messages(
    record: Record, field: str, value: Any, roles: Collection[str] | None
) -> list[dict]:
    """A chat: a non-empty list of objects with string "role" and "content" (roles None: any role).

    Messages are indexed from 0 in errors (`messages[3].role`); other keys are kept.
    """
    if not isinstance(value, list):
        raise _error(record, field, f"expected a list of messages, got {type_name(value)}")
    if not value:
        raise _error(record, field, "empty conversation", "empty")
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise _error(record, where, f"expected a message object, got {type_name(message)}")
        role = _message_string(record, where, message, "role")
        _message_string(record, where, message, "content")
        if roles is not None and role not in roles:
            expected = f"expected one of [{', '.join(sorted(roles))}], got {show_value(role)}"
            raise _error(record, f"{where}.role", expected, "unknown_role")
    return list(value)


def _error(record: Record, field: str, message: str, reason: str = "wrong_type") -> RecordError:
    return RecordError(record.source, record.line, field, message, reason)


def _message_string(record: Record, where: str, message: dict, key: str) -> str:
    field = f"{where}.{key}"
    if key not in message:
        raise _error(record, field, "missing field", "missing_field")
    value = message[key]
    if value is None:
        raise _error(record, field, "is null", "missing_field")
    if not isinstance(value, str):
        raise _error(
            record, field, f"expected a string, got {type_name(value)} {show_value(value)}"
        )
    return value
