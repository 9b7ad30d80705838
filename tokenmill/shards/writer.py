"""Writing shards: records in, complete shards out, never a torn one.

A shard is staged in a temp folder (arrays, offsets, fsync, `meta.json` last) and renamed
into place; `ShardCutter` decides where shards end from token counts alone, so every
preprocessing task cuts its shards by the same rule, on any engine. `ShardWriter` streams
each row to its shard's temp files as it comes (`StagedShard`), so its memory does not grow
with the shard. `ShardSpec` is what a domain's writer is told (its folder, layout, limit
and the task that names its shards).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import xxhash

from tokenmill.shards.buffers import ShardBuffer, jsonl_line, offsets_of
from tokenmill.shards.files import fsync_dir, publish, tmp_path, write_durable, write_to
from tokenmill.shards.format import (
    DTYPES,
    KEY_RE,
    OFFSET_DTYPE,
    STORAGE_FORMATS,
    TMP_MARK,
    Column,
    FileHashes,
    cast,
    checksum,
    file_hashes,
    flat,
    is_list_value,
    row_tokens,
    shard_name,
)


def write_shard(shard_dir: Path, columns: dict[str, Column], dtypes: dict[str, str]) -> dict:
    """Writes one shard atomically (temp folder, fsync, meta.json last, rename); returns its meta."""
    tmp, meta = stage_shard(shard_dir, columns, dtypes)
    try:
        publish(tmp, Path(shard_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def stage_shard(
    shard_dir: Path, columns: dict[str, Column], dtypes: dict[str, str]
) -> tuple[Path, dict]:
    """Writes a shard into its temp folder, fsynced and ready to `publish`; returns (temp, meta)."""
    shard_dir = Path(shard_dir)
    counts = {key: len(col.offsets) - 1 for key, col in columns.items() if col.offsets is not None}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{shard_dir}: keys disagree on the number of records: {counts}")
    tmp = tmp_path(shard_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        meta = {}
        for key, col in columns.items():
            if not KEY_RE.match(key):
                raise ValueError(f"key {key!r} cannot name a file; use letters, digits, _ and -")
            values = cast(col.values, dtypes[key], f"key {key!r}")
            write_durable(tmp / f"{key}.bin", values)
            entry: dict[str, Any] = {
                "shape": [len(values)],
                "dtype": dtypes[key],
                "nbytes": values.nbytes,
                **file_hashes(values),
            }
            for part, bounds in (("offsets", col.offsets), ("items", col.items)):
                if bounds is not None:
                    bounds = np.ascontiguousarray(bounds, OFFSET_DTYPE)
                    write_durable(tmp / f"{key}.{part}.bin", bounds)
                    entry[part] = {
                        "file": f"{key}.{part}.bin",
                        "count": len(bounds),
                        **file_hashes(bounds),
                    }
            meta[key] = entry
        write_durable(tmp / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, meta


class StagedPart:
    """A JSONL part written into its temp file line by line, checksummed as it goes."""

    def __init__(self, final: Path) -> None:
        self.tmp = tmp_path(Path(final))
        self.file = open(self.tmp, "wb")  # noqa: SIM115  # closed by finish() or discard()
        self.hash = xxhash.xxh64()
        self.nbytes = 0

    def add(self, line: bytes) -> None:
        self.file.write(line)
        self.hash.update(line)
        self.nbytes += len(line)

    def finish(self) -> tuple[Path, dict]:
        """Flushed and fsynced, ready to `publish`; returns (temp, size and checksum)."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        except BaseException:
            self.discard()
            raise
        return self.tmp, {"nbytes": self.nbytes, "xxh64": self.hash.hexdigest()}

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


FLUSH_BYTES = 4 << 20  # a key's values are written in pieces of about this many bytes


class _StagedColumn:
    """One key's file in a staged shard: values appended, checksummed as they are written."""

    def __init__(self, path: Path, dtype: str, where: str) -> None:
        self.file = open(path, "wb")  # noqa: SIM115  # closed by finish() or discard()
        self.hashes = FileHashes()
        self.dtype = dtype
        self.where = where
        self.pending: list[np.ndarray] = []
        self.pending_bytes = self.count = 0
        self.lengths: list[int] = []  # per record (plain) or per item (list key)
        self.item_counts: list[int] = []  # per record, list keys only

    def add(self, arrays: list[np.ndarray]) -> None:
        for array in arrays:
            array = cast(array, self.dtype, self.where)
            self.pending.append(array)
            self.pending_bytes += array.nbytes
            self.lengths.append(len(array))
            self.count += len(array)
        if self.pending_bytes >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            data = np.ascontiguousarray(np.concatenate(self.pending))
            self.hashes.update(data)
            write_to(self.file, data, Path(self.file.name))
            self.pending, self.pending_bytes = [], 0

    def finish(self) -> dict:
        """Writes what is pending, fsyncs, closes; returns the values' checksums."""
        self.flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.hashes.entry()


