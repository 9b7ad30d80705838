"""The shard format's vocabulary: names, dtypes, limits, and the counts every layer shares.

A dataset folder holds shard folders (`shard_NNNNN/`: `meta.json` and one flat `<key>.bin`
per key, record offsets beside it) or JSONL parts, and `manifest.json`;
docs/dataflow.md section 2 is the contract.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import xxhash

FORMAT_VERSION = 1


DtypeName = Literal[
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
    "float16", "float32", "float64",
]  # fmt: skip
DTYPES = {name: np.dtype(name).newbyteorder("<") for name in get_args(DtypeName)}


OFFSET_DTYPE = np.dtype("<i8")


StorageFormat = Literal["bin", "jsonl"]
STORAGE_FORMATS: tuple[str, ...] = get_args(StorageFormat)


TMP_MARK = ".tmp-"
RUN_DIR = ".tokenmill-run"  # a run in progress: its journal; gone once the manifest lands


KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


@dataclass
class Column:
    """One key of one shard in memory: flat values, int64 record offsets, int64 item bounds."""

    values: np.ndarray
    offsets: np.ndarray | None
    items: np.ndarray | None = None


def checksum(data: np.ndarray | bytes) -> str:
    """xxh64 of an array's bytes, or of bytes: what meta.json and the manifest record."""
    return xxhash.xxh64(
        data if isinstance(data, bytes) else np.ascontiguousarray(data).data
    ).hexdigest()


PAGE_BYTES = 1 << 20  # each file's pages get their own xxh64: what integrity="sampled" checks


class FileHashes:
    """xxh64 of a file's bytes as they are written, whole and per PAGE_BYTES page, so a reader
    can check a few pages of a shard without reading all of it."""

    def __init__(self) -> None:
        self.whole, self.page = xxhash.xxh64(), xxhash.xxh64()
        self.filled = 0  # bytes in the open page
        self.pages: list[str] = []  # hex digests of the full pages

    def update(self, data: np.ndarray | bytes) -> None:
        view = (
            memoryview(data) if isinstance(data, bytes) else np.ascontiguousarray(data).data
        ).cast("B")
        self.whole.update(view)
        while len(view):
            take = min(PAGE_BYTES - self.filled, len(view))
            self.page.update(view[:take])
            self.filled, view = self.filled + take, view[take:]
            if self.filled == PAGE_BYTES:
                self.pages.append(self.page.hexdigest())
                self.page.reset()
                self.filled = 0

    def entry(self) -> dict:
        """meta.json's checksum fields: `xxh64` of the whole file, and `pages` (page size and
        the pages' xxh64 digests, 16 hex digits each, concatenated)."""
        last = [self.page.hexdigest()] if self.filled else []
        digests = "".join(self.pages + last)
        return {"xxh64": self.whole.hexdigest(), "pages": {"bytes": PAGE_BYTES, "xxh64": digests}}


def file_hashes(data: np.ndarray) -> dict:
    hashes = FileHashes()
    hashes.update(data)
    return hashes.entry()


def cast(values: np.ndarray, dtype: str, where: str) -> np.ndarray:
    """values as `dtype`, little-endian; refuses a cast that would change a value."""
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    target = DTYPES[dtype]
    values = np.asarray(values)
    if values.dtype == target:
        return np.ascontiguousarray(values)
    if values.dtype.kind in "iub" and target.kind in "iub" and values.size:
        low, high = (0, 1) if target.kind == "b" else (np.iinfo(target).min, np.iinfo(target).max)
        if values.min() < low or values.max() > high:
            raise ValueError(
                f"{where}: values in [{values.min()}, {values.max()}] do not fit {dtype}"
            )
    elif values.dtype.kind == "f" and target.kind in "iub" and values.size:
        if not np.array_equal(values, values.astype(target)):
            raise ValueError(f"{where}: float values do not fit {dtype} exactly")
    return np.ascontiguousarray(values, dtype=target)


def flat(value: Any, where: str) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype != object:
        return value
    arr = np.asarray(value)
    if arr.dtype == object or arr.ndim > 1:
        raise ValueError(f"{where}: expected a flat array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.reshape(-1)


def is_list_value(value: Any) -> bool:
    """A list key's value is a list of arrays (GRPO responses / masks)."""
    return isinstance(value, (list, tuple)) and any(
        isinstance(v, (np.ndarray, list, tuple)) for v in value
    )


def row_tokens(value: Any) -> int:
    """Tokens of one output value: an array, a list of ints (JSONL) or a list of arrays/lists (groups)."""
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float)):
        return sum(len(v) for v in value)
    return len(value)


def trained_count(mask: Any) -> int:
    """True values of one mask value: an array (or tensor), or a list of them (groups)."""
    if isinstance(mask, (list, tuple)):
        return sum(int(np.count_nonzero(m)) for m in mask)
    return int(np.count_nonzero(mask))


def shard_name(index: int, storage_format: str) -> str:
    return f"part_{index:05d}.jsonl" if storage_format == "jsonl" else f"shard_{index:05d}"


def is_shard_name(name: str) -> bool:
    """A name `shard_name` writes (or may write): never a domain folder's name."""
    return re.fullmatch(r"shard_\d+|part_\d+\.jsonl", name) is not None


def opens_document(first_positions: Any) -> np.ndarray:
    """Which row pieces (`doc_lengths`) start a document, from each piece's first position:
    one that does not start at 0 is the rest of the document before it (`stream` packing
    cuts documents at rows); the first piece always opens one."""
    opens = np.asarray(first_positions) == 0
    if len(opens):
        opens[0] = True
    return opens


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def bounds_count(bounds: list | dict) -> int:
    """Number of values of an offsets/items entry, inline (seed) or in a file."""
    return len(bounds) if isinstance(bounds, list) else bounds["count"]


def shard_records(meta: dict) -> int:
    """Records of a shard: from any key with offsets; 0 for a stream-only (seed) shard."""
    return next((bounds_count(e["offsets"]) - 1 for e in meta.values() if "offsets" in e), 0)


def is_tmp(path: Path) -> bool:
    return any(TMP_MARK in part for part in path.parts)


def natural_key(path: Path) -> tuple:
    """Sort key in which shard_100000 follows shard_99999."""
    return tuple(
        tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", part))
        for part in path.parts
    )


def primary_key(keys: list[str]) -> str:
    """The key whose elements count as tokens: `sequence`, else the first key."""
    return "sequence" if "sequence" in keys else keys[0]
