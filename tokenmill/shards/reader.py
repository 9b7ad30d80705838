"""Reading shards: `meta.json` checked, arrays memory-mapped read-only, sizes checked.

The one reader of shard arrays: the training stores, `tokenmill inspect` and `tokenmill
verify` all map files through `map_array`, so a truncated file fails the same way everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.shards.format import (
    DTYPES,
    KEY_RE,
    OFFSET_DTYPE,
    Column,
    bounds_count,
    is_count,
    is_tmp,
    natural_key,
)


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
        if not isinstance(entry, dict) or not KEY_RE.match(key):
            raise ValueError(f"{where}: expected a key name mapped to {{shape, dtype}}")
        shape = entry.get("shape")
        if not (isinstance(shape, list) and len(shape) == 1 and is_count(shape[0])):
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
            if not is_count(bounds.get("count")):
                raise ValueError(f"{where}: {part} count must be an int >= 0, got {bounds!r}")
        if "items" in entry and "offsets" not in entry:
            raise ValueError(f"{where}: items without offsets")
    counts = {k: bounds_count(e["offsets"]) - 1 for k, e in meta.items() if "offsets" in e}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{path}: keys disagree on the number of records: {counts}")
    return meta


def find_shards(root: Path) -> list[Path]:
    """Published shard folders below root (root itself may be one), in domain-then-shard order."""
    root = Path(root)
    found = [p.parent for p in root.rglob("meta.json") if not is_tmp(p.relative_to(root))]
    return sorted(found, key=lambda p: natural_key(p.relative_to(root)))


def map_shard(shard: Path, meta: dict) -> dict[str, Column]:
    """Every key of a shard as a Column of read-only maps, sizes and offsets checked."""
    columns = {}
    for key, entry in meta.items():
        values = map_array(shard / f"{key}.bin", entry["dtype"], entry["shape"][0], key)
        items = map_bounds(shard, key, entry.get("items"), len(values))
        below = len(values) if items is None else len(items) - 1
        offsets = map_bounds(shard, key, entry.get("offsets"), below)
        columns[key] = Column(values, offsets, items)
    return columns


def check_sizes(shard: Path, meta: dict) -> None:
    """Every file of a shard has the size its meta.json gives: a stat per file, none opened
    (a store checks every shard at load and maps each on first use)."""
    for key, entry in meta.items():
        check_size(shard / f"{key}.bin", entry["dtype"], entry["shape"][0], key)
        for part in ("items", "offsets"):
            bounds = entry.get(part)
            if isinstance(bounds, dict):
                check_size(shard / bounds["file"], "int64", bounds["count"], key)


def check_size(path: Path, dtype: str, count: int, key: str) -> None:
    expected = count * DTYPES[dtype].itemsize
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        found = "missing" if size is None else f"{size} bytes"
        raise ValueError(
            f"{path}: key {key!r}: {found}, expected {expected} bytes ({count} x {dtype}); the shard is truncated or corrupted, run `tokenmill verify`"
        )


def map_array(path: Path, dtype: str, count: int, key: str) -> np.ndarray:
    """np.memmap of a flat file, after checking its size: a truncated shard fails here."""
    check_size(path, dtype, count, key)
    if count == 0:
        return np.empty(0, DTYPES[dtype])
    # A plain ndarray view of the read-only map: slicing skips np.memmap's Python-level hooks.
    return np.memmap(path, dtype=DTYPES[dtype], mode="r", shape=(count,)).view(np.ndarray)


def map_bounds(shard: Path, key: str, bounds: Any, last: int) -> np.ndarray | None:
    """Offsets or items of a key (file or seed-style inline list), first and last value checked."""
    if bounds is None:
        return None
    if isinstance(bounds, list):
        where, values = (
            f"{shard / 'meta.json'}: key {key!r}: inline offsets",
            np.asarray(bounds, OFFSET_DTYPE),
        )
    else:
        where = f"{shard / bounds['file']}: key {key!r}"
        values = map_array(shard / bounds["file"], "int64", bounds["count"], key)
    if len(values) == 0 or values[0] != 0 or values[-1] != last:
        ends = f"{values[0]} .. {values[-1]}" if len(values) else "nothing"
        raise ValueError(f"{where}: runs {ends}, expected 0 .. {last}; run `tokenmill verify`")
    return values
