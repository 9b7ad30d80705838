"""`tokenmill export` and `tokenmill import`: tokenmill datasets in the formats other trainers read.

Export: to Megatron `.bin/.idx` (one Megatron sequence and document per tokenmill document;
token ids only, so a loss mask is refused unless dropped on purpose) and to Hugging Face
Arrow, as `Dataset.save_to_disk` writes it (one row per stored row, a list column per key).
Import: a Megatron corpus as a `sequence` dataset, one row per Megatron document, token for
token. Shards are read through shards/reader.py and written through shards/writer.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tokenmill import __version__
from tokenmill.preprocess.config import OutputConfig
from tokenmill.preprocess.ledger import Ledger
from tokenmill.preprocess.runlog import Summary
from tokenmill.shards.files import fsync_dir, tmp_path, write_durable
from tokenmill.shards.format import RUN_DIR, Column, checksum
from tokenmill.shards.manifest import read_manifest, write_manifest
from tokenmill.shards.reader import find_shards, map_shard, read_meta
from tokenmill.shards.writer import ShardWriter
from tokenmill.tools.megatron import paths, read_megatron, token_dtype, write_megatron

EXPORT_FORMATS = ("megatron", "hf")


_TOKENS_PER_WRITE = 1 << 24
_HF_BATCH_ROWS = 1000  # rows per Arrow record batch, as datasets writes them
_HF_BATCH_VALUES = 1 << 28  # and far from the 2**31 values a list column's int32 offsets reach


# --- reading a tokenmill dataset ----------------------------------------------------------------
def dataset_shards(root: str | Path) -> tuple[dict | None, list[tuple[str, Path]]]:
    """(manifest, [(domain, shard folder)]) of a finished dataset, in the order stores read it."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a tokenmill dataset folder")
    manifest = read_manifest(root)
    if manifest is None:
        if (root / RUN_DIR).is_dir():
            raise ValueError(
                f"{root}: the run writing this dataset has not finished (no manifest.json); "
                "re-run the same preprocess command first"
            )
        # written by another tool in the seed's format: domains are the shards' parent folders
        shards = [(_domain_of(s.relative_to(root)), s) for s in find_shards(root)]
    else:
        if manifest.get("storage_format") == "jsonl":
            raise ValueError(
                f"{root}: stored as JSONL parts; export reads memory-mapped shards "
                "(preprocess with output.storage_format: bin)"
            )
        shards = [
            (domain, root / domain / info["name"] if domain else root / info["name"])
            for domain, infos in manifest.get("domains", {}).items()
            for info in infos
        ]
    if not shards:
        raise FileNotFoundError(f"{root}: no shard (a folder with meta.json) below it")
    return manifest, shards


def _domain_of(relative: Path) -> str:
    parent = relative.parent.as_posix()
    return "" if parent == "." else parent


def _columns(shard: Path) -> dict[str, Column]:
    return map_shard(shard, read_meta(shard))


