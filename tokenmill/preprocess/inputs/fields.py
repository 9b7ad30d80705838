"""Fields of a record: dotted-path lookup and the checks of chat messages.

Every failure is a `RecordError` naming the record's file, line and field.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import numpy as np
import orjson

from tokenmill.preprocess.inputs.records import Record, RecordError, show_value, type_name


def record_error(
    record: Record, field: str | None, message: str, reason: str = "wrong_type"
) -> RecordError:
    """The error of a bad `field` of this record (None: the record as a whole), named by its
    file and line: the one way a record's error says where it is."""
    return RecordError(record.source, record.line, field, message, reason)


def get_field(record: Record, path: str) -> Any:
    """Value at `path` ("text" or dotted "meta.lang"); missing and null are both missing_field."""
    value: Any = record.data
    walked: list[str] = []
    for key in path.split("."):
        if not isinstance(value, dict):
            raise record_error(
                record, ".".join(walked), f"expected an object, got {type_name(value)}"
            )
        walked.append(key)
        if key not in value:
            keys = ", ".join(list(value)[:10]) + (", ..." if len(value) > 10 else "")
            message = f"missing field (record has: {keys or 'no fields'})"
            if len(walked) == 1 and value:  # a key of another name may hold it
                message += f"; map one with input.columns: {{{key}: <its key>}}"
            raise record_error(record, ".".join(walked), message, "missing_field")
        value = value[key]
        if value is None:
            raise record_error(record, ".".join(walked), "is null", "missing_field")
    return value


# ShareGPT's speaker names (`from`), as the tools that write ShareGPT data use them.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}


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
        raise record_error(record, field, f"expected a list of messages, got {type_name(value)}")
    if not value:
        raise record_error(record, field, "empty conversation", "empty")
    out = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise record_error(
                record, where, f"expected a message object, got {type_name(message)}"
            )
        if "role" not in message and "from" in message:
            message = _from_sharegpt(record, where, message)
        role = _message_string(record, where, message, "role")
        calls = message.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise record_error(
                record,
                f"{where}.tool_calls",
                f"expected a list of objects, got {show_value(calls)}",
            )
        content = _content(record, where, message, allow_null=bool(calls))
        if roles is not None and role not in roles:
            expected = f"expected one of [{', '.join(sorted(roles))}], got {show_value(role)}"
            raise record_error(record, f"{where}.role", expected, "unknown_role")
        out.append({**message, "content": content})
    return out


def _from_sharegpt(record: Record, where: str, message: dict) -> dict:
    speaker = _message_string(record, where, message, "from")
    _message_string(record, where, message, "value")
    if speaker not in SHAREGPT_ROLES:
        expected = (
            f"expected one of [{', '.join(sorted(SHAREGPT_ROLES))}], got {show_value(speaker)}"
        )
        raise record_error(record, f"{where}.from", expected, "unknown_role")
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    if speaker == "function_call":  # LLaMA-Factory's tool call: {"name", "arguments"} as JSON
        call = _json_value(record, f"{where}.value", message["value"])
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            raise record_error(
                record, f"{where}.value", "expected a function call {name, arguments}"
            )
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
        raise record_error(record, field, f"not valid JSON: {err}", "bad_value") from None


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
                raise record_error(
                    record,
                    f"{where}.content[{j}]",
                    f"expected a text part {{type: text, text}}, got {show_value(part)}",
                )
            texts.append(part["text"])
        return "".join(texts)
    return _message_string(record, where, message, "content")


def _message_string(record: Record, where: str, message: dict, key: str) -> str:
    field = f"{where}.{key}"
    if key not in message:
        raise record_error(record, field, "missing field", "missing_field")
    value = message[key]
    if value is None:
        raise record_error(record, field, "is null", "missing_field")
    if not isinstance(value, str):
        raise record_error(
            record, field, f"expected a string, got {type_name(value)} {show_value(value)}"
        )
    return value


def get_tools(record: Record, field: str | None) -> list[dict] | None:
    """The record's tool schemas (a list of objects), if its `tools_field` holds any."""
    data = record.data
    if field is None or data.get(field) is None:
        return None
    tools = data[field]
    if isinstance(tools, str):  # as LLaMA-Factory's ShareGPT data keeps them: JSON text
        tools = _json_value(record, field, tools)
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise record_error(
            record, field, f"expected a list of tool schemas (objects), got {type(tools).__name__}"
        )
    return tools


def get_values(record: Record, field: str, dtype: np.dtype) -> np.ndarray:
    """A value field (a number or a list of them: GRPO rewards, a KTO label), each checked to
    be finite and to fit the key's stored dtype."""
    value = get_field(record, field)
    items = value if isinstance(value, list) else [value]
    for j, v in enumerate(items):
        where = f"{field}[{j}]" if isinstance(value, list) else field
        if not isinstance(v, (int, float)):  # a bool counts: KTO's label, stored 1.0 / 0.0
            raise record_error(record, where, f"expected a number, got {type(v).__name__}")
        if not math.isfinite(v):
            raise record_error(record, where, f"not a finite number: {v}", "bad_value")
        problem = _unrepresentable(v, dtype)
        if problem:
            raise record_error(record, where, problem, "bad_value")
    return np.asarray(items, dtype=np.float32)


def _unrepresentable(value: float, dtype: np.dtype) -> str | None:
    """Why `value` cannot be stored as `dtype` unchanged (1e39 as float32 would be inf)."""
    if dtype.kind == "f":
        if abs(value) > float(np.finfo(dtype).max):
            return f"{value} is beyond the range of {dtype.name}"
        return None
    if dtype.kind in "iub":
        low, high = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        if float(value) != int(value) or not low <= int(value) <= high:
            return f"{value} is not a {dtype.name} value"
    return None
