"""Input files: which files a run reads and how their bytes are opened.

Local paths and URLs (fsspec), folders expanded in a fixed order, `.gz`/`.zst` decompressed
as streams, Parquet opened by pyarrow; every file's identity (size, stamp) for resume.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pyarrow.parquet as pq
import zstandard

INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".parquet")


_CHUNK = 1 << 20


InputPath = Path | str  # a local path, or the URL of a file on an fsspec filesystem (s3://...)


def is_url(path: InputPath) -> bool:
    return isinstance(path, str) and "://" in path


def list_inputs(paths: Sequence[str | Path]) -> list[InputPath]:
    """Input files in order: files as given, folders expanded recursively and sorted.

    Inside folders, names starting with "." or "_" are skipped (as pyarrow datasets do:
    `_SUCCESS`, `.DS_Store`); any other file must have a supported suffix. A URL
    (`s3://bucket/prefix`, `gs://...`, `file:///...`) is listed and read through fsspec.
    """
    found: list[InputPath] = []
    for given in paths:
        files: Sequence[InputPath] = (
            _list_url(given)
            if isinstance(given, str) and is_url(given)
            else _list_local(Path(given))
        )
        for file in files:
            input_suffix(file)
        found.extend(files)
    if not found:
        raise ValueError(f"no input files given ({_supported()})")
    seen: set[str] = set()
    for file in found:
        key = file if isinstance(file, str) else str(file.resolve())
        if key in seen:
            raise ValueError(f"input {file} is listed twice; each file must be read once")
        seen.add(key)
    return found


def _list_local(path: Path) -> list[Path]:
    path = path.absolute()  # the same file for every process that reads it, wherever it runs
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"input not found: {path}")
    files = [
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part[0] in "._" for part in p.relative_to(path).parts)
    ]
    if not files:
        raise ValueError(f"folder {path} holds no input files ({_supported()})")
    return sorted(files, key=lambda p: p.relative_to(path).parts)


def _list_url(url: str) -> list[InputPath]:
    fs, root = _filesystem(url)
    if fs.isfile(root):
        return [url]
    if not fs.isdir(root):
        raise FileNotFoundError(f"input not found: {url}")
    base = root.rstrip("/")
    relative = [
        parts
        for parts in (p[len(base) + 1 :].split("/") for p in fs.find(root))
        if not any(not part or part[0] in "._" for part in parts)  # "" from a key like a//b
    ]
    if not relative:
        raise ValueError(f"folder {url} holds no input files ({_supported()})")
    return [url.rstrip("/") + "/" + "/".join(parts) for parts in sorted(relative)]


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"{url}: reading URLs needs fsspec: pip install fsspec") from None
    return fsspec.core.url_to_fs(url)


def input_identity(path: InputPath) -> tuple[int, str]:
    """(bytes, modification stamp) of an input file: part of a run's identity, so that a file
    rewritten since an interrupted run is not resumed as if it were the same (as far as its
    filesystem's stamps tell: mtime in ns where the filesystem keeps them, else the ETag or
    last-modified time of the object)."""
    if isinstance(path, str) and is_url(path):
        fs, inner = _filesystem(path)
        info = fs.info(inner)
        if info.get("size") is None:
            raise ValueError(f"{path}: its filesystem does not report its size; cannot read it")
        stamps = ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified",
                  "Last-Modified", "updated")  # fmt: skip
        return int(info["size"]), next((str(info[k]) for k in stamps if info.get(k)), "")
    stat = Path(path).stat()
    return stat.st_size, str(stat.st_mtime_ns)


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


@contextmanager
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


@contextmanager
def open_parquet(path: InputPath) -> Iterator[pq.ParquetFile]:
    if not is_url(path):
        with pq.ParquetFile(path) as parquet:
            yield parquet
        return
    with _open_file(path) as file, pq.ParquetFile(file) as parquet:
        yield parquet


@contextmanager
def _open_file(path: InputPath) -> Iterator[IO[bytes]]:
    if isinstance(path, str) and is_url(path):
        fs, inner = _filesystem(path)
        with fs.open(inner, "rb") as file:
            yield file
    else:
        with open(path, "rb") as file:
            yield file


def source_name(path: InputPath) -> str:
    text = str(path).split("?", 1)[0] if is_url(path) else str(path)  # https://.../x.jsonl?sig=...
    return text.rstrip("/").rsplit("/", 1)[-1]


def input_suffix(path: InputPath) -> str:
    """The supported suffix that names the file's format (`.jsonl.gz`, `.parquet`, ...)."""
    name = source_name(path).lower()
    for suffix in INPUT_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ValueError(f"{path}: unsupported input file ({_supported()})")


def _supported() -> str:
    return "supported suffixes: " + ", ".join(INPUT_SUFFIXES)
