"""Records: input files (opened by inputs/files.py) -> `Record`s that remember their origin.

Reads .jsonl / .json (one object or a list) and their .gz / .zst forms, .parquet, .arrow
and the rows of a Hugging Face `datasets.Dataset`/`IterableDataset`, all streamed;
`parse_line` is the one JSONL line parser (preprocessing, the Ray engine's reads
and the training store's raw route all use it). Every bad line becomes a `RecordError` naming file, line and field; the caller either
lets it raise or collects it with `on_error` and goes on with the next line.
"""

from __future__ import annotations

import codecs
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

import orjson
import pyarrow as pa
import zstandard

from tokenmill.preprocess.inputs.files import (
    InputPath,
    dataset_batches,
    input_suffix,
    open_arrow,
    open_bytes,
    open_parquet,
    source_name,
)
from tokenmill.preprocess.inputs.hf import DatasetInput
from tokenmill.storage.location import located

# Every slug a RecordError may carry; skip counts are keyed by these.
REASONS = tuple(
    "bad_json bad_utf8 not_object missing_field wrong_type empty unknown_role no_trained_tokens "
    "bad_value template_error too_short too_long identical_pair truncated_file corrupt_file "
    "mask_unproven content_dropped".split()
)


PARQUET_BATCH_ROWS = 1024  # rows turned into Python objects at a time (Parquet, Arrow, datasets)


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
        self.tokens = 0  # tokens the record was rendered to before it was dropped (the ledger's)

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries in the pipeline; rebuild from the fields, not str(self).
        fields = (self.source, self.line, self.field, self.message, self.reason)
        return (type(self), fields, {"tokens": self.tokens})


ON_ERROR = ("raise", "skip")  # what a run does with a malformed record
TextUnit = Literal["file", "line"]  # what one record of a .txt file is
OnError = Callable[[RecordError], None] | None


def read_records(
    path: InputPath,
    on_error: OnError = None,
    text_unit: TextUnit = "file",
) -> Iterator[Record]:
    """Stream the records of one file. Bad input raises, or goes to `on_error` and reading goes on.

    A truncated or undecodable file is reported once and ends that file. A `.txt` file is one record
    `{"text"}`, or one per line where `text_unit` is "line".
    """
    if isinstance(path, DatasetInput):
        yield from _read_dataset(path, on_error)
        return
    path = located(path)
    suffix = input_suffix(path)
    if suffix == ".parquet":
        yield from _read_parquet(path, on_error)
    elif suffix == ".arrow":
        yield from _read_arrow(path, on_error)
    elif suffix.startswith(".jsonl"):
        yield from _read_jsonl(path, on_error)
    elif suffix.startswith(".txt"):
        yield from _read_text(path, on_error, text_unit)
    else:
        yield from _read_json(path, on_error)


def _read_jsonl(path: InputPath, on_error: OnError) -> Iterator[Record]:
    source = str(path)
    with open_bytes(path) as stream:
        for line, raw in _numbered_lines(stream, path, on_error):
            if (record := _line_record(raw, source, line, on_error)) is not None:
                yield record


_COUNT_BYTES = 16 << 20


def read_jsonl_range(path: InputPath, start: int, end: int, on_error: OnError) -> Iterator[Record]:
    """The records of a plain JSONL file whose lines start at a byte in [start, end): a line
    that starts before `end` is read whole, the one it cuts belongs to the range before.
    Line numbers count from the file's start (a newline count of the bytes before `start`,
    about 1 s per 5 GB), so errors name the same line as a whole read."""
    source = str(path)
    with open_bytes(path) as stream:
        line = 0
        position = max(start - 1, 0)
        while position > 0 and stream.tell() < position:  # newlines before the range
            block = stream.read(min(_COUNT_BYTES, position - stream.tell()))
            if not block:
                return
            line += block.count(b"\n")
        if start > 0:
            tail = stream.readline()  # to the end of the line holding byte start - 1
            position = start - 1 + len(tail)
            line += tail.endswith(b"\n")
        while position < end:
            raw = stream.readline()
            if not raw:
                return
            line += 1
            position += len(raw)
            if (record := _line_record(raw, source, line, on_error)) is not None:
                yield record


def _line_record(raw: bytes, source: str, line: int, on_error: OnError) -> Record | None:
    """A JSONL line's record; None for a blank line, or a bad one reported to `on_error`."""
    if raw[:1] in b" \t\r\n" and not raw.strip(b" \t\r\n"):
        return None
    try:
        return Record(source, line, parse_line(raw, source, line))
    except RecordError as err:
        _report(err, on_error)
        return None


