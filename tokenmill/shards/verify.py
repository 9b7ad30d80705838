"""`tokenmill verify`: every shard checked against its meta.json and the manifest.

Beside reader.py (the shard reader): sizes, xxh64 checksums, offsets monotonic and in
range, leftover temp folders, manifest agreement, and each `shards.index` against the shards
of its folder (a store trusts the index to open in O(1)); each problem names its
shard, file and key, so a truncated or corrupted dataset is found before training.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from tokenmill.shards.files import file_checksum
from tokenmill.shards.format import (
    DTYPES,
    OFFSET_DTYPE,
    TMP_MARK,
    bounds_count,
    checksum,
    is_tmp,
    primary_key,
    shard_records,
)
from tokenmill.shards.index import INDEX_NAME, ShardIndex, xxh64_int
from tokenmill.shards.manifest import listed, read_manifest
from tokenmill.shards.reader import find_shards, map_array, map_shard, read_meta


def verify_dataset(root: Path, require_manifest: bool = True) -> list[str]:
    """Every problem found below root, each naming shard, file and key; [] means the dataset is sound."""
    root = Path(root)
    if not root.is_dir():
        return [f"{root}: not a folder"]
    problems = [
        f"{p.relative_to(root).as_posix()}: leftover temp {'folder' if p.is_dir() else 'file'} "
        "from an interrupted write; remove it (or rerun the job)"
        for p in sorted(root.rglob(f"*{TMP_MARK}*"))
        if TMP_MARK in p.name and not is_tmp(p.parent.relative_to(root))
    ]
    found: dict[str, dict] = {}
    for shard in find_shards(root):
        rel = shard.relative_to(root).as_posix()
        try:
            found[rel] = read_meta(shard)
        except ValueError as err:
            problems.append(str(err))
            found[rel] = {}
            continue
        problems += _verify_shard(shard, rel, found[rel])
    try:
        manifest = read_manifest(root)
    except ValueError as err:
        return problems + [f"manifest.json: {err}"]
    if manifest is not None:
        problems += _verify_manifest(root, manifest, found)
    elif require_manifest:
        problems.append("manifest.json: missing, so the run that wrote this dataset did not finish")
    problems += _verify_indexes(root, found)
    if not found and not (manifest or {}).get("domains"):
        written = ((manifest or {}).get("summary") or {}).get("records_written")
        why = (
            " (the run wrote no record: all were dropped; see rejects.jsonl)"
            if written == 0
            else ""
        )
        problems.append(f"{root}: no shards found{why}")
    return problems


INTEGRITY = ("sizes", "sampled", "structure", "full")  # what a store checks, cheapest first
SAMPLED_PAGES = 4  # pages read per file at integrity="sampled": the first, the last, 2 at random


def check_shard(shard: Path, rel: str, meta: dict, level: str) -> list[str]:
    """The problems a store's integrity level finds in one shard when it first opens it; each
    level adds to the one before: sizes (nothing more here: the store stats every file at load),
    sampled (SAMPLED_PAGES pages of each file against their xxh64: O(1)), structure (offsets,
    items and document lengths read whole: O(records)), full (every checksum: O(bytes))."""
    if level not in INTEGRITY:
        raise ValueError(f"integrity must be one of {list(INTEGRITY)}, got {level!r}")
    if level == "sizes":
        return []
    if level == "full":
        return _verify_shard(shard, rel, meta, checksums=True)
    problems = _verify_shard(shard, rel, meta, checksums=False) if level == "structure" else []
    return problems or _sampled_pages(shard, rel, meta)


def _sampled_pages(shard: Path, rel: str, meta: dict) -> list[str]:
    rng = random.Random()
    for key, entry in meta.items():
        files = [(f"{key}.bin", entry)]
        bounds = (entry.get("offsets"), entry.get("items"))
        files += [(b["file"], b) for b in bounds if isinstance(b, dict)]
        for name, info in files:
            if "pages" not in info:
                continue  # written before pages had checksums: nothing to sample
            count = len(info["pages"]["xxh64"]) // 16
            picked: Iterable[int] = range(count)
            if count > SAMPLED_PAGES:
                picked = [0, count - 1, *rng.sample(range(1, count - 1), SAMPLED_PAGES - 2)]
            bad = _bad_page(shard / name, info["pages"], picked)
            if bad is not None:
                return [f"{rel}/{name}: key {key!r}: {bad}: the data is corrupted"]
    return []


def _bad_page(path: Path, pages: dict, picked: Iterable[int]) -> str | None:
    """The first of the picked pages whose xxh64 differs from meta.json's, named; None if they
    all match."""
    size, digests = pages["bytes"], pages["xxh64"]
    with open(path, "rb") as f:
        for page in sorted(picked):
            f.seek(page * size)
            data = f.read(size)
            if checksum(data) != digests[page * 16 : page * 16 + 16]:
                end = page * size + len(data)
                return f"page {page} (bytes {page * size}-{end}) differs from its xxh64"
    return None


def _verify_shard(shard: Path, rel: str, meta: dict, checksums: bool = True) -> list[str]:
    problems = []
    for key, entry in meta.items():
        path = shard / f"{key}.bin"
        dtype = DTYPES[entry["dtype"]]
        where = f"{rel}/{key}.bin: key {key!r}"
        expected = entry["shape"][0] * dtype.itemsize
        if not path.is_file():
            problems.append(f"{where}: file missing")
        elif path.stat().st_size != expected:
            problems.append(
                f"{where}: {path.stat().st_size} bytes, expected {expected} "
                f"(shape {entry['shape']} of {entry['dtype']}): truncated or overwritten"
            )
        elif checksums and "xxh64" in entry and file_checksum(path) != entry["xxh64"]:
            problems.append(f"{where}: xxh64 checksum mismatch: {_where_corrupt(path, entry)}")
        length = entry["shape"][0]
        if "items" in entry:
            problems += _verify_bounds(shard, rel, key, "items", entry["items"], length, checksums)
            length = bounds_count(entry["items"]) - 1
        if "offsets" in entry:
            problems += _verify_bounds(
                shard, rel, key, "offsets", entry["offsets"], length, checksums
            )
    if not problems and "doc_lengths" in meta and "sequence" in meta:
        problems += _verify_documents(shard, rel, meta)
    return problems


def _where_corrupt(path: Path, info: dict) -> str:
    """Names the first corrupt page where meta.json has the checksums of several."""
    count = len(info.get("pages", {}).get("xxh64", "")) // 16
    bad = _bad_page(path, info["pages"], range(count)) if count > 1 else None
    return f"the data is corrupted ({bad})" if bad else "the data is corrupted"


def _verify_documents(shard: Path, rel: str, meta: dict) -> list[str]:
    """Each row's stored document lengths add up to the row: the boundaries training trusts."""
    columns = map_shard(shard, meta)
    sequence, documents = columns["sequence"], columns["doc_lengths"]
    if sequence.offsets is None or documents.offsets is None:
        return []
    rows = np.diff(sequence.offsets)
    pieces = np.diff(documents.offsets)
    sums = np.zeros(len(rows), dtype=np.int64)
    if len(documents.values):
        filled = pieces > 0
        sums[filled] = np.add.reduceat(
            np.asarray(documents.values, np.int64), documents.offsets[:-1][filled]
        )
    bad = np.flatnonzero(sums != rows)
    if len(bad):
        row = int(bad[0])
        return [
            f"{rel}/doc_lengths.bin: row {row}: documents add up to {int(sums[row])} tokens, "
            f"the row has {int(rows[row])} ({len(bad)} rows disagree)"
        ]
    return []