# --- export to Megatron -------------------------------------------------------------------------
def export_megatron(
    root: str | Path,
    prefix: str | Path,
    tokens_only: bool = False,
    overwrite: bool = False,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Writes the dataset's `sequence` tokens as PREFIX.bin/PREFIX.idx, in stored order.

    One Megatron sequence, and one document, per tokenmill document: a row's `doc_lengths`
    pieces, a piece that goes on with the one before it (positions counting on, as `stream`
    packing cuts documents at rows and shards) joined to it; without `doc_lengths`, each row.
    Megatron keeps token ids only: a dataset with a `loss_mask` is refused unless
    `tokens_only`, since every token of it, prompts included, would then train.
    """
    manifest, shards = dataset_shards(root)
    keys = list(read_meta(shards[0][1]))
    if "sequence" not in keys:
        raise ValueError(
            f"{root}: no `sequence` key (keys: {', '.join(keys)}): Megatron's format holds one "
            "token stream, as seq and sft data have; export this one with --to hf"
        )
    dropped = [k for k in keys if k not in ("sequence", "position_ids", "doc_lengths")]
    if "loss_mask" in keys:
        if not tokens_only:
            raise ValueError(
                f"{root} has a loss_mask, which Megatron's .bin/.idx cannot hold: every token "
                "would train, prompts included. Pass --tokens-only to export the tokens anyway, "
                "or export --to hf to keep the mask"
            )
        if warn is not None:
            warn(f"exporting tokens only: {', '.join(dropped)} left behind; all tokens will train")
    bin_path, idx_path = paths(prefix)
    for path in (bin_path, idx_path):
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass --overwrite to replace it")
    _make_parent(bin_path)
    mode = ((manifest or {}).get("config") or {}).get("output", {}).get("position_ids_mode")
    lengths, low, high = _document_lengths(shards, join=mode in (None, "doc_reset"))
    dtype = token_dtype(low, high)
    write_megatron(prefix, dtype, lengths, _tokens(shards))
    return {
        "bin": str(bin_path),
        "idx": str(idx_path),
        "dtype": dtype.name,
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "left_behind": dropped,
    }


def _document_lengths(shards: list[tuple[str, Path]], join: bool) -> tuple[np.ndarray, int, int]:
    """Every document's length, in order, and the lowest and highest token id."""
    out: list[np.ndarray] = []
    low, high = 0, 0
    current: int | None = None  # the length so far of the document the last piece belongs to
    last_position: int | None = None
    domain: str | None = None
    for shard_domain, shard in shards:
        if shard_domain != domain:  # documents never run from one domain into the next
            if current is not None:
                out.append(np.array([current]))
            current, last_position, domain = None, None, shard_domain
        columns = _columns(shard)
        sequence = columns["sequence"]
        if len(sequence.values):
            low = min(low, int(sequence.values.min()))
            high = max(high, int(sequence.values.max()))
        if "doc_lengths" in columns:
            pieces = np.asarray(columns["doc_lengths"].values, dtype=np.int64)
        elif sequence.offsets is not None:
            pieces = np.diff(sequence.offsets)
        else:  # a stream-only shard of the seed's format: one document
            pieces = np.array([len(sequence.values)], dtype=np.int64)
        if not len(pieces):
            continue
        opens = np.ones(len(pieces), dtype=bool)
        positions = columns.get("position_ids")
        if join and positions is not None and len(positions.values):
            starts = np.concatenate([[0], np.cumsum(pieces)[:-1]])
            first = np.asarray(positions.values[starts], dtype=np.int64)
            before = np.asarray(positions.values[np.maximum(starts - 1, 0)], dtype=np.int64)
            before[0] = -2 if last_position is None else last_position
            opens = (first == 0) | (first != before + 1)
            last_position = int(positions.values[-1])
        if current is None:
            opens[0] = True
        starts_at = np.flatnonzero(opens)
        head = int(pieces[: starts_at[0]].sum()) if len(starts_at) else int(pieces.sum())
        if head:
            current = (current or 0) + head
        if len(starts_at):
            if current is not None:
                out.append(np.array([current]))
            sums = np.add.reduceat(pieces, starts_at)
            out.append(sums[:-1])
            current = int(sums[-1])
    if current is not None:
        out.append(np.array([current]))
    lengths = np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)
    return lengths, low, high


def _tokens(shards: list[tuple[str, Path]]) -> Iterator[np.ndarray]:
    for _, shard in shards:
        values = _columns(shard)["sequence"].values
        for start in range(0, len(values), _TOKENS_PER_WRITE):
            yield values[start : start + _TOKENS_PER_WRITE]


