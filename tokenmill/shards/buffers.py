"""One shard's records in memory, key by key, until the writer publishes them.

The first record fixes the keys, which of them are lists (GRPO groups) and their dtypes;
every later record must match, so a shard never mixes layouts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from tokenmill.shards.format import (
    DTYPES,
    KEY_RE,
    OFFSET_DTYPE,
    Column,
    cast,
    flat,
    is_list_value,
)


class ColumnBuffer:
    """Collects one key's values record by record; build() gives the shard's Column."""

    def __init__(self, key: str, is_list: bool):
        self.key = key
        self.is_list = is_list
        self.parts: list[np.ndarray] = []
        self.lengths: list[int] = []  # per record (plain) or per item (list key)
        self.item_counts: list[int] = []  # per record, list keys only

    def add(self, value: Any) -> int:
        """Adds one record's value (kept by reference, not copied); returns its element count."""
        if self.is_list:
            if not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"key {self.key!r}: expected a list of arrays in every record, like the first"
                )
            arrays = [flat(v, self.key) for v in value]
            lengths = [len(a) for a in arrays]
            self.parts += arrays
            self.lengths += lengths
            self.item_counts.append(len(arrays))
            return sum(lengths)
        if is_list_value(value):
            raise ValueError(
                f"key {self.key!r}: expected one array in every record, like the first"
            )
        array = flat(value, self.key)
        self.parts.append(array)
        self.lengths.append(len(array))
        return len(array)

    def build(self, dtype: str) -> Column:
        values = np.concatenate(self.parts) if self.parts else np.empty(0, DTYPES[dtype])
        values = cast(values, dtype, f"key {self.key!r}")
        bounds = offsets_of(self.lengths)
        if self.is_list:
            return Column(values, offsets_of(self.item_counts), bounds)
        return Column(values, bounds)


def offsets_of(lengths: list[int]) -> np.ndarray:
    """Offsets (int64, from 0) of consecutive pieces of these lengths."""
    out = np.zeros(len(lengths) + 1, OFFSET_DTYPE)
    np.cumsum(lengths, out=out[1:])
    return out


class ShardBuffer:
    """One shard's records in memory, key by key; the first record fixes keys, list keys, dtypes.

    A key missing from `dtypes` keeps its array's dtype (which must be one of DTYPES).
    """

    def __init__(self, dtypes: dict[str, str] | None = None):
        self.dtypes = dict(dtypes or {})
        self.keys: list[str] | None = None
        self.list_keys: set[str] = set()
        self.clear()

    def clear(self) -> None:
        self.columns: dict[str, ColumnBuffer] = {}
        self.records = 0

    def check(self, record: dict[str, Any]) -> None:
        if self.keys is None:
            for key, value in record.items():
                if key not in self.dtypes:
                    sample = value[0] if is_list_value(value) else value
                    self.dtypes[key] = np.asarray(sample).dtype.name
                if not KEY_RE.match(key):
                    raise ValueError(
                        f"key {key!r} cannot name a file; use letters, digits, _ and -"
                    )
                if self.dtypes[key] not in DTYPES:
                    raise ValueError(
                        f"key {key!r}: dtype {self.dtypes[key]!r} is not one of {sorted(DTYPES)}"
                    )
            self.keys = list(record)
            self.list_keys = {k for k, v in record.items() if is_list_value(v)}
        elif record.keys() != set(self.keys):
            missing = sorted(set(self.keys) - set(record))
            extra = sorted(set(record) - set(self.keys))
            raise ValueError(
                f"record keys differ from the first record's: missing {missing}, unexpected {extra}"
            )

    def add(self, record: dict[str, Any]) -> None:
        self.check(record)
        for key in self.keys or []:
            self.columns.setdefault(key, ColumnBuffer(key, key in self.list_keys)).add(record[key])
        self.records += 1

    def build(self) -> dict[str, Column]:
        return {
            key: self.columns[key].build(self.dtypes[key])
            for key in self.keys or []
            if key in self.columns
        }


def jsonl_line(record: dict[str, Any], dtypes: dict[str, str]) -> bytes:
    """One output record as a JSONL line: ints as lists, floats as floats, bools as 0/1."""

    def plain(arr: np.ndarray, dtype: str, where: str) -> list:
        arr = cast(flat(arr, where), dtype, where)
        if arr.dtype.kind == "b":
            return arr.astype(np.uint8).tolist()
        if arr.dtype.kind == "f":
            return [float(str(x)) for x in arr]  # shortest text that reads back as the same float32
        return arr.tolist()

    out = {}
    for key, value in record.items():
        where = f"key {key!r}"
        out[key] = (
            [plain(v, dtypes[key], where) for v in value]
            if is_list_value(value)
            else plain(value, dtypes[key], where)
        )
    return orjson.dumps(out) + b"\n"
