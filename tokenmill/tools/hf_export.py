"""`tokenmill export --format hf`: a tokenmill dataset as Hugging Face Arrow, written as
`Dataset.save_to_disk` writes it (one row per stored row, a list column per key), so
`datasets.load_from_disk` reads it with the stored dtypes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tokenmill import __version__
from tokenmill.shards.files import fsync_dir, tmp_path, write_durable
from tokenmill.shards.format import Column, checksum
from tokenmill.shards.reader import read_meta
from tokenmill.tools.convert import dataset_shards, make_parent, shard_columns

_HF_BATCH_ROWS = 1000  # rows per Arrow record batch, as datasets writes them
_HF_BATCH_VALUES = 1 << 28  # and far from the 2**31 values a list column's int32 offsets reach


def export_hf(root: str | Path, out: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Writes the dataset as `datasets.load_from_disk(out)` reads it: one row per stored row,
    a list column per key (list of lists for GRPO's groups), the stored dtypes, plus a `domain`
    column when the dataset has domains; one Arrow file per shard."""
    manifest, shards = dataset_shards(root)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is a file; give a folder to write")
    if out.resolve() in (real := Path(root).resolve(), *real.parents):
        raise ValueError(f"{out} holds the dataset {root}; write the export elsewhere")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it")
        why = _not_an_export(out)
        if why is not None:
            raise FileExistsError(
                f"{out} is not a saved dataset tokenmill exported ({why}): --overwrite replaces only "
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
    make_parent(out)
    tmp = tmp_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    rows = 0
    try:
        names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
        for name, (domain, shard) in zip(names, shards):
            columns = shard_columns(shard)
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


def _not_an_export(folder: Path) -> str | None:
    """Why `folder` is not proven an earlier export (None where it is): a saved dataset's
    state.json is not enough (any `datasets` folder has one); its dataset_info.json must say
    tokenmill exported it, as export_hf writes it."""
    info = folder / "dataset_info.json"
    if not (folder / "state.json").is_file() or not info.is_file():
        return "no state.json and dataset_info.json"
    try:
        description = json.loads(info.read_bytes()).get("description")
    except (ValueError, AttributeError):
        return "its dataset_info.json is not a JSON object"
    if not (isinstance(description, str) and description.startswith("exported by tokenmill ")):
        return "its dataset_info.json does not say tokenmill exported it"
    return None


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