def _verify_bounds(
    shard: Path, rel: str, key: str, part: str, bounds: list | dict, last: int, checksums: bool
) -> list[str]:
    """Checks one offsets/items array: size, checksum, range, order, first and last value."""
    if isinstance(bounds, list):
        where = f"{rel}/meta.json: key {key!r} (inline)"
        values = np.asarray(bounds, OFFSET_DTYPE)
    else:
        path = shard / bounds["file"]
        where = f"{rel}/{bounds['file']}: key {key!r}"
        expected = bounds["count"] * OFFSET_DTYPE.itemsize
        if not path.is_file():
            return [f"{where}: file missing"]
        if path.stat().st_size != expected:
            return [
                f"{where}: {path.stat().st_size} bytes, expected {expected} (count {bounds['count']})"
            ]
        if checksums and "xxh64" in bounds and file_checksum(path) != bounds["xxh64"]:
            return [f"{where}: xxh64 checksum mismatch: {_where_corrupt(path, bounds)}"]
        values = map_array(path, "int64", bounds["count"], key)
    if len(values) == 0:
        return [f"{where}: empty; needs at least [0]"]
    bad = np.flatnonzero((values < 0) | (values > last))
    if len(bad):
        return [f"{where}: {part}[{bad[0]}] = {values[bad[0]]} out of range [0, {last}]"]
    down = np.flatnonzero(np.diff(values) < 0)
    if len(down):
        i = down[0]
        return [f"{where}: {part} not monotonic: [{i}] = {values[i]} > [{i + 1}] = {values[i + 1]}"]
    if values[0] != 0 or values[-1] != last:
        return [f"{where}: {part} run from {values[0]} to {values[-1]}, expected 0 to {last}"]
    return []