# --- export to Hugging Face Arrow ----------------------------------------------------------------
def export_hf(root: str | Path, out: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Writes the dataset as `datasets.load_from_disk(out)` reads it: one row per stored row,
    a list column per key (list of lists for GRPO's groups), the stored dtypes, plus a `domain`
    column when the dataset has domains; one Arrow file per shard."""
    manifest, shards = dataset_shards(root)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is a file; give a folder to write")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it")
        if not (out / "state.json").is_file():
            raise FileExistsError(
                f"{out} is not a saved dataset (no state.json): --overwrite replaces only "
                "what an export wrote; remove it yourself"
            )
    first = read_meta(shards[0][1])
    keys = list(first)
    with_domain = any(domain for domain, _ in shards)
    columns_of = {k: (first[k]["dtype"], "items" in first[k]) for k in keys}
    schema = pa.schema(
        [pa.field(k, _arrow_type(dtype, nested)) for k, (dtype, nested) in columns_of.items()]
        + ([pa.field("domain", pa.string())] if with_domain else [])
    )
    _make_parent(out)
    tmp = tmp_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    rows = 0
    try:
        names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
        for name, (domain, shard) in zip(names, shards):
            columns = _columns(shard)
            if list(columns) != keys:
                raise ValueError(f"{shard}: keys {list(columns)}, the first shard has {keys}")
            with pa.OSFile(str(tmp / name), "wb") as sink:
                with pa.ipc.new_stream(sink, schema) as writer:
                    for batch in _record_batches(shard, columns, schema, domain):
                        writer.write_batch(batch)
                        rows += batch.num_rows
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
        features: dict[str, Any] = {
            k: _feature(dtype, nested) for k, (dtype, nested) in columns_of.items()
        }
        if with_domain:
            features["domain"] = {"dtype": "string", "_type": "Value"}
        info = {
            "description": f"exported by tokenmill {__version__} from {root}",
            "features": features,
        }
        state: dict[str, Any] = {
            "_data_files": [{"filename": name} for name in names],
            "_fingerprint": checksum(json.dumps([manifest, keys]).encode()),
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        write_durable(tmp / "dataset_info.json", (json.dumps(info, indent=2) + "\n").encode())
        write_durable(tmp / "state.json", (json.dumps(state, indent=2) + "\n").encode())
        fsync_dir(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"folder": str(out), "rows": rows, "files": len(shards), "columns": schema.names}


def _arrow_type(dtype: str, nested: bool) -> pa.DataType:
    inner = pa.list_(pa.from_numpy_dtype(np.dtype(dtype)))
    return pa.list_(inner) if nested else inner


def _feature(dtype: str, nested: bool) -> dict[str, Any]:
    """A `datasets` feature: List(Value(dtype)), or List(List(Value(dtype))) for a group key."""
    inner = {"feature": {"dtype": dtype, "_type": "Value"}, "_type": "List"}
    return {"feature": inner, "_type": "List"} if nested else inner


def _record_batches(
    shard: Path, columns: dict[str, Column], schema: pa.Schema, domain: str
) -> Iterator[pa.RecordBatch]:
    """The shard's rows, up to `_HF_BATCH_ROWS` (and `_HF_BATCH_VALUES` values) a batch."""
    for key, column in columns.items():
        if column.offsets is None:
            raise ValueError(
                f"{shard}: key {key!r} has no row offsets (a stream-only shard): no rows to export"
            )
    bounds = {k: _row_bounds(c) for k, c in columns.items()}
    rows = len(next(iter(columns.values())).offsets) - 1  # type: ignore[arg-type]
    start = 0
    while start < rows:
        stop = min(start + _HF_BATCH_ROWS, rows)
        for b in bounds.values():  # fewer rows where they are long
            limit = int(np.searchsorted(b, b[start] + _HF_BATCH_VALUES, side="right")) - 1
            stop = max(start + 1, min(stop, limit))
        arrays = [_list_array(columns[k], start, stop) for k in columns]
        if "domain" in schema.names:
            arrays.append(pa.array([domain] * (stop - start), pa.string()))
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)
        start = stop


def _row_bounds(column: Column) -> np.ndarray:
    """Where each row starts and ends in the flat values."""
    assert column.offsets is not None
    return column.offsets if column.items is None else column.items[column.offsets]


def _list_array(column: Column, start: int, stop: int) -> pa.Array:
    offsets = np.asarray(column.offsets[start : stop + 1], dtype=np.int64)  # type: ignore[index]
    if column.items is None:
        values = pa.array(np.asarray(column.values[offsets[0] : offsets[-1]]))
        return pa.ListArray.from_arrays(pa.array((offsets - offsets[0]).astype(np.int32)), values)
    items = np.asarray(column.items[offsets[0] : offsets[-1] + 1], dtype=np.int64)
    values = pa.array(np.asarray(column.values[items[0] : items[-1]]))
    inner = pa.ListArray.from_arrays(pa.array((items - items[0]).astype(np.int32)), values)
    return pa.ListArray.from_arrays(pa.array((offsets - offsets[0]).astype(np.int32)), inner)


# --- import from Megatron -----------------------------------------------------------------------
IMPORT_KEYS = {"sequence": "int32", "position_ids": "int32", "doc_lengths": "int32"}


def import_megatron(
    prefix: str | Path,
    out: str | Path,
    max_tokens_per_shard: int | None = None,
    overwrite: bool = False,
) -> Summary:
    """Writes a Megatron corpus as a tokenmill `seq` dataset: one row per Megatron document
    (its sequences joined), with `position_ids` from 0 and `doc_lengths` as the pipeline writes
    them, token for token in corpus order; an empty document is counted and left out."""
    start = time.perf_counter()
    corpus = read_megatron(prefix)
    if not int(corpus.lengths.sum()):
        raise ValueError(f"{prefix}: the corpus holds no token; nothing to import")
    if corpus.dtype.itemsize > 4 and len(corpus.tokens):
        low, high = int(corpus.tokens.min()), int(corpus.tokens.max())
        if low < 0 or high > np.iinfo(np.int32).max:
            raise ValueError(f"{prefix}: token ids in [{low}, {high}] do not fit int32")
    out = Path(out).absolute()
    _fresh_output(out, overwrite)
    if max_tokens_per_shard is None:
        max_tokens_per_shard = OutputConfig().max_tokens_per_shard
    writer = ShardWriter(out, IMPORT_KEYS, "sequence", max_tokens_per_shard)
    ledger = Ledger()
    try:
        for d in range(corpus.documents):
            tokens = corpus.document(d)
            ledger.records_read += 1
            if not len(tokens):
                ledger.drop("too_short", 1, 0)
                continue
            n = len(tokens)
            row = {
                "sequence": tokens,
                "position_ids": np.arange(n, dtype=np.int32),
                "doc_lengths": np.array([n], dtype=np.int32),
            }
            writer.add(row)
            ledger.records_written += 1
            ledger.tokens_read += n
            ledger.tokens_written += n
        infos = writer.close()
    except BaseException:
        writer.abort()
        shutil.rmtree(out, ignore_errors=True)
        raise
    empty = ledger.dropped.get("too_short", {}).get("records", 0)
    summary = Summary(
        records_read=ledger.records_read,
        records_written=ledger.records_written,
        skipped={"too_short": empty} if empty else {},
        rows=ledger.records_written,
        tokens=ledger.tokens_written,
        trained_tokens=ledger.tokens_written,
        shards=len(infos),
        seconds=time.perf_counter() - start,
        tokens_read=ledger.tokens_read,
        dropped=ledger.as_dict()["dropped"],
        domains={"": ledger.as_dict()},
    )
    bin_path, idx_path = paths(prefix)
    write_manifest(
        out,
        {
            "tool": f"tokenmill {__version__}",
            "source": {
                "format": "megatron",
                "bin": str(bin_path.absolute()),
                "idx": str(idx_path.absolute()),
                "dtype": corpus.dtype.name,
                "sequences": len(corpus.lengths),
                "documents": corpus.documents,
            },
            "keys": dict(IMPORT_KEYS),
            "primary_key": "sequence",
            "storage_format": "bin",
            "domains": {"": infos},
            "summary": summary.as_dict(),
        },
    )
    return summary


# --- output paths -------------------------------------------------------------------------------
def _fresh_output(out: Path, overwrite: bool) -> None:
    """An empty folder to write a dataset into; `overwrite` replaces only a tokenmill dataset."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is a file; give a folder to write")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it")
        if read_manifest(out) is None and not (out / RUN_DIR).is_dir():
            raise FileExistsError(
                f"{out} is not a tokenmill dataset (no manifest.json): --overwrite replaces "
                "only what tokenmill wrote; remove it yourself"
            )
        shutil.rmtree(out)
    _make_parent(out)
    out.mkdir(exist_ok=True)


def _make_parent(path: Path) -> None:
    parent = path.absolute().parent
    for folder in (parent, *parent.parents):
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder}: is a file, so {path} cannot be written below it")
    parent.mkdir(parents=True, exist_ok=True)
