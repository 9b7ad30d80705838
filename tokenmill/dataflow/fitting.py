"""Fitting collator: the collator a dataset's items take, for a loader given none.

A dataset says what its items are by `train_type` (contracts.TrainType; the training
datasets do: a key of `tokenmill.shards.schema.ITEMS`) and whether they are windows of one length (`fixed_windows`,
contracts.WindowReads). Windows stack (DefaultBatchCollator, whose fast path reads a group
at once); other items take their type's padding collator (`PADDING_COLLATORS`), as their
lengths vary. The loader reaches the datasets behind a distributor by its declared `item_datasets()`
(the built-ins offer them while their `fetch` is their own: one that changes what it
fetches says nothing of its items); where no dataset says, it stacks, and a group that does not stack is refused naming the collator
argument its items need (`fitting_argument`).
"""

from __future__ import annotations

from typing import Any

from tokenmill.dataflow.collators import PADDING_COLLATORS, BatchCollator, DefaultBatchCollator
from tokenmill.dataflow.contracts import (
    dataset_train_type,
    has_fixed_windows,
    has_stored_lengths,
    stored_length,
)
from tokenmill.dataflow.distributors import DataDistributor

__all__ = ["fitting_collator"]


def fitting_collator(distributor: DataDistributor) -> BatchCollator:
    """The collator for the items of `distributor`'s datasets: stacked where they are windows of
    one length (or nothing says), else their type's padding collator. Sources of different
    types are refused: no one collator takes them all."""
    if not isinstance(distributor, DataDistributor):
        return DefaultBatchCollator()  # the loader's role check names the misuse
    datasets = distributor.item_datasets()
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
