"""Fields of a record: dotted-path lookup and the checks of chat messages.

Every failure is a `RecordError` naming the record's file, line and field.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import orjson

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


# ShareGPT's speaker names (`from`), as the tools that write ShareGPT data use them.
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "system": "system", "tool": "tool",
    "observation": "tool", "function_response": "tool", "function_call": "assistant",
}  # fmt: skip


def check_messages(
    record: Record, field: str, value: Any, roles: Collection[str] | None
) -> list[dict]:
    """A chat as the template takes it: a non-empty list of messages with a string "role"
    (roles None: any role) and a "content" that is a string, a list of text parts (joined),
    or null beside `tool_calls`. ShareGPT messages (`from`/`value`) come back with their
    role mapped (human -> user, gpt -> assistant, observation -> tool, ...). Other keys
    (`tool_calls`, `name`, `reasoning_content`) are kept for the template.

    Messages are indexed from 0 in errors (`messages[3].role`).
    """
    if not isinstance(value, list):
        raise _error(record, field, f"expected a list of messages, got {type_name(value)}")
    if not value:
        raise _error(record, field, "empty conversation", "empty")
    out = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise _error(record, where, f"expected a message object, got {type_name(message)}")
        if "role" not in message and "from" in message:
            message = _from_sharegpt(record, where, message)
        role = _message_string(record, where, message, "role")
        calls = message.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise _error(
                record,
                f"{where}.tool_calls",
                f"expected a list of objects, got {show_value(calls)}",
            )
        content = _content(record, where, message, allow_null=bool(calls))
        if roles is not None and role not in roles:
            expected = f"expected one of [{', '.join(sorted(roles))}], got {show_value(role)}"
            raise _error(record, f"{where}.role", expected, "unknown_role")
        out.append({**message, "content": content})
    return out


def _from_sharegpt(record: Record, where: str, message: dict) -> dict:
    speaker = _message_string(record, where, message, "from")
    _message_string(record, where, message, "value")
    if speaker not in SHAREGPT_ROLES:
        expected = (
            f"expected one of [{', '.join(sorted(SHAREGPT_ROLES))}], got {show_value(speaker)}"
        )
        raise _error(record, f"{where}.from", expected, "unknown_role")
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    if speaker == "function_call":  # LLaMA-Factory's tool call: {"name", "arguments"} as JSON
        call = _json_value(record, f"{where}.value", message["value"])
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            raise _error(record, f"{where}.value", "expected a function call {name, arguments}")
        function = {"name": call["name"], "arguments": call.get("arguments", {})}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": function}],
            **rest,
        }
    return {"role": SHAREGPT_ROLES[speaker], "content": message["value"], **rest}


def _json_value(record: Record, field: str, text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise _error(record, field, f"not valid JSON: {err}", "bad_value") from None


def _content(record: Record, where: str, message: dict, allow_null: bool) -> str | None:
    """A message's text: a string, text parts joined, or None beside tool calls."""
    content = message.get("content")
    if content is None and allow_null:
        return None
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise _error(
                    record,
                    f"{where}.content[{j}]",
                    f"expected a text part {{type: text, text}}, got {show_value(part)}",
                )
            texts.append(part["text"])
        return "".join(texts)
    return _message_string(record, where, message, "content")


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