def _verify_manifest(root: Path, manifest: dict, found: dict[str, dict]) -> list[str]:
    problems: list[str] = []
    entries = listed(manifest)
    for rel, info in entries:
        if rel.endswith(".jsonl"):
            problems += _verify_part(root / rel, rel, info)
        elif rel not in found:
            problems.append(f"{rel}: listed in manifest.json but missing")
        elif found[rel]:
            meta = found[rel]
            if "meta_xxh64" in info:
                if checksum((root / rel / "meta.json").read_bytes()) != info["meta_xxh64"]:
                    problems.append(
                        f"{rel}/meta.json: edited since it was written (xxh64 differs from manifest.json)"
                    )
            primary = manifest.get("primary_key")
            tokens = meta[primary if primary in meta else primary_key(list(meta))]["shape"][0]
            for what, have in (("records", shard_records(meta)), ("tokens", tokens)):
                if info.get(what) is not None and info[what] != have:
                    problems.append(
                        f"{rel}: manifest.json says {info[what]} {what}, meta.json has {have}"
                    )
    names = {rel for rel, _ in entries}
    problems += [f"{rel}: shard not listed in manifest.json" for rel in found if rel not in names]
    parts = sorted(p.relative_to(root) for p in root.rglob("part_*.jsonl") if p.is_file())
    problems += [
        f"{rel.as_posix()}: part not listed in manifest.json"
        for rel in parts
        if not is_tmp(rel) and rel.as_posix() not in names
    ]
    return problems


def _verify_indexes(root: Path, found: dict[str, dict]) -> list[str]:
    """Each index lists exactly the shards of its folder (the dataset's, or a domain's), with
    their records and their meta.json as written: a store opening it reads nothing else."""
    problems: list[str] = []
    for path in sorted(root.rglob(INDEX_NAME)):
        folder = path.parent
        where = path.relative_to(root).as_posix()
        try:
            index = ShardIndex(path)
        except (ValueError, KeyError) as err:
            problems.append(f"{where}: {err}")
            continue
        prefix = "" if folder == root else folder.relative_to(root).as_posix() + "/"
        shards = {rel[len(prefix) :] for rel in found if rel.startswith(prefix)}
        names = [index.name(s) for s in range(index.count)]
        records = np.diff(index.records)
        problems += [
            f"{where}: lists {name}, which is missing" for name in names if name not in shards
        ]
        problems += [
            f"{where}: does not list {prefix}{name}; rebuild it with `tokenmill index`"
            for name in sorted(shards - set(names))
        ]
        for s, name in enumerate(names):
            if name not in shards or not found[prefix + name]:
                continue
            raw = (folder / name / "meta.json").read_bytes()
            if xxh64_int(raw) != int(index.arrays["meta_xxh64"][s]):
                problems.append(f"{where}: {name}/meta.json differs from what the index recorded")
            elif int(records[s]) != shard_records(found[prefix + name]):
                problems.append(
                    f"{where}: {name} has {shard_records(found[prefix + name])} records, "
                    f"the index says {int(records[s])}"
                )
    return problems


def _verify_part(path: Path, rel: str, info: dict) -> list[str]:
    """A JSONL part: present, its size and checksum as listed, one line per record."""
    if not path.is_file():
        return [f"{rel}: listed in manifest.json but missing"]
    data = path.read_bytes()
    if "nbytes" in info and len(data) != info["nbytes"]:
        return [f"{rel}: {len(data)} bytes, manifest.json says {info['nbytes']}: truncated"]
    if "xxh64" in info and checksum(data) != info["xxh64"]:
        return [f"{rel}: xxh64 checksum mismatch: the data is corrupted"]
    lines = data.count(b"\n")
    if info.get("records") is not None and lines != info["records"]:
        return [f"{rel}: {lines} lines, manifest.json says {info['records']} records"]
    return []
