"""A dataset's index: what opening it needs, in one file, so that it opens in O(1) shards.

`shards.index` at the top of a dataset folder (and of each domain folder in it) holds, per
shard in the order a store reads them: its name, its records and each key's elements as
cumulative starts, list keys' item counts and the xxh64 of its meta.json; and in a small JSON
header: each key's dtype and files, the data's fingerprint, the longest row of each key and
how many rows start inside a document. It is memory-mapped (one read, or one GET from a
bucket), so every process of a machine shares its pages. A shard's meta.json (its files and
checksums) is read only when the shard itself is opened, and checked against the xxh64 the
index recorded.

    bytes 0-8    b"TMINDEX1"
    bytes 8-16   header length, little-endian uint64
    header       JSON: {"version", "shards", "keys", "fingerprint", "longest", "stream_keys",
                 "rows_inside", "arrays": {name: {"dtype", "count", "offset"}}}
    arrays       each at its offset (a multiple of 64)

`write_index` builds it from the shards' meta.json files once they are all published (the
pipeline calls it before it writes manifest.json; `tokenmill index` indexes an older dataset);
`index_entry` is the manifest's entry naming it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.shards.files import file_checksum, write_atomic
from tokenmill.shards.format import (
    DTYPES,
    NO_POSITION,
    OFFSET_DTYPE,
    bounds_count,
    checksum,
    natural_key,
    opens_document,
    primary_key,
    shard_records,
)
from tokenmill.shards.manifest import listed, read_manifest
from tokenmill.shards.reader import find_shards, map_array, read_meta

INDEX_NAME = "shards.index"
MAGIC = b"TMINDEX1"
VERSION = 1
ALIGN = 64


class ShardIndex:
    """An index file, memory-mapped: its header parsed, its arrays views of the map. Pickled,
    it is its path: a worker maps the same file (the same pages)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.stat().st_size < 16:
            raise ValueError(f"{self.path}: not a tokenmill index (too short); {_REBUILD}")
        data = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        if bytes(data[:8]) != MAGIC:
            raise ValueError(f"{self.path}: not a tokenmill index; {_REBUILD}")
        size = int(data[8:16].view("<u8")[0])
        try:
            header = json.loads(bytes(data[16 : 16 + size]))
        except ValueError as err:
            raise ValueError(f"{self.path}: unreadable header ({err}); {_REBUILD}") from None
        if header.get("version", 0) > VERSION:
            raise ValueError(
                f"{self.path}: index version {header['version']} is newer than this tokenmill "
                f"reads ({VERSION}); upgrade tokenmill"
            )
        self.header = header
        self.arrays: dict[str, np.ndarray] = {}
        for name, info in header["arrays"].items():
            dtype = np.dtype(info["dtype"])
            end = info["offset"] + info["count"] * dtype.itemsize
            if end > len(data):
                raise ValueError(f"{self.path}: truncated ({name} ends past the file); {_REBUILD}")
            self.arrays[name] = data[info["offset"] : end].view(dtype)
        self.count: int = header["shards"]
        self.keys: dict[str, dict] = header["keys"]
        self.dtypes = {k: DTYPES[e["dtype"]] for k, e in self.keys.items()}
        self.starts = {k: self.arrays[f"starts.{k}"] for k in self.keys}
        self.records = self.arrays["records"]

    def __reduce__(self) -> tuple[Any, tuple]:
        return ShardIndex, (self.path,)

    @property
    def fingerprint(self) -> str:
        return str(self.header["fingerprint"])

    def name(self, s: int) -> str:
        return bytes(self.arrays["names"][s]).decode()

    def meta_xxh64(self, s: int) -> str:
        return f"{int(self.arrays['meta_xxh64'][s]):016x}"

    def check_meta(self, s: int, data: bytes, where: str) -> None:
        """A shard's meta.json bytes, as the index recorded them (else it was edited since)."""
        if xxh64_int(data) != int(self.arrays["meta_xxh64"][s]):
            raise ValueError(
                f"{where}: edited since the dataset was indexed (its xxh64 differs from "
                f"{self.path.name}'s); run `tokenmill verify`"
            )

    def shard_bytes(self) -> np.ndarray:
        """Bytes of each shard's files (values, offsets and items)."""
        total = np.zeros(self.count, dtype=np.int64)
        records = np.diff(self.records)
        for key, layout in self.keys.items():
            total += np.diff(self.starts[key]) * DTYPES[layout["dtype"]].itemsize
            if layout.get("offsets"):
                total += (records + 1) * OFFSET_DTYPE.itemsize
            if layout.get("items"):
                total += (self.arrays[f"items.{key}"] + 1) * OFFSET_DTYPE.itemsize
        return total


