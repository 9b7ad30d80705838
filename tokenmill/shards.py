"""The on-disk format: output records -> shard folders of flat arrays + offsets, and back.

The pipeline feeds records to ShardWriter; store.py maps what it publishes; `tokenmill
verify` runs verify.verify_dataset. A shard is written aside and renamed into place, so a
visible shard is a complete one (docs/dataflow.md section 2 is the contract).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import xxhash

FORMAT_VERSION = 1
DTYPES = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")
    + ("float16", "float32", "float64")
}
OFFSET_DTYPE = np.dtype("<i8")
STORAGE_FORMATS = ("bin", "jsonl")
TMP_MARK = ".tmp-"
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


@dataclass
class Column:
    """One key of one shard in memory: flat values, int64 record offsets, int64 item bounds."""

    values: np.ndarray
    offsets: np.ndarray | None
    items: np.ndarray | None = None


def checksum(array: np.ndarray) -> str:
    return xxhash.xxh64(np.ascontiguousarray(array).data).hexdigest()


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


def _flat(value: Any, where: str) -> np.ndarray:
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


class ColumnBuffer:
    """Collects one key's values record by record; build() gives the shard's Column."""

    def __init__(self, key: str, is_list: bool):
        self.key, self.is_list = key, is_list
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
            arrays = [_flat(v, self.key) for v in value]
            lengths = [len(a) for a in arrays]
            self.parts += arrays
            self.lengths += lengths
            self.item_counts.append(len(arrays))
            return sum(lengths)
        if is_list_value(value):
            raise ValueError(
                f"key {self.key!r}: expected one array in every record, like the first"
            )
        array = _flat(value, self.key)
        self.parts.append(array)
        self.lengths.append(len(array))
        return len(array)

    def build(self, dtype: str) -> Column:
        values = np.concatenate(self.parts) if self.parts else np.empty(0, DTYPES[dtype])
        values = cast(values, dtype, f"key {self.key!r}")
        bounds = _bounds(self.lengths)
        if self.is_list:
            return Column(values, _bounds(self.item_counts), bounds)
        return Column(values, bounds)


def _bounds(lengths: list[int]) -> np.ndarray:
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
                if not _KEY_RE.match(key):
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


# --- writing ----------------------------------------------------------------------------------
def _write(path: Path, data: np.ndarray | bytes) -> None:
    """One write of the whole array (or bytes), flushed to disk before anything is published."""
    with open(path, "wb") as f:
        data.tofile(f) if isinstance(data, np.ndarray) else f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Renames a finished temp file/folder into place; never over a published one."""
    if final.exists():
        raise FileExistsError(f"{final} already exists; refusing to overwrite a published shard")
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def _tmp_path(final: Path) -> Path:
    return final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}")


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
    tmp = _tmp_path(shard_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        meta = {}
        for key, col in columns.items():
            if not _KEY_RE.match(key):
                raise ValueError(f"key {key!r} cannot name a file; use letters, digits, _ and -")
            values = cast(col.values, dtypes[key], f"key {key!r}")
            _write(tmp / f"{key}.bin", values)
            entry: dict[str, Any] = {
                "shape": [len(values)],
                "dtype": dtypes[key],
                "nbytes": values.nbytes,
                "xxh64": checksum(values),
            }
            for part, bounds in (("offsets", col.offsets), ("items", col.items)):
                if bounds is not None:
                    bounds = np.ascontiguousarray(bounds, OFFSET_DTYPE)
                    _write(tmp / f"{key}.{part}.bin", bounds)
                    entry[part] = {
                        "file": f"{key}.{part}.bin",
                        "count": len(bounds),
                        "xxh64": checksum(bounds),
                    }
            meta[key] = entry
        _write(tmp / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, meta


def stage_part(part: Path, lines: list[bytes]) -> tuple[Path, dict]:
    """Writes a JSONL part into its temp file, ready to `publish`; returns (temp, size and checksum)."""
    data = b"".join(lines)
    tmp = _tmp_path(Path(part))
    try:
        _write(tmp, data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, {"nbytes": len(data), "xxh64": xxhash.xxh64(data).hexdigest()}


def jsonl_line(record: dict[str, Any], dtypes: dict[str, str]) -> bytes:
    """One output record as a JSONL line: ints as lists, floats as floats, bools as 0/1."""

    def plain(arr: np.ndarray, dtype: str, where: str) -> list:
        arr = cast(_flat(arr, where), dtype, where)
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


class ShardCutter:
    """Where shards end, from token counts alone: a shard closes before a record that would take it
    past `max_tokens` and as soon as it reaches `max_tokens`, so only a record that alone exceeds
    the limit gets a shard above it. ShardWriter follows it; the Ray engine plans with it."""

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


def shard_name(index: int, storage_format: str) -> str:
    return f"part_{index:05d}.jsonl" if storage_format == "jsonl" else f"shard_{index:05d}"


class ShardWriter:
    """Writes the shards of one domain folder, rolling at max_tokens_per_shard tokens of primary_key
    (the ShardCutter rule)."""

    def __init__(
        self,
        domain_dir: Path,
        dtypes: dict[str, str],
        primary_key: str,
        max_tokens_per_shard: int,
        storage_format: str = "bin",
        first_index: int = 0,
    ):
        if storage_format not in STORAGE_FORMATS:
            raise ValueError(
                f"storage_format {storage_format!r} is not one of {list(STORAGE_FORMATS)}"
            )
        self.cutter = ShardCutter(max_tokens_per_shard)
        self.domain_dir, self.primary_key = Path(domain_dir), primary_key
        self.storage_format, self.index = storage_format, first_index
        self.buffer = ShardBuffer(dtypes)
        self.lines: list[bytes] = []  # storage_format "jsonl"
        self.published: list[dict] = []
        self.closed = False

    def add(self, record: dict[str, Any]) -> None:
        """Adds one output record; every record must have the first record's keys."""
        if self.closed:
            raise RuntimeError("ShardWriter is closed")
        if self.primary_key not in record:
            raise ValueError(
                f"primary key {self.primary_key!r} is not in the record keys {list(record)}"
            )
        tokens = row_tokens(record[self.primary_key])
        if self.cutter.close_before(tokens):
            self._flush()
        if self.storage_format == "jsonl":
            self.buffer.check(record)
            self.lines.append(
                jsonl_line({k: record[k] for k in self.buffer.keys or []}, self.buffer.dtypes)
            )
            self.buffer.records += 1
        else:
            self.buffer.add(record)
        if self.cutter.add(tokens):
            self._flush()

    def stage(self) -> tuple[Path, dict]:
        """Writes the open shard into its temp place beside its final one, not yet published;
        returns (temp, the shard's info). The Ray engine's write tasks stage, its driver publishes."""
        name = shard_name(self.index, self.storage_format)
        final = self.domain_dir / name
        self.domain_dir.mkdir(parents=True, exist_ok=True)
        if self.storage_format == "jsonl":
            tmp, extra = stage_part(final, self.lines)
        else:
            tmp, _ = stage_shard(final, self.buffer.build(), self.buffer.dtypes)
            extra = {}
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
        self.lines = []
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
        self.lines = []
        if self.domain_dir.is_dir():
            for path in self.domain_dir.glob(f"*{TMP_MARK}{os.getpid()}"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort() if exc_type else self.close()


# --- reading and checking ---------------------------------------------------------------------
def read_meta(shard_dir: Path) -> dict:
    """meta.json of a shard, checked for shape, dtype, sizes and offsets entries (seed style too)."""
    path = Path(shard_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read: {err}") from None
    if not isinstance(meta, dict) or not meta:
        raise ValueError(f"{path}: expected a mapping from key to array metadata")
    for key, entry in meta.items():
        where = f"{path}: key {key!r}"
        if not isinstance(entry, dict) or not _KEY_RE.match(key):
            raise ValueError(f"{where}: expected a key name mapped to {{shape, dtype}}")
        shape = entry.get("shape")
        if not (isinstance(shape, list) and len(shape) == 1 and _is_count(shape[0])):
            raise ValueError(f"{where}: shape must be [n] with n >= 0, got {shape!r}")
        if entry.get("dtype") not in DTYPES:
            raise ValueError(
                f"{where}: dtype {entry.get('dtype')!r} is not one of {sorted(DTYPES)}"
            )
        if "nbytes" in entry and entry["nbytes"] != shape[0] * DTYPES[entry["dtype"]].itemsize:
            raise ValueError(
                f"{where}: nbytes {entry['nbytes']} does not match shape {shape} of {entry['dtype']}"
            )
        for part in ("offsets", "items"):
            bounds = entry.get(part)
            if bounds is None or isinstance(bounds, list):
                continue
            file = bounds.get("file") if isinstance(bounds, dict) else None
            if not (
                isinstance(file, str) and file == Path(file).name and file not in ("", ".", "..")
            ):
                raise ValueError(
                    f"{where}: {part} must be a list or {{file, count}}, got {bounds!r}"
                )
            if not _is_count(bounds.get("count")):
                raise ValueError(f"{where}: {part} count must be an int >= 0, got {bounds!r}")
        if "items" in entry and "offsets" not in entry:
            raise ValueError(f"{where}: items without offsets")
    counts = {k: bounds_count(e["offsets"]) - 1 for k, e in meta.items() if "offsets" in e}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{path}: keys disagree on the number of records: {counts}")
    return meta


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def bounds_count(bounds: list | dict) -> int:
    """Number of values of an offsets/items entry, inline (seed) or in a file."""
    return len(bounds) if isinstance(bounds, list) else bounds["count"]


def shard_records(meta: dict) -> int:
    """Records of a shard: from any key with offsets; 0 for a stream-only (seed) shard."""
    return next((bounds_count(e["offsets"]) - 1 for e in meta.values() if "offsets" in e), 0)


def is_tmp(path: Path) -> bool:
    return any(TMP_MARK in part for part in path.parts)


def find_shards(root: Path) -> list[Path]:
    """Published shard folders below root (root itself may be one), in domain-then-shard order."""
    root = Path(root)
    found = [p.parent for p in root.rglob("meta.json") if not is_tmp(p.relative_to(root))]
    return sorted(found, key=lambda p: natural_key(p.relative_to(root)))


def natural_key(path: Path) -> tuple:
    """Sort key in which shard_100000 follows shard_99999."""
    return tuple(
        tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", part))
        for part in path.parts
    )


def write_manifest(root: Path, manifest: dict) -> None:
    """Writes manifest.json atomically (temp + os.replace): its presence means the dataset is complete."""
    domains = manifest.get("domains", {})
    if not isinstance(domains, dict) or not all(isinstance(v, list) for v in domains.values()):
        raise ValueError(
            "manifest 'domains' must map a domain folder ('' for the root) to a list of shard infos"
        )
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    path = Path(root) / "manifest.json"
    tmp = _tmp_path(path)
    _write(tmp, (json.dumps(manifest, indent=2) + "\n").encode())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_manifest(root: Path) -> dict | None:
    path = Path(root) / "manifest.json"
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {manifest['format_version']} is newer than this "
            f"tokenmill reads ({FORMAT_VERSION}); upgrade tokenmill"
        )
    return manifest


def primary_key(keys: list[str]) -> str:
    """The key whose elements count as tokens: `sequence`, else the first key."""
    return "sequence" if "sequence" in keys else keys[0]
