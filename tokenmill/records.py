"""Records: the first stage of the flow, raw files -> `Record`s that remember their origin.

Reads .jsonl / .json (one object or a list) and their .gz / .zst forms, and .parquet, all
streamed. Every bad line becomes a `RecordError` naming file, line and field; the caller either
lets it raise or collects it with `on_error` and goes on with the next line.
"""

from __future__ import annotations

import codecs
import gzip
import io
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".parquet")

# Every slug a RecordError may carry; skip counts are keyed by these.
REASONS = (
    "bad_json", "bad_utf8", "not_object", "missing_field", "wrong_type", "empty", "unknown_role",
    "no_trained_tokens", "bad_value", "template_error", "too_short", "too_long",
    "truncated_file", "corrupt_file",
)  # fmt: skip

_PARQUET_BATCH_ROWS = 1024
_CHUNK = 1 << 20
_STREAM_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError, pa.ArrowException)


@dataclass(frozen=True, slots=True)
class Record:
    """One raw JSON object and where it came from (1-based line, or position in a list/Parquet)."""

    source: str
    line: int
    data: dict


class RecordError(ValueError):
    """Bad input at `source:line`; `reason` is the slug skip counts are grouped by."""

    def __init__(self, source: str, line: int, field: str | None, message: str, reason: str):
        if reason not in REASONS:
            raise ValueError(f"unknown RecordError reason {reason!r}; expected one of {REASONS}")
        where = f"{source}:{line}: " + (f"{field}: " if field is not None else "")
        super().__init__(where + message)
        self.source, self.line, self.field = source, line, field
        self.message, self.reason = message, reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries in the pipeline; rebuild from the fields, not str(self).
        return (type(self), (self.source, self.line, self.field, self.message, self.reason))


OnError = Callable[[RecordError], None] | None


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


def read_records(
    path: InputPath, on_error: OnError = None, offsets: list[int] | None = None
) -> Iterator[Record]:
    """Stream the records of one file. Bad input raises, or goes to `on_error` and reading goes on.

    A truncated or undecodable file is reported once and ends that file. For JSONL, `offsets`
    (if given) gets the byte offset of each record's line in the decompressed stream, so that
    a reader elsewhere can seek to it (the Ray engine's scan).
    """
    if not is_url(path):
        path = Path(path)
    suffix = input_suffix(path)
    if suffix == ".parquet":
        yield from _read_parquet(path, on_error)
    elif suffix.startswith(".jsonl"):
        yield from _read_jsonl(path, on_error, offsets)
    else:
        yield from _read_json(path, on_error)


def get_field(record: Record, path: str) -> Any:
    """Value at `path` ("text" or dotted "meta.lang"); missing and null are both missing_field."""
    value: Any = record.data
    walked: list[str] = []
    for key in path.split("."):
        if not isinstance(value, dict):
            raise _error(record, ".".join(walked), f"expected an object, got {_type_name(value)}")
        walked.append(key)
        if key not in value:
            keys = ", ".join(list(value)[:10]) + (", ..." if len(value) > 10 else "")
            message = f"missing field (record has: {keys or 'no fields'})"
            raise _error(record, ".".join(walked), message, "missing_field")
        value = value[key]
        if value is None:
            raise _error(record, ".".join(walked), "is null", "missing_field")
    return value


def check_messages(
    record: Record, field: str, value: Any, roles: Collection[str] | None
) -> list[dict]:
    """A chat: a non-empty list of objects with string "role" and "content" (roles None: any role).

    Messages are indexed from 0 in errors (`messages[3].role`); other keys are kept.
    """
    if not isinstance(value, list):
        raise _error(record, field, f"expected a list of messages, got {_type_name(value)}")
    if not value:
        raise _error(record, field, "empty conversation", "empty")
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise _error(record, where, f"expected a message object, got {_type_name(message)}")
        role = _message_string(record, where, message, "role")
        _message_string(record, where, message, "content")
        if roles is not None and role not in roles:
            expected = f"expected one of [{', '.join(sorted(roles))}], got {_show(role)}"
            raise _error(record, f"{where}.role", expected, "unknown_role")
    return list(value)


def _error(record: Record, field: str, message: str, reason: str = "wrong_type") -> RecordError:
    return RecordError(record.source, record.line, field, message, reason)


def _message_string(record: Record, where: str, message: dict, key: str) -> str:
    field = f"{where}.{key}"
    if key not in message:
        raise _error(record, field, "missing field", "missing_field")
    value = message[key]
    if value is None:
        raise _error(record, field, "is null", "missing_field")
    if not isinstance(value, str):
        raise _error(record, field, f"expected a string, got {_type_name(value)} {_show(value)}")
    return value


# ---- reading ---------------------------------------------------------------------------


def _read_jsonl(
    path: InputPath, on_error: OnError, offsets: list[int] | None = None
) -> Iterator[Record]:
    source = str(path)
    position = 0
    with open_bytes(path) as stream:
        for line, raw in _numbered_lines(stream, path, on_error):
            start, position = position, position + len(raw)
            if line == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if raw[:1] in b" \t\r\n" and not raw.strip(b" \t\r\n"):
                continue
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                err = _json_error(source, line, raw, exc, last_line=not raw.endswith(b"\n"))
                _report(err, on_error)
                continue
            if not isinstance(data, dict):
                message = f"expected a JSON object, got {_type_name(data)}"
                _report(RecordError(source, line, None, message, "not_object"), on_error)
                continue
            if offsets is not None:
                offsets.append(start)
            yield Record(source, line, data)