class StagedShard:
    """A shard written into its temp folder row by row: each key's values go to its file a few MB
    at a time, checksums are updated as they are written, and only the offsets (8 bytes a
    record) stay in memory. `finish()` adds the offsets files and meta.json, fsynced, ready to
    `publish`; the same bytes as `stage_shard` of the whole shard's columns."""

    def __init__(self, final: Path, dtypes: dict[str, str], keys: list[str], list_keys: set[str]):
        self.tmp = tmp_path(Path(final))
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.dtypes = dtypes
        self.list_keys = list_keys
        self.columns = {
            key: _StagedColumn(self.tmp / f"{key}.bin", dtypes[key], f"key {key!r}") for key in keys
        }
        self.records = 0

    def add(self, record: dict[str, Any]) -> None:
        for key, column in self.columns.items():
            value = record[key]
            if key in self.list_keys:
                if not isinstance(value, (list, tuple)):
                    raise ValueError(
                        f"key {key!r}: expected a list of arrays in every record, like the first"
                    )
                column.item_counts.append(len(value))
                column.add([flat(v, key) for v in value])
            else:
                if is_list_value(value):
                    raise ValueError(
                        f"key {key!r}: expected one array in every record, like the first"
                    )
                column.add([flat(value, key)])
        self.records += 1

    def finish(self) -> tuple[Path, dict]:
        try:
            meta = {}
            for key, column in self.columns.items():
                entry: dict[str, Any] = {
                    "shape": [column.count],
                    "dtype": self.dtypes[key],
                    "nbytes": column.count * np.dtype(DTYPES[self.dtypes[key]]).itemsize,
                    **column.finish(),
                }
                bounds = [("offsets", offsets_of(column.lengths))]
                if key in self.list_keys:
                    bounds = [("offsets", offsets_of(column.item_counts)), ("items", bounds[0][1])]
                for part, values in bounds:
                    write_durable(self.tmp / f"{key}.{part}.bin", values)
                    entry[part] = {
                        "file": f"{key}.{part}.bin",
                        "count": len(values),
                        **file_hashes(values),
                    }
                meta[key] = entry
            write_durable(self.tmp / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
            fsync_dir(self.tmp)
        except BaseException:
            self.discard()
            raise
        return self.tmp, meta

    def discard(self) -> None:
        for column in self.columns.values():
            column.file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class ShardCutter:
    """Where shards end, from token counts alone: a shard closes before a record that would take it
    past `max_tokens` and as soon as it reaches `max_tokens`, so only a record that alone exceeds
    the limit gets a shard above it. ShardWriter follows it."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens_per_shard must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.records = self.tokens = 0

    def close_before(self, tokens: int) -> bool:
        """Whether the open shard must close before a record of `tokens` tokens joins it."""
        return self.records > 0 and self.tokens + tokens > self.max_tokens

    def add(self, tokens: int) -> bool:
        """Counts a record in the open shard; True when the shard is now full and must close."""
        self.records += 1
        self.tokens += tokens
        return self.tokens >= self.max_tokens

    def reset(self) -> None:
        self.records = self.tokens = 0


@dataclass(frozen=True)
class ShardSpec:
    """What one domain's shards are: written in `domain_dir`, each key in its dtype, cut at
    `max_tokens_per_shard` tokens of `primary_key` (the ShardCutter rule), stored as
    `storage_format`, numbered from `first_index` (within preprocessing task `task`, whose
    number the names carry: `shard_name`)."""

    domain_dir: Path
    dtypes: dict[str, str]
    primary_key: str
    max_tokens_per_shard: int
    storage_format: str = "bin"
    first_index: int = 0
    task: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "domain_dir", Path(self.domain_dir))
        if self.storage_format not in STORAGE_FORMATS:
            raise ValueError(
                f"storage_format {self.storage_format!r} is not one of {list(STORAGE_FORMATS)}"
            )


def shard_spec(*fields: Any, **named: Any) -> ShardSpec:
    """A ShardSpec given whole, or made of its fields as ShardWriter has always taken them
    (`domain_dir, dtypes, primary_key, max_tokens_per_shard, storage_format, first_index`)."""
    if len(fields) == 1 and not named and isinstance(fields[0], ShardSpec):
        return fields[0]
    return ShardSpec(*fields, **named)


class ShardWriter:
    """Writes the shards of one domain folder, rolling at max_tokens_per_shard tokens of primary_key
    (the ShardCutter rule). Given a ShardSpec, or its fields."""

    @overload
    def __init__(self, spec: ShardSpec, /) -> None: ...

    @overload
    def __init__(
        self,
        domain_dir: Path | str,
        dtypes: dict[str, str],
        primary_key: str,
        max_tokens_per_shard: int,
        storage_format: str = "bin",
        first_index: int = 0,
    ) -> None: ...

    def __init__(self, *fields: Any, **named: Any) -> None:
        self.spec = spec = shard_spec(*fields, **named)
        self.cutter = ShardCutter(spec.max_tokens_per_shard)
        self.domain_dir = spec.domain_dir
        self.primary_key = spec.primary_key
        self.storage_format = spec.storage_format
        self.index = spec.first_index  # the open shard's
        self.buffer = ShardBuffer(spec.dtypes)  # the layout (keys, dtypes) and the record count
        self.staged: StagedShard | StagedPart | None = None  # the open shard's temp files
        self.published: list[dict] = []
        self.closed = False

    def add(self, row: dict[str, Any]) -> None:
        """Adds one row (a stored record); every row must have the first row's keys."""
        if self.closed:
            raise RuntimeError("ShardWriter is closed")
        if self.primary_key not in row:
            raise ValueError(
                f"primary key {self.primary_key!r} is not in the record keys {list(row)}"
            )
        tokens = row_tokens(row[self.primary_key])
        if self.cutter.close_before(tokens):
            self._flush()
        self.buffer.check(row)
        keys = list(self.buffer.keys or [])
        if self.staged is None:
            final = self.domain_dir / shard_name(self.index, self.storage_format, self.spec.task)
            self.domain_dir.mkdir(parents=True, exist_ok=True)
            self.staged = (
                StagedPart(final)
                if self.storage_format == "jsonl"
                else StagedShard(final, self.buffer.dtypes, keys, self.buffer.list_keys)
            )
        if isinstance(self.staged, StagedPart):
            self.staged.add(jsonl_line({k: row[k] for k in keys}, self.buffer.dtypes))
        else:
            self.staged.add(row)
        self.buffer.records += 1
        if self.cutter.add(tokens):
            self._flush()

    def stage(self) -> tuple[Path, dict]:
        """Writes the open shard into its temp place beside its final one, not yet published;
        returns (temp, the shard's info), for `_flush` to publish."""
        name = shard_name(self.index, self.storage_format, self.spec.task)
        final = self.domain_dir / name
        self.domain_dir.mkdir(parents=True, exist_ok=True)
        if self.staged is None:
            raise RuntimeError(f"{final}: no row was added to the shard being staged")
        tmp, extra = self.staged.finish()
        self.staged = None
        if self.storage_format != "jsonl":
            # the manifest covers meta.json too: an edited dtype or shape is caught at load
            extra = {"meta_xxh64": checksum((tmp / "meta.json").read_bytes())}
        info = {
            "name": name,
            "records": self.buffer.records,
            "tokens": self.cutter.tokens,
            "keys": list(self.buffer.keys or []),
            **extra,
        }
        return tmp, info

    def _flush(self) -> None:
        if not self.buffer.records:
            return
        tmp, info = self.stage()
        try:
            publish(tmp, self.domain_dir / info["name"])
        except BaseException:
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise
        self.published.append(info)
        self.index += 1
        self.buffer.clear()
        self.cutter.reset()

    def close(self) -> list[dict]:
        """Publishes the last shard; returns one info per published shard."""
        if not self.closed:
            self._flush()
            self.closed = True
        return self.published

    def abort(self) -> None:
        """Drops buffered records and removes this process's temp files; publishes nothing more."""
        self.closed = True
        self.buffer.clear()
        if self.staged is not None:
            self.staged.discard()
            self.staged = None
        if self.domain_dir.is_dir():
            for path in self.domain_dir.glob(f"*{TMP_MARK}{os.getpid()}"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort() if exc_type else self.close()
