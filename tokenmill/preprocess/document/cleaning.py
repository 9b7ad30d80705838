"""Cleaning in the pipeline: the config's map and filter hooks, and the validation split.

Both run in the workers, on each record, before it is tokenized (engines/chunks.py):
`map` first (what it returns is the record from then on), then the split, then `filter`.
A hook is `module:function`, imported once per process; it is imported on the driver
before any work too (`check_hooks`), so a typo is a config error, not a failed worker.
A hook that raises, or returns the wrong type, makes the record a bad record naming the
record's file:line, the hook and where in the hook's code it raised.

The split is a fixed rule of the record, never of its place in the run: a record is held
out iff blake2b(key + seed as 8 little-endian bytes, 8-byte digest, person
b"tokenmill-split"), read big-endian, / 2**64 < fraction, the key being its normalized text
(by document) or its input file's name relative to the input root and its line (by record).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from tokenmill.preprocess.config import ConfigError, PipelineConfig
from tokenmill.preprocess.inputs.fields import SHAREGPT_ROLES
from tokenmill.preprocess.inputs.records import Record, RecordError

SPLITS = ("train", "validation")
_SPACE = re.compile(r"\s+")
_SHAREGPT = {k: v for k, v in SHAREGPT_ROLES.items() if k != "function_call"}  # from -> role


def load_hook(spec: str) -> Callable[[dict], Any]:
    """The function `module:function` (or `file.py:function`) names, imported once per
    process (a file: once per version of it, so that what runs is what `hooks_identity`
    hashed)."""
    where = spec.rpartition(":")[0]
    if where.endswith(".py"):
        try:
            version = os.stat(where).st_mtime_ns
        except OSError as err:
            raise ImportError(f"cannot load {where}: {err.strerror}") from None
        return _load_hook(spec, version)
    return _load_hook(spec, 0)


@functools.cache
def _load_hook(spec: str, version: int) -> Callable[[dict], Any]:
    module_name, _, name = spec.rpartition(":")
    if module_name.endswith(".py"):
        key = hashlib.sha256(f"{spec}:{version}".encode()).hexdigest()[:16]
        found = importlib.util.spec_from_file_location(f"tokenmill_hook_{key}", module_name)
        if found is None or found.loader is None:
            raise ImportError(f"cannot load {module_name}")
        module = importlib.util.module_from_spec(found)
        sys.modules[found.name] = module  # as an import would: dataclasses look it up there
        found.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"module {module_name} has no function {name!r}")
    return function  # type: ignore[no-any-return]


def check_hooks(config: PipelineConfig) -> None:
    """Each hook of the config imported here, on the driver: a ConfigError naming the field
    before any work, where one cannot be."""
    pre = config.preprocessing
    for field, spec in (("map", pre.map), ("filter", pre.filter)):
        if spec is None:
            continue
        try:
            load_hook(spec)
        except Exception as err:  # noqa: BLE001 - any import failure is the config's
            raise ConfigError(
                f"preprocessing.{field}: cannot import {spec}: {type(err).__name__}: {err}"
            ) from None


def hooks_identity(config: PipelineConfig) -> dict[str, str]:
    """Each hook's spec with the sha256 of the file that defines it: an edited hook is
    another job (its run id) and other data (the dataset's fingerprint), as an edited
    chat template is. {} without hooks."""
    pre, out = config.preprocessing, {}
    for field, spec in (("map", pre.map), ("filter", pre.filter)):
        if spec is not None:
            source = inspect.getsourcefile(load_hook(spec))
            text = Path(source).read_bytes() if source else spec.encode()
            out[field] = f"{spec} sha256:{hashlib.sha256(text).hexdigest()}"
    return out


def _hook_error(record: Record, field: str, spec: str, what: str) -> RecordError:
    return RecordError(record.source, record.line, None, f"{field} hook {spec} {what}", "bad_value")


def _call(record: Record, field: str, spec: str) -> Any:
    try:
        return load_hook(spec)(record.data)
    except Exception as err:  # noqa: BLE001 - the user's code: any error is the record's
        frames = traceback.extract_tb(err.__traceback__)[1:]  # the hook's, and what it called
        source = inspect.getsourcefile(load_hook(spec))
        own = [f for f in frames if f.filename == source] or frames  # the hook's own line first
        where = f" at {own[-1].filename}:{own[-1].lineno}" if own else ""
        raise _hook_error(
            record, field, spec, f"raised {type(err).__name__}: {err}{where}"
        ) from None


def mapped(record: Record, config: PipelineConfig) -> Record:
    """The record as the map hook makes it (itself without one)."""
    spec = config.preprocessing.map
    if spec is None:
        return record
    data = _call(record, "map", spec)
    if not isinstance(data, dict):
        raise _hook_error(record, "map", spec, f"returned {type(data).__name__}, expected a dict")
    return Record(record.source, record.line, data)


def kept(record: Record, config: PipelineConfig) -> bool:
    """The filter hook's verdict (True without one)."""
    spec = config.preprocessing.filter
    if spec is None:
        return True
    verdict = _call(record, "filter", spec)
    if isinstance(verdict, np.bool_):  # a numpy comparison's verdict
        verdict = bool(verdict)
    if not isinstance(verdict, bool):
        what = f"returned {type(verdict).__name__}, expected True or False"
        raise _hook_error(record, "filter", spec, what)
    return verdict


# --- the validation split --------------------------------------------------------------------


def split_of(record: Record, config: PipelineConfig) -> str | None:
    """ "train" or "validation" (None: the config holds nothing out)."""
    rule = config.preprocessing.validation
    if rule is None:
        return None
    if rule.by == "document":
        key = document_text(record, config).encode()
    else:
        key = orjson.dumps([relative_name(record.source, rule.root), record.line])
    digest = hashlib.blake2b(key, digest_size=8, person=b"tokenmill-split")
    digest.update(rule.seed.to_bytes(8, "little"))
    held = int.from_bytes(digest.digest(), "big") / 2**64 < rule.fraction
    return "validation" if held else "train"


def document_text(record: Record, config: PipelineConfig) -> str:
    """The record's content as the split compares it: the values of the fields its sections
    read (the first of a field's `columns` a record has), as canonical JSON, every string in
    Unicode NFC with runs of white space made one space and its ends stripped; a ShareGPT
    message (`from`/`value`) as the OpenAI one it stands for (`role`/`content`). Other fields
    (ids, sources, dates) do not count: the same text under another id is the same document."""
    values = []
    for field in dict.fromkeys(s.field for s in config.all_sections()):
        names = config.input.columns.get(field, [field])
        values.append(next((v for n in names if (v := _at(record.data, n)) is not None), None))
    return orjson.dumps(_normalized(values), option=orjson.OPT_SORT_KEYS).decode()


def _at(data: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _normalized(value: Any) -> Any:
    if isinstance(value, str):
        return _SPACE.sub(" ", unicodedata.normalize("NFC", value)).strip()
    if isinstance(value, dict):
        if "role" not in value and value.get("from") in _SHAREGPT:  # the same chat, either shape
            rest = {k: v for k, v in value.items() if k not in ("from", "value")}
            value = {"role": _SHAREGPT[value["from"]], "content": value.get("value"), **rest}
        return {str(k): _normalized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalized(v) for v in value]
    return value


def relative_name(source: str, root: str | None) -> str:
    """An input file's name below `root` (the name as given where it is not below it)."""
    if root and source.startswith(root.rstrip("/") + "/"):
        return source[len(root.rstrip("/")) + 1 :]
    return source


def input_root(sources: Sequence[str]) -> str:
    """The folder holding every input file (as their names give them): names below it are
    the same wherever the inputs are moved or mounted."""
    parts = [s.split("/")[:-1] for s in sources]
    common: list[str] = []
    for names in zip(*parts, strict=False) if parts else []:
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return "/".join(common)


def split_domain(split: str | None, domain: str) -> str:
    """The folder a record's rows go to: its domain's, under its split's."""
    if split is None:
        return domain
    return f"{split}/{domain}" if domain else split


def in_split(by_domain: dict[str, Any], split: str) -> dict[str, Any]:
    """The entries of a split's domains, named as in the split's own folder."""
    return {
        d[len(split) + 1 :]: v
        for d, v in by_domain.items()
        if d == split or d.startswith(f"{split}/")
    }