def _numbered_lines(
    stream: IO[bytes], path: InputPath, on_error: OnError
) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) pairs; a stream that breaks is reported once and ends the file."""
    line = 0
    try:
        for raw in stream:
            line += 1
            yield line, raw
    except _STREAM_ERRORS as exc:
        _report(_stream_error(path, line, exc), on_error)


def _read_json(path: InputPath, on_error: OnError) -> Iterator[Record]:
    """A .json file is one document, an object or a list of objects (line = 1-based position);
    it is read whole, as orjson has no incremental parser."""
    source = str(path)
    try:
        with open_bytes(path) as stream:
            raw = stream.read()
    except _STREAM_ERRORS as exc:
        _report(_stream_error(path, None, exc), on_error)
        return
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    if not raw.strip(b" \t\r\n"):
        return
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        _report(_json_error(source, None, raw, exc, last_line=False), on_error)
        return
    if isinstance(data, dict):
        yield Record(source, 1, data)
    elif isinstance(data, list):
        for position, item in enumerate(data, start=1):
            if isinstance(item, dict):
                yield Record(source, position, item)
            else:
                message = f"list element: expected a JSON object, got {_type_name(item)}"
                _report(RecordError(source, position, None, message, "not_object"), on_error)
    else:
        message = f"expected a JSON object or a list of objects, got {_type_name(data)}"
        _report(RecordError(source, 1, None, message, "not_object"), on_error)


def _read_parquet(path: InputPath, on_error: OnError) -> Iterator[Record]:
    """Rows of a Parquet file, one record batch at a time (line = 1-based row)."""
    source = str(path)
    row = 0
    try:
        with open_parquet(path) as parquet:
            for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
                for data in batch.to_pylist():
                    row += 1
                    yield Record(source, row, data)
    except _STREAM_ERRORS as exc:
        _report(_stream_error(path, row, exc), on_error)


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
    name = _name(path).lower()
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


def _name(path: InputPath) -> str:
    text = str(path).split("?", 1)[0] if is_url(path) else str(path)  # https://.../x.jsonl?sig=...
    return text.rstrip("/").rsplit("/", 1)[-1]


# ---- error messages ----------------------------------------------------------------------


def _report(err: RecordError, on_error: OnError) -> None:
    if on_error is None:
        raise err
    on_error(err)


def _stream_error(path: InputPath, lines_done: int | None, exc: BaseException) -> RecordError:
    """A file that cannot be read on; `lines_done` None for a .json document (no lines yet)."""
    after = "" if lines_done is None else f", after line {lines_done}"
    line = 1 if lines_done is None else lines_done + 1
    if isinstance(exc, EOFError):
        message = (
            f"file ends early{after} (truncated .{_name(path).rsplit('.', 1)[-1]} stream: {exc})"
        )
        return RecordError(str(path), line, None, message, "truncated_file")
    return RecordError(str(path), line, None, f"cannot read the file{after}: {exc}", "corrupt_file")


def _json_error(
    source: str, line: int | None, raw: bytes, exc: orjson.JSONDecodeError, last_line: bool
) -> RecordError:
    """One orjson failure as a RecordError; `line` None means a whole .json document."""
    if "not valid UTF-8" in exc.msg:
        at_line, text, reason = *_utf8_error(raw), "bad_utf8"
    else:
        at_line, reason = exc.lineno, "bad_utf8" if "surrogate" in exc.msg else "bad_json"
        following = exc.doc[exc.pos : exc.pos + 9] if isinstance(exc.doc, str) else ""
        text = f"invalid JSON at column {exc.colno}: {_explain(exc.msg, following)}"
    if last_line:
        text = f"truncated last line (no newline at end of file): {text}"
    return RecordError(source, line if line is not None else at_line, None, text, reason)


def _explain(msg: str, following: str) -> str:
    """orjson's message, with the cause spelled out for the failures people actually hit."""
    if "surrogate" in msg:
        return f"{msg} (a lone \\ud800-\\udfff escape cannot be encoded as UTF-8)"
    if following.startswith(("NaN", "Infinity")):
        word = "NaN" if following.startswith("NaN") else "Infinity"
        return f"{word} is not valid JSON (write null or a finite number)"
    if "infinity" in msg:
        return "number out of range: it overflows a double to infinity"
    if "depth limit" in msg:
        return "nested deeper than the 1024 levels orjson accepts"
    return msg


def _utf8_error(raw: bytes) -> tuple[int, str]:
    """(text line, message) for the first byte that is not UTF-8."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = raw.count(b"\n", 0, bad.start) + 1
        column = bad.start - raw.rfind(b"\n", 0, bad.start)
        return line, f"not UTF-8 text: byte 0x{raw[bad.start]:02x} at byte {column} of the line"
    return 1, "not UTF-8 text"


def input_suffix(path: InputPath) -> str:
    """The supported suffix that names the file's format (`.jsonl.gz`, `.parquet`, ...)."""
    name = _name(path).lower()
    for suffix in INPUT_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ValueError(f"{path}: unsupported input file ({_supported()})")


def _supported() -> str:
    return "supported suffixes: " + ", ".join(INPUT_SUFFIXES)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    return "object" if isinstance(value, dict) else names.get(type(value), type(value).__name__)


def _show(value: Any, limit: int = 60) -> str:
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
