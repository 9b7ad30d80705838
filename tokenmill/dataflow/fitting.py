"""Fitting collator: the collator a dataset's items take, for a loader given none.

A dataset says what its items are by `train_type` (the training datasets do: a key of
`tokenmill.shards.schema.ITEMS`) and whether they are windows of one length (`fixed_windows`,
contracts.WindowReads). Windows stack (DefaultBatchCollator, whose fast path reads a group
at once); other items take their type's padding collator (`PADDING_COLLATORS`), as their
lengths vary. The loader reaches the datasets behind the built-in distributors while their
`fetch` is their own (one that changes what it fetches says nothing of its items); where no
dataset says, it stacks, and a group that does not stack is refused naming the collator
argument its items need (`fitting_argument`).
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenmill.dataflow.collators import PADDING_COLLATORS, BatchCollator, DefaultBatchCollator
from tokenmill.dataflow.contracts import (
    has_fixed_windows,
    has_stored_lengths,
    keeps,
    stored_length,
)
from tokenmill.dataflow.distributors import (
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
    RankPartitionedDistributor,
)

__all__ = ["TrainType", "dataset_train_type", "item_datasets", "fitting_collator"]


class TrainType(Protocol):
    """What a dataset's items are: their training type, a key of `ITEMS`."""

    @property
    def train_type(self) -> str:
        """ "seq", "sft", "dpo", "kto" or "grpo"; "" where the dataset does not say."""
        ...


def dataset_train_type(dataset: Any) -> str | None:
    """The dataset's TrainType, where it offers it; refused by name unless a known type."""
    found = getattr(dataset, "train_type", None)
    if found is None or found == "":
        return None
    if not isinstance(found, str) or found not in PADDING_COLLATORS:
        raise TypeError(
            f"{type(dataset).__name__}.train_type is {found!r}; it must be one of "
            f"{sorted(PADDING_COLLATORS)} (or empty: the items say nothing)"
        )
    return found


def item_datasets(distributor: Any) -> list[Any] | None:
    """The datasets whose items `distributor` hands on as they are; None where it cannot tell
    (a distributor of its own, or a built-in whose `fetch` or `indices` is overridden)."""
    if isinstance(distributor, MapDistributor):
        return [distributor.dataset] if keeps(distributor, MapDistributor, "fetch") else None
    if isinstance(distributor, IterableDistributor):
        own = keeps(distributor, IterableDistributor, "fetch", "indices")
        return [distributor.iterable] if own else None
    for mixing in (MixtureDistributor, RankPartitionedDistributor):
        if isinstance(distributor, mixing):
            if not keeps(distributor, mixing, "fetch", "indices"):
                return None
            found = [item_datasets(source) for source in distributor.sources]
            if any(datasets is None for datasets in found):
                return None
            return [dataset for datasets in found if datasets for dataset in datasets]
    return None


def fitting_collator(distributor: Any) -> BatchCollator:
    """The collator for the items of `distributor`'s datasets: stacked where they are windows of
    one length (or nothing says), else their type's padding collator. Sources of different
    types are refused: no one collator takes them all."""
    datasets = item_datasets(distributor)
    if not datasets:
        return DefaultBatchCollator()
    found = [dataset_train_type(dataset) for dataset in datasets]
    types = {train_type for train_type in found if train_type is not None}
    if None in found:  # a source that says nothing: stacked, refused by name if it cannot
        return DefaultBatchCollator()
    if len(types) > 1:
        raise ValueError(
            f"DataflowLoader: the sources hold items of types {sorted(types)} (train_type): "
            "no one collator takes them all; give collator= a collator that does"
        )
    (train_type,) = types
    if train_type in ("seq", "sft") and one_window_length(datasets):
        return DefaultBatchCollator()
    return PADDING_COLLATORS[train_type]()


def one_window_length(datasets: list[Any]) -> bool:
    """Every item of every dataset is a window of one length: they stack."""
    if not all(has_fixed_windows(dataset) for dataset in datasets):
        return False
    if len(datasets) == 1:
        return True
    if not all(has_stored_lengths(dataset) and len(dataset) for dataset in datasets):
        return False
    return len({stored_length(dataset, 0) for dataset in datasets}) == 1
