"""The batch sequence itself: the four roles run in fixed order, for worker w of N.

DataDistributor -> RawItemProcessor -> SampleBatcher -> BatchCollator, as if one process ran
them; worker w yields groups w, w + N, ... (DataflowLoader, loader.py, runs the workers). With
a fixed group size a worker reads only its own groups' items, and a group of windows of one
length is read at once (`WindowBatch`). A packing group depends on the sizes of every sample
before it, so each worker plans every group: from the dataset's stored lengths where it has
them, on the global order (world size 1), dealing groups to ranks round robin and reading only
its own groups' items, so the plan and its states are the same under any world size; else by
reading the rank's whole stream and collating only its own groups, a plan (and state) of one
rank of one world size (see benchmarks/bench_loader.py).

Which of these paths a worker takes (`read_path`) follows only what the roles declare: the
hooks of their base classes (DataDistributor.windowed and .sized, RawItemProcessor.changes_items,
SampleBatcher.group_size, .consecutive_groups and .counts_tokens), never their exact type;
`check_roles` refuses by name a role in the wrong slot or a hook of the wrong kind."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

from tokenmill.dataflow.batchers import SampleBatcher
from tokenmill.dataflow.collators import BatchCollator
from tokenmill.dataflow.contracts import keeps
from tokenmill.dataflow.distributors import DataDistributor, worker_share
from tokenmill.dataflow.processors import RawItemProcessor
from tokenmill.training.windows import WindowBatch

SLOTS = {
    "distributor": DataDistributor,
    "processor": RawItemProcessor,
    "batcher": SampleBatcher,
    "collator": BatchCollator,
}
"""Each role's slot and the base class whose hooks the loader asks about."""

READ_PATHS = ("window groups", "planned windows", "planned items", "items")
"""How a worker reads, fastest first (`read_path`)."""


def check_roles(distributor: Any, processor: Any, batcher: Any, collator: Any) -> None:
    """Each role is an instance of its slot's base class and its hooks are of their kinds:
    refused by name otherwise (the role, the slot, the hook), when a DataflowLoader is made."""
    owner = "DataflowLoader"
    given = {
        "distributor": distributor,
        "processor": processor,
        "batcher": batcher,
        "collator": collator,
    }
    for slot, role in given.items():
        if isinstance(role, SLOTS[slot]):
            continue
        other = [name for name, base in SLOTS.items() if isinstance(role, base)]
        if other:
            raise TypeError(
                f"{owner}: the {slot} is a {type(role).__name__}, a {SLOTS[other[0]].__name__}: "
                f"pass it as the {other[0]}, and a {SLOTS[slot].__name__} as the {slot}"
            )
        raise TypeError(
            f"{owner}: the {slot} is a {type(role).__name__}, not a {SLOTS[slot].__name__}; "
            f"subclass {SLOTS[slot].__name__}: it declares the hooks the loader asks a {slot}"
        )
    name = type(batcher).__name__
    size = batcher.group_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise TypeError(
            f"{owner}: {name}.group_size is {size!r}; it must be None (groups of any size) "
            "or a positive int (samples per group)"
        )
    every = batcher.restart_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise TypeError(f"{owner}: {name}.restart_every is {every!r}; it must be a positive int")
    if batcher.consecutive_groups and size is None:
        raise TypeError(
            f"{owner}: {name}.consecutive_groups is True but its group_size is None; "
            "consecutive groups need a group size"
        )
    if batcher.counts_tokens and keeps(batcher, SampleBatcher, "plan"):
        raise TypeError(f"{owner}: {name}.counts_tokens is True but it defines no plan(sized)")
    offered = [
        (distributor.windowed, "windowed", "fetch_windows"),
        (distributor.sized, "sized", "sample_length"),
    ]
    for declared, hook, method in offered:
        if declared and keeps(distributor, DataDistributor, method):
            raise TypeError(
                f"{owner}: {type(distributor).__name__}.{hook} is True but it defines no {method}"
            )


def read_path(
    distributor: DataDistributor, processor: RawItemProcessor, batcher: SampleBatcher
) -> str:
    """How each worker reads its groups, by what the roles declare (READ_PATHS):

    - "window groups": fixed consecutive groups of windows, each read at once (WindowBatch);
    - "planned windows": packing planned from stored lengths, each group read at once;
    - "planned items": packing planned from stored lengths, each group's items fetched;
    - "items": every item fetched and processed, and grouped by the batcher's `batches`."""
    windows = reads_windows(distributor, processor)
    if batcher.group_size:
        return "window groups" if windows and batcher.consecutive_groups else "items"
    if plans_from_lengths(distributor, processor, batcher):
        return "planned windows" if windows else "planned items"
    return "items"


