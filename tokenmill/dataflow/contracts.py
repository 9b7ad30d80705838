"""Contracts: what the loader may ask of a dataset, and the rule that ties a role's fast path
to the methods it stands in for.

A dataset is anything with `len` and `[index]`; beyond that it may offer the hooks of the
Protocols below, and the probes here are the one place the loader asks for them. A role
declares its hooks on its base class (distributors.py, processors.py, batchers.py,
collators.py); a built-in's declaration holds only while its class keeps the built-in's own
methods (`keeps`), so a subclass that changes what a fast path skips gets the general path
unless it declares the hook again itself.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from tokenmill.shards.schema import ITEMS
from tokenmill.training.windows import WindowBatch

__all__ = [
    "WindowReads",
    "StoredLengths",
    "ItemRanges",
    "TokenizerProvenance",
    "TrainType",
    "keeps",
    "has_fixed_windows",
    "has_stored_lengths",
    "stored_length",
    "dataset_tokenizer",
    "checked_tokenizer",
    "dataset_train_type",
]


class WindowReads(Protocol):
    """Items are windows of one length, and a group of them is read at once: the loader hands
    a group over as stored (a WindowBatch, int32), to be collated on the training side
    (`MapDistributor.windowed`, `BatchCollator.collate_windows`)."""

    @property
    def fixed_windows(self) -> bool:
        """True: every item is a window of the same length."""
        ...

    def read_windows(self, indices: list[int]) -> WindowBatch:
        """Items `indices` as one WindowBatch: `tensors()` of it equals their default collation."""
        ...


class StoredLengths(Protocol):
    """An item's token count known without reading it: packing batchers plan their groups from
    it and each loader worker reads only its own groups' items (`MapDistributor.sized`)."""

    def sample_length(self, index: int) -> int:
        """Tokens of item `index`: what `tokenmill.shards.schema.token_count` counts of it."""
        ...


class ItemRanges(Protocol):
    """The stream positions items read, for a store that fetches shards ahead of the sample
    order (`tokenmill.training.order_prefetch`)."""

    def item_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Positions [first, last] items `indices` read; None: the items are records."""
        ...


class TokenizerProvenance(Protocol):
    """The tokenizer the data was made with, checked before sources mix (provenance.py)."""

    @property
    def tokenizer_provenance(self) -> tuple[str, str] | None:
        """(fingerprint, path) of the tokenizer; None where the data does not say."""
        ...


class TrainType(Protocol):
    """What a dataset's items are: their training type, a key of `tokenmill.shards.schema.ITEMS`
    (the loader picks a collator for them: fitting.py)."""

    @property
    def train_type(self) -> str:
        """ "seq", "sft", "dpo", "kto" or "grpo"; "" where the dataset does not say."""
        ...


def keeps(role: Any, owner: type, *methods: str) -> bool:
    """`role`'s class uses `owner`'s own `methods`: a fast path `owner` declares in their place
    still gives what they would."""
    return all(getattr(type(role), name) is getattr(owner, name) for name in methods)


def has_fixed_windows(dataset: Any) -> bool:
    """The dataset offers WindowReads; `fixed_windows` without `read_windows` is refused."""
    if not getattr(dataset, "fixed_windows", False):
        return False
    if not callable(getattr(dataset, "read_windows", None)):
        raise TypeError(
            f"{type(dataset).__name__}.fixed_windows is True but it has no read_windows(indices):"
            " a dataset of windows reads a group at once (WindowReads)"
        )
    return True


def has_stored_lengths(dataset: Any) -> bool:
    """The dataset offers StoredLengths."""
    return callable(getattr(dataset, "sample_length", None))


def stored_length(dataset: Any, index: int) -> int:
    """`dataset.sample_length(index)`, refused by name unless it is an integer."""
    length = dataset.sample_length(index)
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise TypeError(
            f"{type(dataset).__name__}.sample_length({index}) returned "
            f"{type(length).__name__}; StoredLengths promises an int (the item's tokens)"
        )
    return int(length)


def dataset_tokenizer(dataset: Any) -> tuple[str, str] | None:
    """The dataset's TokenizerProvenance, where it offers it."""
    return checked_tokenizer(dataset, getattr(dataset, "tokenizer_provenance", None))


def checked_tokenizer(owner: Any, found: Any) -> tuple[str, str] | None:
    """`found` as `owner`'s tokenizer_provenance, refused by name unless None or (str, str)."""
    if found is None:
        return None
    if not (
        isinstance(found, tuple) and len(found) == 2 and all(isinstance(v, str) for v in found)
    ):
        raise TypeError(
            f"{type(owner).__name__}.tokenizer_provenance is {found!r}; it must be None or "
            "(fingerprint, path), two strings"
        )
    return found


def dataset_train_type(dataset: Any) -> str | None:
    """The dataset's TrainType, where it offers it; refused by name unless a known type."""
    found = getattr(dataset, "train_type", None)
    if found is None or found == "":
        return None
    if not isinstance(found, str) or found not in ITEMS:
        raise TypeError(
            f"{type(dataset).__name__}.train_type is {found!r}; it must be one of "
            f"{sorted(ITEMS)} (or empty: the items say nothing)"
        )
    return found
