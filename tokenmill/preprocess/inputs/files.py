"""Inputs: which files (or in-memory datasets) a run reads and how their bytes are opened.

Local paths and URLs alike (storage/location.py lists, opens and stamps either), folders
expanded in a fixed order (a folder written by Hugging Face `datasets` read as its data
files), `.gz`/`.zst` decompressed as streams, Parquet and Arrow opened by pyarrow, a
`datasets.Dataset`/`IterableDataset` taken as it is; every input's identity (size, stamp)
for resume.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from tokenmill.preprocess.inputs.hf import DatasetInput, hf_dataset_kind, hf_layout
from tokenmill.storage.location import Folder, file_name, file_stamp, list_location, open_file

INPUT_SUFFIXES = tuple(
    ".jsonl .json .jsonl.gz .json.gz .jsonl.zst .json.zst .parquet .arrow "
    ".txt .txt.gz .txt.zst".split()
)


_CHUNK = 1 << 20


InputPath = Path | str | DatasetInput  # a local path, a URL (s3://...), or an in-memory dataset


def input_list(inputs: Any) -> list[Any]:
    """The inputs a run was given, as a list: one path, URL or dataset, or a sequence of them."""
    if isinstance(inputs, (str, Path)) or hf_dataset_kind(inputs) is not None:
        return [inputs]
    return list(inputs)


def list_inputs(paths: Sequence[Any]) -> list[InputPath]:
    """Inputs in order: files and datasets as given, folders expanded recursively and sorted.

    Inside folders, names starting with "." or "_" are skipped (as pyarrow datasets do:
    `_SUCCESS`, `.DS_Store`), and so are a Hugging Face dataset card (`README.md`,
    `dataset_infos.json`); any other file must have a supported suffix. A folder written by
    `Dataset.save_to_disk` is read as the Arrow files its `state.json` lists; one of a
    `DatasetDict`, or a Hub snapshot holding several splits (`data/train-00000-of-00001.parquet`,
    `data/test-...`), is refused: pass one split. A URL (`s3://bucket/prefix`, `gs://...`,
    `file:///...`) is listed and read through fsspec.
    """
    found: list[InputPath] = []
    for position, given in enumerate(input_list(paths), start=1):
        kind = hf_dataset_kind(given)
        files: Sequence[InputPath]
        if kind in ("Dataset", "IterableDataset"):
            files = [DatasetInput(given, position)]
        elif kind is not None:
            splits = ", ".join(map(str, given))
            raise ValueError(
                f"input {position} is a {kind} (splits: {splits}); pass one split, "
                f"such as dataset[{next(iter(given), 'train')!r}]"
            )
        elif isinstance(given, (str, Path)):
            files = _list(given)
        else:
            raise TypeError(
                f"input {position}: expected a path, a URL or a Hugging Face datasets.Dataset, "
                f"got {type(given).__name__}"
            )
        for file in files:
            if not isinstance(file, DatasetInput):
                input_suffix(file)
        found.extend(files)
    if not found:
        raise ValueError(f"no input files given ({_supported()})")
    seen: set[Any] = set()
    for file in found:
        if isinstance(file, DatasetInput):
            key: Any = id(file.dataset)
        else:
            key = file if isinstance(file, str) else str(file.resolve())
        if key in seen:
            raise ValueError(f"input {file} is listed twice; each input must be read once")
        seen.add(key)
    return found


def _list(given: str | Path) -> list[InputPath]:
    """A file as it is; a folder's files, as `hf_layout` picks them."""
    found = list_location(given)
    if not isinstance(found, Folder):
        return [found]
    if Path(found.root).is_dir():  # a local folder (a URL's listing has no links)
        _refuse_dangling_links(Path(found.root))
    chosen = hf_layout(found.root, found.files, found.read)
    if not chosen:
        raise ValueError(f"folder {found.root} holds no input files ({_supported()})")
    return [found.join(parts) for parts in chosen]


