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
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "float16",
    "float32",
    "float64",
]
DTYPES = {name: np.dtype(name).newbyteorder("<") for name in get_args(DtypeName)}


OFFSET_DTYPE = np.dtype("<i8")


StorageFormat = Literal["bin", "jsonl"]
STORAGE_FORMATS: tuple[str, ...] = get_args(StorageFormat)


TMP_MARK = ".tmp-"
RUN_DIR = ".tokenmill-run"  # a run in progress: its tasks' records; gone once the manifest lands


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


def shard_name(index: int, storage_format: str, task: int | None = None) -> str:
    """`shard_TTTTT_III` (or `part_TTTTT_III.jsonl`): shard III of preprocessing task TTTTT, so
    that each task names its own shards without asking anyone; `task=None` gives the names of
    datasets written before tasks wrote their own shards (`shard_NNNNN`)."""
    stem = f"{index:05d}" if task is None else f"{task:05d}_{index:03d}"
    return f"part_{stem}.jsonl" if storage_format == "jsonl" else f"shard_{stem}"


def is_shard_name(name: str) -> bool:
    """A name `shard_name` writes (or may write): never a domain folder's name."""
    return re.fullmatch(r"shard_\d+(_\d+)?|part_\d+(_\d+)?\.jsonl", name) is not None


NO_POSITION = -2  # the position "before" a stream's first piece: there is none, so it opens one


def opens_document(first: Any, before: Any) -> np.ndarray:
    """Which pieces of a token stream open a document (the one rule for where documents
    start), from each piece's first position and the position of the token right before it
    (NO_POSITION where there is none). A piece goes on with the document before it exactly
    when its positions go on by one from that token: the rest of a document that `stream`
    packing cut at a row's end, or that bfd_split placed right after its pieces. Any other
    piece opens one: its positions restart at 0, or jump.

    A piece is a row's stored `doc_lengths` entry; a row, where a dataset stores none; a
    single token, where rows do not store their documents but positions tell them. Only
    positions that restart at each document tell (`positions_mark_documents`): where they do
    not, every piece opens a document."""
    return np.asarray(first) != np.asarray(before) + 1


def positions_mark_documents(manifest: dict | None) -> bool:
    """Whether a dataset's `position_ids` tell its documents apart: `doc_reset`'s restart at
    each one, and a dataset that does not say (no manifest, or one without a config: seed
    shards, an import) is taken to be doc_reset's; `continuous` positions count through a
    row, so they tell nothing."""
    config = (manifest or {}).get("config") or {}
    return (config.get("output") or {}).get("position_ids_mode") in (None, "doc_reset")


class DocumentLengths:
    """The lengths of the documents of one token stream (a domain's), read shard by shard in
    order: each shard's pieces joined where `opens_document` says one goes on with the
    document before it, across shard ends too. `marks`: whether the stream's positions tell
    documents apart (`positions_mark_documents`)."""

    def __init__(self, marks: bool = True) -> None:
        self.marks = marks
        self.closed: list[np.ndarray] = []
        self.open: int | None = None  # tokens so far of the document the last piece is in
        self.last = NO_POSITION  # the position of the stream's last token so far

    def add(self, columns: dict[str, Column], key: str = "sequence") -> None:
        """One shard's documents: its rows' stored `doc_lengths`, else its rows of `key` (a
        stream-only shard: one piece), split further where positions start a document."""
        column = columns.get("position_ids") if self.marks else None
        positions = None if column is None else np.asarray(column.values)
        if positions is not None and not len(positions):
            positions = None
        if "doc_lengths" in columns:
            pieces = np.asarray(columns["doc_lengths"].values, dtype=np.int64)
        elif positions is not None:  # documents not stored: each token is a piece
            pieces = None
        else:
            rows = columns[key]
            pieces = (
                np.diff(rows.offsets)
                if rows.offsets is not None
                else np.array([len(rows.values)], dtype=np.int64)
            )
        if pieces is None:
            assert positions is not None
            inner = np.flatnonzero(opens_document(positions[1:], positions[:-1])) + 1
            starts = np.concatenate([[0], inner]).astype(np.int64)
            lengths = np.diff(np.append(starts, len(positions)))
            opens = np.ones(len(lengths), dtype=bool)
            opens[0] = opens_document(positions[0], self.last)
        else:
            lengths = pieces[pieces > 0]
            if not len(lengths):
                return
            opens = np.ones(len(lengths), dtype=bool)
            if positions is not None:
                starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                before = np.empty(len(lengths), dtype=np.int64)
                before[0] = self.last
                before[1:] = positions[starts[1:] - 1]
                opens = opens_document(positions[starts], before)
        self.last = int(positions[-1]) if positions is not None else NO_POSITION
        self._join(lengths, opens)

    def _join(self, lengths: np.ndarray, opens: np.ndarray) -> None:
        if self.open is None:
            opens[0] = True
        at = np.flatnonzero(opens)
        if not len(at):
            self.open = (self.open or 0) + int(lengths.sum())
            return
        head = int(lengths[: at[0]].sum())
        if self.open is not None:
            self.closed.append(np.array([self.open + head], dtype=np.int64))
        sums = np.add.reduceat(lengths, at)
        self.closed.append(np.asarray(sums[:-1], dtype=np.int64))
        self.open = int(sums[-1])

    def lengths(self) -> np.ndarray:
        """Every document's length, in stream order (the last one closed by the stream's end)."""
        last = [np.array([self.open], dtype=np.int64)] if self.open is not None else []
        parts = self.closed + last
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


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