_REBUILD = "rebuild it with `tokenmill index DATASET`"


def xxh64_int(data: bytes) -> int:
    return int(checksum(data), 16)


def find_index(folder: str | Path) -> ShardIndex | None:
    """The index at the top of a dataset (or domain) folder, None where there is none."""
    path = Path(folder) / INDEX_NAME
    return ShardIndex(path) if path.is_file() else None


# --- writing ----------------------------------------------------------------------------------
def write_index(folder: Path) -> None:
    """Indexes a finished dataset folder of bin shards: `shards.index` at its top over every
    shard (the manifest's, where it has one; else every published shard below it), and one
    in each domain folder over that domain's (`tokenmill index`: a dataset written before)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is not None and manifest.get("storage_format", "bin") != "bin":
        raise ValueError(f"{folder}: a dataset of JSONL parts needs no index")
    found = find_shards(folder)
    if manifest is not None:
        names = {rel for rel, _ in listed(manifest)}
        found = [d for d in found if d.relative_to(folder).as_posix() in names]
    if not found:
        raise FileNotFoundError(f"{folder}: no shard (a folder with meta.json) below it")
    domains: dict[str, list[dict]] = {}
    for shard in found:
        domain = "" if shard.parent == folder or shard == folder else shard.parent.name
        domains.setdefault(domain, []).append(shard_facts(shard))
    write_indexes(folder, domains)


def shard_facts(shard: Path) -> dict:
    """What the index needs of one published shard, as JSON: written where the shard is (a
    preprocessing task, on its node), so that the index is put together from these alone,
    without reading any shard again."""
    raw = (Path(shard) / "meta.json").read_bytes()
    meta = read_meta(shard)
    primary = primary_key(list(meta))
    return {
        "name": Path(shard).name,
        "meta": json.dumps(meta, sort_keys=True),
        "meta_xxh64": checksum(raw),
        "longest": dict(_longest(shard, meta, [k for k, e in meta.items() if "offsets" in e])),
        "rows": _row_starts(shard, meta, primary),
    }


def write_indexes(folder: Path, domains: dict[str, list[dict]]) -> None:
    """The index of a dataset at `folder` (over every domain's shards, domains in store order)
    and one in each domain folder, from each shard's `shard_facts`, in order."""
    order = sorted(domains, key=lambda d: natural_key(Path(d)))
    whole = [(f"{d}/{f['name']}" if d else f["name"], f) for d in order for f in domains[d]]
    _write(folder, whole)
    for domain in order:
        if domain:  # made here too: a bucket run's driver stages no shard of its own
            (folder / domain).mkdir(parents=True, exist_ok=True)
            _write(folder / domain, [(f["name"], f) for f in domains[domain]])


def index_entry(folder: Path) -> dict:
    """manifest.json's entry for the index written at `folder`: its file, size and xxh64."""
    path = Path(folder) / INDEX_NAME
    return {"file": INDEX_NAME, "nbytes": path.stat().st_size, "xxh64": file_checksum(path)}


def _write(folder: Path, shards: list[tuple[str, dict]]) -> None:
    rels = [rel for rel, _ in shards]
    metas = [json.loads(facts["meta"]) for _, facts in shards]
    first = metas[0]
    primary = primary_key(list(first))
    keys = {k: _layout(e) for k, e in first.items()}
    n = len(shards)
    sizes = {k: np.zeros(n, dtype=np.int64) for k in keys}
    items = {k: np.zeros(n, dtype=np.int64) for k, e in keys.items() if e["items"]}
    records = np.zeros(n, dtype=np.int64)
    digests = np.zeros(n, dtype=np.uint64)
    longest = dict.fromkeys((k for k, e in keys.items() if e["offsets"]), 0)
    fingerprint = hashlib.sha256()
    inside: int | None = 0
    last = NO_POSITION
    for s, (meta, (rel, facts)) in enumerate(zip(metas, shards, strict=True)):
        if meta.keys() != first.keys():
            raise ValueError(f"{rel}: keys {sorted(meta)} differ from {rels[0]}'s {sorted(first)}")
        for key, entry in meta.items():
            if entry["dtype"] != keys[key]["dtype"]:
                raise ValueError(
                    f"{rel}: key {key!r} is {entry['dtype']}, {rels[0]} has {keys[key]['dtype']}"
                )
            sizes[key][s] = entry["shape"][0]
            if key in items and "items" in entry:
                items[key][s] = bounds_count(entry["items"]) - 1
        records[s] = shard_records(meta)
        digests[s] = int(facts["meta_xxh64"], 16)
        fingerprint.update(f"{rel}\n{facts['meta']}\n".encode())
        for key, length in facts["longest"].items():
            longest[key] = max(longest.get(key, 0), length)
        inside, last = _rows_inside(inside, last, facts["rows"])
    arrays = {
        "names": np.array([r.encode() for r in rels]),
        "records": _cumulative(records),
        "meta_xxh64": digests,
        **{f"starts.{k}": _cumulative(v) for k, v in sizes.items()},
        **{f"items.{k}": v for k, v in items.items()},
    }
    header = {
        "version": VERSION,
        "shards": n,
        "keys": keys,
        "fingerprint": fingerprint.hexdigest()[:16],
        "longest": longest,
        "stream_keys": [k for k in keys if np.array_equal(sizes[k], sizes[primary])],
        "rows_inside": inside,
    }
    write_atomic(folder / INDEX_NAME, _encode(header, arrays))


def _layout(entry: dict) -> dict:
    """A key's dtype and the names of its offsets and items files (None: none, or inline):
    how many files a shard holds open once mapped."""

    def file(part: str) -> str | None:
        bounds = entry.get(part)
        return bounds["file"] if isinstance(bounds, dict) else None

    return {"dtype": entry["dtype"], "offsets": file("offsets"), "items": file("items")}


def _cumulative(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _bounds(shard: Path, key: str, bounds: Any) -> np.ndarray:
    if isinstance(bounds, list):
        return np.asarray(bounds, OFFSET_DTYPE)
    return map_array(shard / bounds["file"], "int64", bounds["count"], key)


def _longest(shard: Path, meta: dict, keys: list[str]) -> Iterator[tuple[str, int]]:
    """Each key's longest row in a shard (a list key's: all its items), from its offsets."""
    for key in keys:
        entry = meta[key]
        offsets = _bounds(shard, key, entry["offsets"])
        if "items" in entry:
            offsets = _bounds(shard, key, entry["items"])[offsets]
        if len(offsets) > 1:
            yield key, int(np.diff(offsets).max())


def _row_starts(shard: Path, meta: dict, primary: str) -> dict | None:
    """Where a shard's rows start in its token stream, as far as documents go: the position id
    of its first row's first token and of the token before it (None: the shard's first, whose
    token before is the previous shard's last), how many later rows start inside a document
    (`opens_document`), and its last position id; None where the stream has no
    `position_ids` beside it (then nothing is known of rows and documents)."""
    entry, positions = meta[primary], meta.get("position_ids")
    if positions is None or "offsets" not in entry or positions["shape"] != entry["shape"]:
        return None
    values = map_array(
        shard / "position_ids.bin", positions["dtype"], positions["shape"][0], "position_ids"
    )
    starts = _bounds(shard, primary, entry["offsets"])[:-1]
    starts = starts[starts < len(values)]  # empty rows at the end start nowhere
    if not len(starts):
        return {"empty": True}
    first = np.asarray(values[starts], dtype=np.int64)
    before = np.asarray(values[np.maximum(starts - 1, 0)], dtype=np.int64)
    return {
        "first": int(first[0]),
        "before": None if starts[0] == 0 else int(before[0]),
        "inside": int(np.count_nonzero(~opens_document(first[1:], before[1:]))),
        "last": int(values[-1]),
    }


def _rows_inside(inside: int | None, last: int, rows: dict | None) -> tuple[int | None, int]:
    """The count of rows starting inside a document, with one more shard's `_row_starts`
    (shards in order: a shard's first row follows the previous shard's last token)."""
    if inside is None or rows is None:
        return None, last
    if rows.get("empty"):
        return inside, last
    before = last if rows["before"] is None else rows["before"]
    opens = opens_document(np.array([rows["first"]]), np.array([before]))
    return inside + rows["inside"] + int(not opens[0]), rows["last"]


def _encode(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """The index file's bytes: magic, header length, header, then each array aligned."""
    table: dict[str, dict] = {}
    start = ALIGN
    while True:  # the header lists the arrays' offsets, which follow the header: until it fits
        place = start
        for name, values in arrays.items():
            table[name] = {"dtype": values.dtype.str, "count": len(values), "offset": place}
            place = _aligned(place + values.nbytes)
        text = json.dumps({**header, "arrays": table}).encode()
        if 16 + len(text) <= start:
            break
        start = _aligned(16 + len(text))
    out = bytearray(place)
    out[:8] = MAGIC
    out[8:16] = len(text).to_bytes(8, "little")
    out[16 : 16 + len(text)] = text
    for name, values in arrays.items():
        offset = table[name]["offset"]
        out[offset : offset + values.nbytes] = np.ascontiguousarray(values).tobytes()
    return bytes(out)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