def _refuse_dangling_links(root: Path) -> None:
    """A link in an input folder whose target is gone is an error naming it: skipped without a
    word, its records would be missing from the run (names starting with "." or "_" aside, as
    the folder's listing leaves them out)."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for name in names + dirs:
            path = Path(folder) / name
            if not name.startswith((".", "_")) and path.is_symlink() and not path.exists():
                raise FileNotFoundError(
                    f"{path}: a link to {os.readlink(path)}, which does not exist; fix or remove it"
                )


def input_identity(path: InputPath) -> tuple[int, str]:
    """(bytes, modification stamp) of an input file: part of a run's identity, so that a file
    rewritten since an interrupted run is not resumed as if it were the same (as far as its
    filesystem's stamps tell: mtime in ns where the filesystem keeps them, else the ETag or
    last-modified time of the object).

    A `datasets.Dataset` is identified by (rows, its fingerprint); an `IterableDataset` has no
    identity to check, so it gets a fresh stamp: a run on one is never resumed."""
    if isinstance(path, DatasetInput):
        fingerprint = getattr(path.dataset, "_fingerprint", None)
        if fingerprint is None:
            return -1, f"unidentified-{uuid.uuid4().hex}"
        return len(path.dataset), str(fingerprint)
    return file_stamp(path)


class _ZstdRaw(io.RawIOBase):
    """Decompressed bytes of a .zst file, frame after frame; raises EOFError if the last frame
    is cut short (zstandard's stream_reader returns a silent short read there)."""

    def __init__(self, file: IO[bytes]):
        self._file = file
        self._dctx = zstandard.ZstdDecompressor()
        self._frame: Any = None
        self._unused = b""
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            data = self._unused or self._file.read(_CHUNK)
            self._unused = b""
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("zstd stream ends inside a frame")
                return 0
            if self._frame is None or self._frame.eof:
                self._frame = self._dctx.decompressobj()
            self._out = memoryview(self._frame.decompress(data))
            if self._frame.eof:
                self._unused = self._frame.unused_data
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


@contextlib.contextmanager
def open_bytes(path: InputPath) -> Iterator[IO[bytes]]:
    """The file's bytes, decompressed by its suffix (.gz, .zst); only a plain file can seek."""
    name = source_name(path).lower()
    with _open_file(path) as file:
        if name.endswith(".gz"):
            with gzip.GzipFile(fileobj=file, mode="rb") as stream:
                yield stream  # type: ignore[misc]
        elif name.endswith(".zst"):
            with io.BufferedReader(_ZstdRaw(file), _CHUNK) as stream:
                yield stream
        else:
            yield file


@contextlib.contextmanager
def open_parquet(path: InputPath) -> Iterator[pq.ParquetFile]:
    with _open_file(path) as file, pq.ParquetFile(file) as parquet:
        yield parquet


@contextlib.contextmanager
def open_arrow(path: InputPath) -> Iterator[Iterator[pa.RecordBatch]]:
    """The record batches of an Arrow file: the IPC stream format `datasets` writes, or the
    IPC file format (which opens with `ARROW1`); a local file is memory-mapped."""
    with _open_file(path, mapped=True) as source:
        magic = source.read(6)
        source.seek(0)
        if magic == b"ARROW1":
            reader = pa.ipc.open_file(source)
            yield (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            yield iter(pa.ipc.open_stream(source))


def dataset_batches(path: DatasetInput, rows: int) -> Iterator[pa.Table]:
    """A `datasets.Dataset`/`IterableDataset`, `rows` rows at a time, as Arrow tables: streamed,
    and whatever format (torch, numpy) the user set on it left aside."""
    return path.dataset.with_format("arrow").iter(batch_size=rows)


def _open_file(path: InputPath, mapped: bool = False) -> contextlib.AbstractContextManager[Any]:
    if isinstance(path, DatasetInput):
        raise TypeError(f"{path}: an in-memory dataset has no bytes to open; read its records")
    return open_file(path, mapped)


def source_name(path: InputPath) -> str:
    """The input's name: a file's (a URL's query left out), or an in-memory dataset's."""
    if isinstance(path, DatasetInput):
        return path.name
    return file_name(path)


def input_suffix(path: InputPath) -> str:
    """The supported suffix that names the file's format (`.jsonl.gz`, `.parquet`, ...)."""
    name = source_name(path).lower()
    for suffix in INPUT_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ValueError(f"{path}: unsupported input file ({_supported()})")


def _supported() -> str:
    return "supported suffixes: " + ", ".join(INPUT_SUFFIXES)
