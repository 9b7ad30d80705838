"""JsonlStore: raw or pre-tokenized JSONL served through the Store interface.

Beside store.py (the Store contract): records are transformed eagerly
(`transform=`, a `dataset_config.json`, or the built-in chat config) into in-memory
views, or lazily (`processor=`) from an index of line positions, so memory stays
flat in the number of records.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.shards.buffers import ShardBuffer
from tokenmill.shards.format import is_list_value, is_tmp
from tokenmill.shards.manifest import listed, read_manifest, refuse_split_root
from tokenmill.training.open_views import ShardView
from tokenmill.training.store import Store, Transform, as_tensors, cumulative


class JsonlStore(Store):
    """A .jsonl file or a folder's sorted top-level *.jsonl, transformed eagerly or processed lazily."""

    processor: Transform | None = None
    skipped: dict[str, int]  # records a config filtered out (too_short, too_long), by reason

    def load(
        self,
        path: str | Path,
        transform: Transform | None = None,
        processor: Transform | None = None,
        tokenizer_path: str | Path | None = None,
    ) -> JsonlStore:
        """Eager transform: `transform=`, else dataset_config.json beside the data, else the
        built-in `messages` (sft) config when `tokenizer_path` is given, else the records must
        already hold token lists (as `storage_format: jsonl` writes them). `processor=`: lazy."""
        if transform is not None and processor is not None:
            raise ValueError("give transform= (eager) or processor= (lazy), not both")
        refuse_split_root(path, read_manifest(Path(path)) if Path(path).is_dir() else None)
        self.files, stored_dtypes = jsonl_inputs(Path(path))
        self.skipped = {}
        if processor is not None:
            self.processor = processor
            self._index_lines()
            return self
        self.processor = None
        # the raw-JSONL route into preprocessing, imported only when raw records are read
        from tokenmill.preprocess.document.filters import FILTER_REASONS
        from tokenmill.preprocess.inputs.records import read_records

        apply, dtypes = _choose_transform(Path(path), transform, tokenizer_path)
        dtypes = stored_dtypes if apply is _pretokenized and stored_dtypes else dtypes
        buffer = ShardBuffer(dtypes)
        for record in chain.from_iterable(read_records(f) for f in self.files):
            try:
                out = apply(record.data, record.source, record.line)
            except Exception as err:
                if getattr(err, "reason", None) in FILTER_REASONS:
                    self.skipped[err.reason] = self.skipped.get(err.reason, 0) + 1  # type: ignore[attr-defined]
                    continue
                raise _located(err, record.source, record.line) from err
            buffer.add(out)
        if not buffer.records:
            raise ValueError(f"{path}: no records to load (skipped: {self.skipped or 'none'})")
        self.fingerprint = _files_digest(self.files)
        self._set_views([ShardView.of(str(path), buffer.build(), buffer.records)])
        return self

    # --- lazy mode: an int64 array of line positions, one record processed per fetch -----
    def _index_lines(self) -> None:
        digest, per_file = hashlib.sha256(), []
        for f in self.files:
            per_file.append(_line_starts(f, digest))
        self._file_starts = cumulative([len(p) for p in per_file])
        self._line_pos = np.concatenate(per_file) if per_file else np.empty(0, np.int64)
        self.fingerprint = digest.hexdigest()[:16]
        self._views = None
        self._lazy_keys: list[str] | None = None

    @property
    def lazy(self) -> bool:
        """True when loaded with processor=: records are processed on fetch, no stream access."""
        return self.processor is not None

    def _loaded(self) -> Sequence[ShardView]:
        if self.processor is not None:
            raise ValueError("a JsonlStore loaded with processor= reads records only (fetch_row)")
        return super()._loaded()

    @property
    def keys(self) -> list[str]:
        if self.processor is None:
            return super().keys
        if self._lazy_keys is None:
            self._lazy_keys = list(self._process(0))
        return list(self._lazy_keys)

    @property
    def num_rows(self) -> int:
        return len(self._line_pos) if self.processor is not None else super().num_rows

    def __len__(self) -> int:
        return self.num_rows if self.processor is not None else super().__len__()

    def fetch_row(self, i: int, keys: str | list[str]) -> Any:
        if self.processor is None:
            return super().fetch_row(i, keys)
        out = self._process(i)
        wanted = [keys] if isinstance(keys, str) else keys
        missing = [k for k in wanted if k not in out]
        if missing:
            raise KeyError(f"keys {missing} are not in the processed record; keys: {list(out)}")
        tensors = {
            k: as_tensors(list(out[k]) if is_list_value(out[k]) else np.asarray(out[k]))
            for k in wanted
        }
        return tensors[keys] if isinstance(keys, str) else tensors

    def _process(self, i: int) -> dict:
        f = bisect_right(self._file_starts, i) - 1
        source, pos = self.files[f], int(self._line_pos[i])
        with open(source, "rb") as fh:
            fh.seek(pos)
            text = fh.readline()
        line = _line_number(source, pos)
        from tokenmill.preprocess.inputs.records import parse_line

        try:
            return dict(self.processor(parse_line(text, str(source), line)))  # type: ignore[misc]  # set in lazy mode
        except Exception as err:
            raise _located(err, str(source), line) from err


