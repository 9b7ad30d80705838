"""Inputs from Hugging Face `datasets`: an in-memory `Dataset`/`IterableDataset` taken as an
input, and the folder layouts `datasets` writes (`save_to_disk`, Hub split files) read as the
files they hold, or refused where reading them all would mix splits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any


class DatasetInput:
    """A Hugging Face `datasets.Dataset` or `IterableDataset` given as input: its rows are the
    records, named `<name>:<row>` (1-based, as Parquet rows are) in errors.

    `datasets` is never imported here (it imports torch): the object is recognised by its type.
    """

    def __init__(self, dataset: Any, position: int):
        self.dataset = dataset
        info = getattr(dataset, "info", None)
        label = "/".join(
            str(part)
            for part in (getattr(info, "dataset_name", None), getattr(dataset, "split", None))
            if part
        )
        # the position keeps two unnamed datasets (or two selections of one) apart
        self.name = f"{type(dataset).__name__}#{position}" + (f"({label})" if label else "")

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DatasetInput({self.name})"


HF_KINDS = ("Dataset", "IterableDataset", "DatasetDict", "IterableDatasetDict")


def hf_dataset_kind(value: Any) -> str | None:
    """ "Dataset", "IterableDataset", "DatasetDict" or "IterableDatasetDict" for an object of
    Hugging Face `datasets`, else None."""
    for cls in type(value).__mro__:
        if cls.__module__.split(".")[0] == "datasets" and cls.__name__ in HF_KINDS:
            return cls.__name__
    return None


HF_CARD_FILES = ("README.md", "dataset_infos.json")  # a Hub dataset's card, beside its data


_SPLIT_FILE = re.compile(r"^(?P<split>[^/]+?)-\d{5}-of-\d{5}\.(?:parquet|arrow)$")


def hf_layout(
    root: str, relative: list[tuple[str, ...]], read: Callable[[tuple[str, ...]], bytes]
) -> list[tuple[str, ...]]:
    """The files of a folder to read, sorted, given every file's path parts below it.

    Folders written by `datasets` are recognised: `Dataset.save_to_disk` (`state.json`,
    `dataset_info.json`: its Arrow data files, nothing else), `DatasetDict.save_to_disk`
    (`dataset_dict.json`: refused, naming its splits) and Hub files of several splits
    (`<split>-00000-of-00003.parquet`: refused, as reading them all would mix the splits).
    """
    present = set(relative)
    for parts in sorted(present):
        if parts[-1] == "dataset_dict.json":
            where = "/".join((root, *parts[:-1]))
            names = json.loads(read(parts)).get("splits", [])
            raise ValueError(
                f"{where} holds a DatasetDict saved by datasets (splits: {', '.join(names)}); "
                f"pass one split's folder, such as {where}/{names[0] if names else 'train'}"
            )
    saved = {
        p[:-1]
        for p in present
        if p[-1] == "state.json" and (*p[:-1], "dataset_info.json") in present
    }
    keep: list[tuple[str, ...]] = []
    for folder in sorted(saved):
        state = json.loads(read((*folder, "state.json")))
        data = [(*folder, entry["filename"]) for entry in state.get("_data_files", [])]
        missing = [p for p in data if p not in present]
        if missing:
            raise FileNotFoundError(
                f"{'/'.join((root, *missing[0]))}: listed in state.json but missing"
            )
        keep += data

    def inside(parts: tuple[str, ...]) -> bool:
        return any(parts[: len(folder)] == folder for folder in saved)

    keep += [p for p in present if not inside(p) and p[-1] not in HF_CARD_FILES]
    splits: dict[str, tuple[str, ...]] = {}  # split -> one of its files
    for parts in sorted(keep):
        match = _SPLIT_FILE.match(parts[-1])
        if match is not None and not inside(parts):
            splits.setdefault(match["split"], parts)
    if len(splits) > 1:
        pick = "train" if "train" in splits else sorted(splits)[0]
        example = "/".join((root, *splits[pick][:-1], f"{pick}-*"))
        raise ValueError(
            f"folder {root} holds the splits {', '.join(sorted(splits))} (Hugging Face file "
            f"names <split>-NNNNN-of-NNNNN); reading them all would mix them: pass one "
            f"split's files, such as {example}"
        )
    return sorted(keep)