def parse_line(raw: bytes, source: str, line: int) -> dict:
    """One JSONL line as a JSON object (a UTF-8 BOM opening the file is dropped), or a
    RecordError naming `source:line`."""
    if line == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _json_error(source, line, raw, exc, last_line=not raw.endswith(b"\n")) from None
    if not isinstance(data, dict):
        message = f"expected a JSON object, got {type_name(data)}"
        raise RecordError(source, line, None, message, "not_object")
    return data


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


def _read_whole(path: InputPath, on_error: OnError) -> bytes | None:
    """A file read whole, its UTF-8 BOM dropped; None (reported) where it cannot be read."""
    try:
        with open_bytes(path) as stream:
            raw = stream.read()
    except _STREAM_ERRORS as exc:
        _report(_stream_error(path, None, exc), on_error)
        return None
    return raw.removeprefix(codecs.BOM_UTF8)


def _read_text(path: InputPath, on_error: OnError, text_unit: TextUnit) -> Iterator[Record]:
    """Plain text as `{"text"}` records: the whole file (line 1), or each line (its number, its
    line break left out; blank lines kept, for the filters to count)."""
    source = str(path)
    raw = _read_whole(path, on_error)
    if raw is None:
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at_line = raw[: exc.start].count(b"\n") + 1
        message = f"not valid UTF-8 at byte {exc.start}"
        _report(RecordError(source, at_line, None, message, "bad_utf8"), on_error)
        return
    if text_unit == "file":
        yield Record(source, 1, {"text": text})
        return
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the break that ends the last line opens no new one
    for number, line in enumerate(lines, start=1):
        yield Record(source, number, {"text": line.removesuffix("\r")})


def _read_json(path: InputPath, on_error: OnError) -> Iterator[Record]:
    """A .json file is one document, an object or a list of objects (line = 1-based position);
    it is read whole, as orjson has no incremental parser."""
    source = str(path)
    raw = _read_whole(path, on_error)
    if raw is None:
        return
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
                message = f"list element: expected a JSON object, got {type_name(item)}"
                _report(RecordError(source, position, None, message, "not_object"), on_error)
    else:
        message = f"expected a JSON object or a list of objects, got {type_name(data)}"
        _report(RecordError(source, 1, None, message, "not_object"), on_error)


def _read_parquet(path: InputPath, on_error: OnError) -> Iterator[Record]:
    """Rows of a Parquet file, one record batch at a time (line = 1-based row)."""
    source = str(path)
    row = 0
    try:
        with open_parquet(path) as parquet:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for data in batch.to_pylist():
                    row += 1
                    yield Record(source, row, data)
    except _STREAM_ERRORS as exc:
        _report(_stream_error(path, row, exc), on_error)


def _read_arrow(path: InputPath, on_error: OnError) -> Iterator[Record]:
    """Rows of an Arrow file (what `Dataset.save_to_disk` writes), batch by batch (line =
    1-based row); a batch `datasets` wrote may be large, so it is cut into slices."""
    source = str(path)
    row = 0
    try:
        with open_arrow(path) as batches:
            for batch in batches:
                for start in range(0, batch.num_rows, PARQUET_BATCH_ROWS):
                    for data in batch.slice(start, PARQUET_BATCH_ROWS).to_pylist():
                        row += 1
                        yield Record(source, row, data)
    except _STREAM_ERRORS as exc:
        _report(_stream_error(path, row, exc), on_error)


def _read_dataset(path: DatasetInput, on_error: OnError) -> Iterator[Record]:
    """Rows of an in-memory Hugging Face dataset, as Arrow batches (line = 1-based row)."""
    row = 0
    try:
        for table in dataset_batches(path, PARQUET_BATCH_ROWS):
            for data in table.to_pylist():
                row += 1
                yield Record(path.name, row, data)
    except _STREAM_ERRORS as exc:  # a streamed (Hub) dataset whose connection breaks
        _report(_stream_error(path, row, exc), on_error)


def _report(err: RecordError, on_error: OnError) -> None:
    if on_error is None:
        raise err
    on_error(err)


def _stream_error(path: InputPath, lines_done: int | None, exc: BaseException) -> RecordError:
    """A file that cannot be read on; `lines_done` None for a .json document (no lines yet)."""
    after = "" if lines_done is None else f", after line {lines_done}"
    line = 1 if lines_done is None else lines_done + 1
    if isinstance(exc, EOFError):
        message = f"file ends early{after} (truncated .{source_name(path).rsplit('.', 1)[-1]} stream: {exc})"
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
    if line is not None and b"\r" in raw.rstrip(b"\r\n"):  # JSON never holds a raw CR
        text = (
            "the line holds a carriage return (CR) that does not end in LF: the file uses "
            "CR-only (classic Mac) line endings, and JSONL lines end in \\n; convert it "
            f"(tr '\\r' '\\n'): {text}"
        )
    elif last_line:
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


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}
    return "object" if isinstance(value, dict) else names.get(type(value), type(value).__name__)


def show_value(value: Any, limit: int = 60) -> str:
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