def jsonl_inputs(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files to read and, for a dataset written with `storage_format: jsonl`, its dtypes."""
    if path.is_file():
        if path.suffix != ".jsonl":
            raise ValueError(
                f"{path}: JsonlStore reads .jsonl files, got {path.suffix or 'no suffix'}"
            )
        return [path], None
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    manifest = read_manifest(path)
    if manifest and manifest.get("storage_format") == "jsonl":
        names = [rel for rel, _ in listed(manifest)]
        return [path / n for n in names], manifest.get("keys")
    # a tokenmill output's rejects.jsonl lists bad input, never data (every record rejected)
    rejects = "rejects.jsonl" if manifest is not None else None
    files = sorted(
        p for p in path.glob("*.jsonl") if not is_tmp(Path(p.name)) and p.name != rejects
    )
    if not files:
        raise FileNotFoundError(f"{path}: no *.jsonl files at its top level")
    return files, None


def _choose_transform(
    path: Path, transform: Transform | None, tokenizer_path: str | Path | None
) -> tuple[Callable, dict | None]:
    """The first of: transform=, dataset_config.json beside the data, the built-in sft config, pre-tokenized."""
    if transform is not None:
        return (lambda record, source, line: transform(record)), None
    folder = path if path.is_dir() else path.parent
    config_file = folder / "dataset_config.json"
    if config_file.is_file():
        from tokenmill.preprocess.config import PipelineConfig

        data = json.loads(config_file.read_text())
        configured = data.pop("tokenizer_path", None)
        tokenizer = tokenizer_path or (folder / configured if configured else folder)
        return _masker(PipelineConfig.from_dict(data, origin=str(config_file)), tokenizer)
    if tokenizer_path is not None:
        from tokenmill.preprocess.presets import default_config

        return _masker(default_config("sft"), tokenizer_path)
    return _pretokenized, None


def _masker(config: Any, tokenizer_path: str | Path) -> tuple[Callable, dict]:
    from tokenmill.preprocess.chat.tokenizer import load_tokenizer
    from tokenmill.preprocess.document.masking import RecordMasker

    masker = RecordMasker(config, load_tokenizer(tokenizer_path))
    return masker.process, masker.layout.dtypes()


def _pretokenized(record: dict, source: str, line: int) -> dict:
    """Records that already hold arrays: lists of numbers, or lists of such lists (list keys)."""
    out = {}
    for key, value in record.items():
        items = value if isinstance(value, list) and value and isinstance(value[0], list) else None
        arrays = [np.asarray(v) for v in (items if items is not None else [value])]
        if any(a.dtype.kind not in "iufb" or a.ndim != 1 for a in arrays):
            raise ValueError(
                f"{source}:{line}: field {key!r} is not a list of numbers; give transform=, "
                "a dataset_config.json or tokenizer_path to tokenize raw records"
            )
        arrays = [a.astype(np.float32) if a.dtype.kind == "f" else a for a in arrays]
        out[key] = arrays if items is not None else arrays[0]
    return out


def _located(err: Exception, source: str, line: int) -> Exception:
    """The error with the record's file and line (a RecordError is rebuilt with them)."""
    if all(hasattr(err, a) for a in ("field", "message", "reason")):
        return type(err)(source, line, err.field, err.message, err.reason)  # type: ignore[attr-defined, call-arg]
    text = str(err)
    return ValueError(text if text.startswith(f"{source}:") else f"{source}:{line}: {text}")


def _files_digest(files: list[Path]) -> str:
    """What identifies the data: a hash of every byte of every file, in order."""
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _line_starts(path: Path, digest: Any) -> np.ndarray:
    """Byte positions of the non-blank lines of a file, found with numpy 4 MiB at a time."""
    found, base, rest = [], 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            buf = rest + chunk
            cut = buf.rfind(b"\n") + 1  # whole lines only; the rest waits for the next chunk
            found.append(_nonblank_starts(buf[:cut]) + base)
            base, rest = base + cut, buf[cut:]
    found.append(_nonblank_starts(rest) + base)
    return np.concatenate(found).astype(np.int64)


_SPACE = np.frombuffer(b" \t\n\r\x0b\x0c", np.uint8)


def _nonblank_starts(buf: bytes) -> np.ndarray:
    data = np.frombuffer(buf, np.uint8)
    ends = np.flatnonzero(data == 10)
    if len(data) and data[-1] != 10:
        ends = np.append(ends, len(data))
    if not len(ends):
        return np.empty(0, np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    solid = np.concatenate([[0], np.cumsum(~np.isin(data, _SPACE), dtype=np.int64)])
    return starts[solid[ends] > solid[starts]]


def _line_number(path: Path, pos: int) -> int:
    with open(path, "rb") as f:
        return f.read(pos).count(b"\n") + 1