def run_roles(
    distributor: DataDistributor,
    processor: RawItemProcessor,
    batcher: SampleBatcher,
    collator: BatchCollator,
    dp_rank: int,
    dp_world_size: int,
    worker_id: int = 0,
    num_workers: int = 1,
) -> Iterator[tuple[Any, dict, dict]]:
    """Yield (batch, position, counters) for this worker's groups of the rank's sequence.

    With a fixed group size the worker reads only its own groups' indices; otherwise (packing)
    every worker plans the whole sequence (from stored lengths: the global one, group g to rank
    g % dp_world_size; else by reading the rank's) and reads and collates only its own groups.
    Groups of windows are yielded as read (WindowBatch), for the training side to collate.
    `position` is the distributor state before the batcher's pending samples plus the batcher
    state: loading both continues right after this batch (on the global plan: right after the
    round of dp_world_size groups it ends, the same on every rank)."""
    block = batcher.group_size
    distributor.share_reads(worker_id, num_workers, block or 0)  # it may read ahead just those
    path = read_path(distributor, processor, batcher)
    planned = path.startswith("planned")  # packing on stored lengths: on the global order
    indices = distributor.indices(*((0, 1) if planned else (dp_rank, dp_world_size)))
    if block:
        indices = worker_share(indices, worker_id, num_workers, block)
    if path == "window groups":  # one read per group, handed over as int32 (WindowBatch)
        while group := list(islice(indices, block)):
            position = {"distributor": distributor.state_dict(), "batcher": batcher.state_dict()}
            yield window_batch(distributor, group), position, {}
        return
    positions = {0: distributor.state_dict()}  # packing: distributor state after each sample
    pulled = 0

    def samples() -> Iterator[dict]:
        nonlocal pulled
        for index in indices:
            sample = processor.process(distributor.fetch(index))
            pulled += 1
            if not block:
                positions[pulled] = distributor.state_dict()
            yield sample

    def sized() -> Iterator[tuple[Any, int]]:
        nonlocal pulled
        every = batcher.restart_every  # states kept where a resume can restart
        for index in indices:
            size = distributor.sample_length(index)
            pulled += 1
            if pulled % every == 0:
                positions[pulled] = distributor.state_dict()
            yield index, size

    # packing on stored lengths: every worker plans every group, and reads only its own
    groups = batcher.plan(sized()) if planned else batcher.batches(samples())
    held: list[Any] | None = None  # the global plan: this worker's group of the current round
    position = {"distributor": positions[0], "batcher": batcher.state_dict()}
    for index, group in enumerate(groups):
        batcher_state = batcher.state_dict()
        restart = pulled - batcher_state.get("pending", 0)
        if restart == pulled:
            positions = {pulled: distributor.state_dict()}
        else:
            positions = {k: v for k, v in positions.items() if k >= restart}
        position = {"distributor": positions[restart], "batcher": batcher_state}
        if not planned:
            if block or index % num_workers == worker_id:
                yield collator.collate(group), position, batcher_counters(batcher)
            continue
        round_, rank = divmod(index, dp_world_size)
        if rank == dp_rank and round_ % num_workers == worker_id:
            held = group
        if rank == dp_world_size - 1 and held is not None:  # the round is planned: its state
            yield (
                planned_batch(distributor, collator, path, held),
                position,
                batcher_counters(batcher),
            )
            held = None
    if held is not None:  # the last round, short of some ranks
        yield planned_batch(distributor, collator, path, held), position, batcher_counters(batcher)


def planned_batch(
    distributor: DataDistributor, collator: BatchCollator, path: str, group: list[Any]
) -> Any:
    """A group of indices planned from stored lengths, read: at once (planned windows), or item
    by item and collated."""
    if path == "planned windows":
        return window_batch(distributor, group)
    return collator.collate([distributor.fetch(i) for i in group])


def plans_from_lengths(
    distributor: DataDistributor, processor: RawItemProcessor, batcher: SampleBatcher
) -> bool:
    """A packing batcher can plan its groups from the dataset's stored lengths: they are the
    sizes it would measure (token counts of unprocessed items)."""
    return distributor.sized and not processor.changes_items and batcher.counts_tokens


def reads_windows(distributor: DataDistributor, processor: RawItemProcessor) -> bool:
    """A group can be read at once and crosses as stored (WindowBatch), to be collated on the
    training side: the items are windows of one length and nothing processes them."""
    return distributor.windowed and not processor.changes_items


def window_batch(distributor: DataDistributor, group: list[Any]) -> WindowBatch:
    """`fetch_windows` of a group, refused by name unless a WindowBatch."""
    batch = distributor.fetch_windows(group)
    if not isinstance(batch, WindowBatch):
        raise TypeError(
            f"{type(distributor).__name__}.fetch_windows returned {type(batch).__name__}; "
            "a windowed distributor promises a WindowBatch"
        )
    return batch


def batcher_counters(batcher: SampleBatcher) -> dict[str, int]:
    """A copy of the batcher's `counters`, refused by name unless a mapping."""
    counters = batcher.counters
    if not isinstance(counters, Mapping):
        raise TypeError(
            f"{type(batcher).__name__}.counters is a {type(counters).__name__}; it must be a "
            "mapping of names to counts"
        )
    return dict(counters)


def collate_windows(batch: WindowBatch, collator: BatchCollator) -> dict:
    """The batch `collator` makes of a WindowBatch's items (its `collate_windows` hook)."""
    collated = collator.collate_windows(batch.arrays)
    if not isinstance(collated, dict):
        raise TypeError(
            f"{type(collator).__name__}.collate_windows returned {type(collated).__name__}; "
            "it must return the batch dict"
        )
    return collated
