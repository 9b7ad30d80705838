"""Contracts of the loader's roles: a fast path follows only what a role declares on its base
class. A trivial subclass of each built-in takes the built-in's path and gives its batches,
positions and states; a subclass that overrides what a fast path skips gets the general path
and its override; a custom role that declares a hook gets the fast path; misuse is named.

Which path ran is read twice: `read_path` (what run_roles chooses by) and the calls of the
slow path's methods, counted on the built-in classes (a counting wrapper of the real method)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import write_sft_rows
from resume import ToyDataset, same

import tokenmill.dataflow as dataflow
from tokenmill.dataflow import (
    BatchCollator,
    ContextParallelCollator,
    DataDistributor,
    DataflowLoader,
    DefaultBatchCollator,
    DPOPaddingCollator,
    GRPOPaddingCollator,
    IdentityProcessor,
    IterableDistributor,
    KTOPaddingCollator,
    LoaderOptions,
    MapDistributor,
    MixtureDistributor,
    PackedCollator,
    PackedDPOCollator,
    PackedGRPOCollator,
    PackedKTOCollator,
    PoolPackingBatcher,
    RankPartitionedDistributor,
    RawItemProcessor,
    SampleBatcher,
    SequentialPackingBatcher,
    SFTPaddingCollator,
    SimpleBatcher,
    TruncateProcessor,
)
from tokenmill.dataflow.batchers import token_count
from tokenmill.dataflow.distributors import trained_tokens, worker_share
from tokenmill.dataflow.roles import READ_PATHS, read_path, run_roles
from tokenmill.shards import schema
from tokenmill.training.datasets import SEQDataset, SFTDataset
from tokenmill.training.mmap_store import MmapStore
from tokenmill.training.windows import WindowBatch

WINDOW, SEED = 7, 3
Roles = tuple[Any, Any, Any, Any]
Pick = Callable[[type], type]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sft_rows(
        tmp_path_factory.mktemp("contracts"), 0, rows=24, lengths=(3, 21), shard=60
    )


def windows(kind: str, root: Path) -> Any:
    store = MmapStore(window_size=WINDOW).load(root)
    return SEQDataset(store) if kind == "seq" else SFTDataset(store, sample="window")


def toy_items(kind: str, size: int) -> list[dict]:
    return [ToyDataset(kind, size)[i] for i in range(size)]


# Each scenario builds the four roles; `c(cls)` is the class to use in place of built-in `cls`
# (its trivial subclass, for the one under test).
SCENARIOS: dict[str, tuple[str, Callable[[Path, Pick], Roles]]] = {
    "seq windows": (
        "window groups",
        lambda root, c: (
            c(MapDistributor)(windows("seq", root), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(SimpleBatcher)(4),
            c(DefaultBatchCollator)(),
        ),
    ),
    "sft windows padded": (
        "window groups",
        lambda root, c: (
            c(MapDistributor)(windows("sft", root), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(SimpleBatcher)(4),
            c(SFTPaddingCollator)(),
        ),
    ),
    "packed windows": (
        "planned windows",
        lambda root, c: (
            c(MapDistributor)(windows("sft", root), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(PoolPackingBatcher)(3 * WINDOW, pool_size=5),
            c(PackedCollator)(),
        ),
    ),
    "context parallel windows": (
        "planned windows",
        lambda root, c: (
            c(MapDistributor)(windows("sft", root), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(PoolPackingBatcher)(3 * WINDOW, pool_size=5),
            c(ContextParallelCollator)(2, 1),
        ),
    ),
    "dpo planned": (
        "planned items",
        lambda root, c: (
            c(MapDistributor)(ToyDataset("dpo", 20), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(SequentialPackingBatcher)(24),
            c(DPOPaddingCollator)(),
        ),
    ),
    "grpo planned": (
        "planned items",
        lambda root, c: (
            c(MapDistributor)(ToyDataset("grpo", 20), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(PoolPackingBatcher)(24, pool_size=5),
            c(GRPOPaddingCollator)(),
        ),
    ),
    "kto padded": (
        "items",
        lambda root, c: (
            c(MapDistributor)(KTOItems(20), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(SimpleBatcher)(4),
            c(KTOPaddingCollator)(),
        ),
    ),
    "dpo packed": (
        "planned items",
        lambda root, c: (
            c(MapDistributor)(ToyDataset("dpo", 20), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(SequentialPackingBatcher)(24),
            c(PackedDPOCollator)(),
        ),
    ),
    "kto packed": (
        "planned items",
        lambda root, c: (
            c(MapDistributor)(KTOItems(20), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(PoolPackingBatcher)(12, pool_size=4),
            c(PackedKTOCollator)(),
        ),
    ),
    "grpo packed": (
        "planned items",
        lambda root, c: (
            c(MapDistributor)(ToyDataset("grpo", 20), seed=SEED, num_epochs=1),
            c(IdentityProcessor)(),
            c(PoolPackingBatcher)(24, pool_size=5),
            c(PackedGRPOCollator)(),
        ),
    ),
    "truncated": (
        "items",
        lambda root, c: (
            c(IterableDistributor)(toy_items("sft", 20)),
            c(TruncateProcessor)(6),
            c(SequentialPackingBatcher)(16),
            c(PackedCollator)(),
        ),
    ),
    "mixture": (
        "items",
        lambda root, c: (
            c(MixtureDistributor)(
                [
                    c(MapDistributor)(ToyDataset("seq", 12), seed=1, num_epochs=1),
                    c(MapDistributor)(ToyDataset("seq", 6), seed=2, num_epochs=1),
                ],
                [2, 1],
            ),
            c(IdentityProcessor)(),
            c(SimpleBatcher)(3),
            c(DefaultBatchCollator)(),
        ),
    ),
    "partitioned": (
        "items",
        lambda root, c: (
            c(RankPartitionedDistributor)(
                [
                    c(MapDistributor)(ToyDataset("sft", 12), seed=1, num_epochs=1),
                    c(MapDistributor)(ToyDataset("sft", 10), seed=2, num_epochs=1),
                ],
                [1, 1],
            ),
            c(IdentityProcessor)(),
            c(SimpleBatcher)(3),
            c(SFTPaddingCollator)(),
        ),
    ),
}
COORDINATES = {"partitioned": {"dp_rank": 1, "dp_world_size": 2}}

# every built-in role, in the scenarios it takes part in
TRIVIAL = [
    (MapDistributor, "seq windows"),
    (MapDistributor, "packed windows"),
    (MapDistributor, "dpo planned"),
    (IterableDistributor, "truncated"),
    (MixtureDistributor, "mixture"),
    (RankPartitionedDistributor, "partitioned"),
    (IdentityProcessor, "seq windows"),
    (IdentityProcessor, "packed windows"),
    (IdentityProcessor, "grpo planned"),
    (TruncateProcessor, "truncated"),
    (SimpleBatcher, "seq windows"),
    (SimpleBatcher, "sft windows padded"),
    (PoolPackingBatcher, "packed windows"),
    (PoolPackingBatcher, "grpo planned"),
    (SequentialPackingBatcher, "dpo planned"),
    (SequentialPackingBatcher, "truncated"),
    (DefaultBatchCollator, "seq windows"),
    (DefaultBatchCollator, "mixture"),
    (SFTPaddingCollator, "sft windows padded"),
    (SFTPaddingCollator, "partitioned"),
    (DPOPaddingCollator, "dpo planned"),
    (GRPOPaddingCollator, "grpo planned"),
    (KTOPaddingCollator, "kto padded"),
    (PackedDPOCollator, "dpo packed"),
    (PackedKTOCollator, "kto packed"),
    (PackedGRPOCollator, "grpo packed"),
    (PackedCollator, "packed windows"),
    (PackedCollator, "truncated"),
    (ContextParallelCollator, "context parallel windows"),
]

# the slow path's methods, counted where they are defined (so a trivial subclass, which
# inherits them, still takes the built-in's declarations)
WATCHED = [
    (ToyDataset, "__getitem__"),
    (SEQDataset, "__getitem__"),
    (SFTDataset, "__getitem__"),
    (SEQDataset, "read_windows"),
    (IdentityProcessor, "process"),
    (TruncateProcessor, "process"),
    (SimpleBatcher, "batches"),
    (PoolPackingBatcher, "batches"),
    (PoolPackingBatcher, "plan"),
    (SequentialPackingBatcher, "plan"),
    (WindowBatch, "items"),
    *[
        (c, "collate")
        for c in (
            DefaultBatchCollator,
            SFTPaddingCollator,
            DPOPaddingCollator,
            GRPOPaddingCollator,
            KTOPaddingCollator,
            PackedCollator,
            PackedDPOCollator,
            PackedKTOCollator,
            PackedGRPOCollator,
            ContextParallelCollator,
        )
    ],
]


class Calls:
    """Counts calls of real methods: each wrapped where its class hierarchy defines it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, watched: list[tuple[type, str]]) -> None:
        self.counts: Counter[str] = Counter()
        owners = {(next(k for k in cls.__mro__ if name in vars(k)), name) for cls, name in watched}
        for owner, name in owners:
            monkeypatch.setattr(owner, name, self._counted(f"{owner.__name__}.{name}", owner, name))

    def _counted(self, key: str, owner: type, name: str) -> Callable:
        original = vars(owner)[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[key] += 1
            return original(*args, **kwargs)

        return counted

    def taken(self) -> dict[str, int]:
        """The counts since the last call."""
        counts = dict(self.counts)
        self.counts.clear()
        return counts


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return Calls(monkeypatch, WATCHED)


def observe(roles: Roles, calls: Calls, **settings: Any) -> tuple[str, list, dict[str, int]]:
    """The path the roles declare, then (batch, state, counters) after each batch of a loader
    run to the end, and the slow path's calls it made."""
    calls.taken()
    path = read_path(roles[0], roles[1], roles[2])
    loader = DataflowLoader(*roles, **settings)
    seen = [(batch, loader.state_dict(), dict(loader.counters)) for batch in loader]
    return path, seen, calls.taken()


def subclass(cls: type) -> type:
    """`class Sub<cls>(cls): pass`."""
    return type(f"Sub{cls.__name__}", (cls,), {})


def test_every_built_in_role_is_checked_as_a_trivial_subclass():
    bases = (DataDistributor, RawItemProcessor, SampleBatcher, BatchCollator)
    exported = [getattr(dataflow, name) for name in dataflow.__all__]
    built_ins = {c for c in exported if isinstance(c, type) and issubclass(c, bases)} - set(bases)
    assert built_ins == {cls for cls, _ in TRIVIAL}
    assert {SCENARIOS[s][0] for _, s in TRIVIAL} == set(READ_PATHS)  # every path is exercised


@pytest.mark.parametrize("cls, scenario", TRIVIAL, ids=lambda v: getattr(v, "__name__", v))
def test_a_trivial_subclass_takes_the_built_ins_path_and_gives_its_batches(
    shards, calls, cls, scenario
):
    path, build = SCENARIOS[scenario]
    settings = COORDINATES.get(scenario, {})
    built_in = observe(build(shards, lambda c: c), calls, **settings)
    sub = subclass(cls)
    roles = build(shards, lambda c: sub if c is cls else c)
    assert any(type(role) is sub for role in roles) or any(
        type(s) is sub for s in getattr(roles[0], "sources", ())
    )
    got = observe(roles, calls, **settings)
    assert built_in[0] == got[0] == path
    assert built_in[2] == got[2]  # the same methods, as often
    assert same(got[1], built_in[1])  # batches, positions (in the states), counters
    assert len(got[1]) > 1


def test_each_path_calls_only_what_it_needs(shards, calls):
    """What the paths skip: a group of windows is read at once and collated without items;
    a packing plan from stored lengths neither processes nor measures an item read."""
    _, _, seq = observe(SCENARIOS["seq windows"][1](shards, lambda c: c), calls)
    assert seq["_StreamDataset.read_windows"] > 0
    assert not {"SEQDataset.__getitem__", "SimpleBatcher.batches", "WindowBatch.items"} & set(seq)
    assert "DefaultBatchCollator.collate" not in seq and "IdentityProcessor.process" not in seq
    _, _, padded = observe(SCENARIOS["sft windows padded"][1](shards, lambda c: c), calls)
    assert padded["WindowBatch.items"] == padded["SFTPaddingCollator.collate"] > 0  # no fast one
    _, _, packed = observe(SCENARIOS["packed windows"][1](shards, lambda c: c), calls)
    assert "PackedCollator.collate" not in packed and "_PackingBatcher.batches" not in packed
    assert "SFTDataset.__getitem__" not in packed and "WindowBatch.items" not in packed
    assert packed["PoolPackingBatcher.plan"] == 1
    _, _, dpo = observe(SCENARIOS["dpo planned"][1](shards, lambda c: c), calls)
    assert "IdentityProcessor.process" not in dpo and "_PackingBatcher.batches" not in dpo
    _, _, truncated = observe(SCENARIOS["truncated"][1](shards, lambda c: c), calls)
    assert truncated["TruncateProcessor.process"] == 20 and truncated["_PackingBatcher.batches"]


# --- a subclass that overrides what a fast path skips -------------------------------------


def test_an_overridden_process_is_called_and_takes_the_general_path(shards, calls):
    class Doubling(IdentityProcessor):
        def process(self, item: dict) -> dict:
            return {k: v * 2 for k, v in item.items()}

    def roles(processor: RawItemProcessor) -> Roles:
        distributor = MapDistributor(windows("seq", shards), seed=SEED, num_epochs=1)
        return distributor, processor, SimpleBatcher(4), DefaultBatchCollator()

    _, reference, _ = observe(roles(IdentityProcessor()), calls)
    path, doubled, taken = observe(roles(Doubling()), calls)
    assert path == "items" and taken["SimpleBatcher.batches"] == 1
    assert taken["DefaultBatchCollator.collate"] == len(doubled) == len(reference)
    for (got, _, _), (want, _, _) in zip(doubled, reference, strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"] * 2)

    class Logged(IdentityProcessor):
        """Re-declares the hook: its `process` only counts, so it may be skipped."""

        changes_items = False
        seen = 0

        def process(self, item: dict) -> dict:
            Logged.seen += 1
            return item

    path, logged, _ = observe(roles(Logged()), calls)
    assert path == "window groups" and Logged.seen == 0 and same(logged, reference)


def test_an_overridden_fetch_is_called_and_takes_the_general_path(shards, calls):
    class Shifted(MapDistributor):
        def fetch(self, index: int) -> Any:
            item = super().fetch(index)
            return {**item, "input_ids": item["input_ids"] + 1}

    plain = MapDistributor(windows("seq", shards), seed=SEED, num_epochs=1)
    shifted = Shifted(windows("seq", shards), seed=SEED, num_epochs=1)
    assert plain.windowed and plain.sized and not shifted.windowed and not shifted.sized
    _, reference, _ = observe(
        (plain, IdentityProcessor(), SimpleBatcher(4), DefaultBatchCollator()), calls
    )
    path, got, _ = observe(
        (shifted, IdentityProcessor(), SimpleBatcher(4), DefaultBatchCollator()), calls
    )
    assert path == "items"
    for (batch, _, _), (want, _, _) in zip(got, reference, strict=True):
        assert torch.equal(batch["input_ids"], want["input_ids"] + 1)
    packing = (
        Shifted(ToyDataset("sft", 20), seed=SEED, num_epochs=1),
        IdentityProcessor(),
        SequentialPackingBatcher(24),
        PackedCollator(),
    )
    assert read_path(*packing[:3]) == "items"  # its items may differ from the stored lengths


def test_overridden_batches_or_sizes_are_called_and_take_the_general_path(shards, calls):
    class Reversed(SimpleBatcher):
        def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
            for group in super().batches(samples):
                yield group[::-1]

    def roles(batcher: SampleBatcher) -> Roles:
        distributor = MapDistributor(windows("seq", shards), seed=SEED, num_epochs=1)
        return distributor, IdentityProcessor(), batcher, DefaultBatchCollator()

    _, reference, _ = observe(roles(SimpleBatcher(4)), calls)
    path, got, _ = observe(roles(Reversed(4)), calls)
    assert path == "items"
    for (batch, _, _), (want, _, _) in zip(got, reference, strict=True):
        assert torch.equal(batch["input_ids"], want["input_ids"].flip(0))

    class Doubled(SequentialPackingBatcher):
        def sample_size(self, sample: dict) -> int:
            return 2 * token_count(sample)

    class Own(SequentialPackingBatcher):
        def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
            return super().batches(samples)

    for batcher in (Doubled(24), Own(24)):
        assert not batcher.counts_tokens
        distributor = MapDistributor(ToyDataset("sft", 20), seed=SEED, num_epochs=1)
        assert read_path(distributor, IdentityProcessor(), batcher) == "items"
    doubled = DataflowLoader(
        MapDistributor(ToyDataset("sft", 20), seed=SEED, num_epochs=1),
        batcher=Doubled(24),
        collator=PackedCollator(),
    )
    assert all(2 * b["num_tokens"] <= 24 for b in doubled)  # its sizes decided the groups


@pytest.mark.parametrize(
    "built_in, scenario",
    [(PackedCollator, "packed windows"), (DefaultBatchCollator, "seq windows")],
)
def test_an_overridden_collate_is_called_on_windows(shards, calls, built_in, scenario):
    class Tagged(built_in):  # type: ignore[valid-type,misc]
        def collate(self, samples: list[dict]) -> dict:
            return {**super().collate(samples), "samples": len(samples)}

    path, build = SCENARIOS[scenario]
    _, reference, _ = observe(build(shards, lambda c: c), calls)
    got_path, got, taken = observe(build(shards, lambda c: Tagged if c is built_in else c), calls)
    assert got_path == path  # the reading side is the same: windows cross as stored
    assert taken["WindowBatch.items"] == taken[f"{built_in.__name__}.collate"] == len(got)
    for (batch, _, _), (want, _, _) in zip(got, reference, strict=True):
        assert batch["samples"] > 0
        assert same({k: v for k, v in batch.items() if k != "samples"}, want)


def test_a_packed_collator_whose_helpers_are_overridden_collates_the_items(shards, calls):
    """The fast windows collation skips `_packed` (one document per window): a subclass that
    overrides it gets `collate` of the items, which calls it."""

    class Marked(PackedCollator):
        def _packed(self, starts: Any, num_tokens: int, flat: dict[str, torch.Tensor]) -> dict:
            return {**super()._packed(starts, num_tokens, flat), "marked": True}

    path, build = SCENARIOS["packed windows"]
    got_path, got, taken = observe(
        build(shards, lambda c: Marked if c is PackedCollator else c), calls
    )
    assert got_path == path and taken["PackedCollator.collate"] == len(got) > 0
    assert all(batch["marked"] for batch, _, _ in got)


# --- custom roles that declare hooks --------------------------------------------------------


class Windows(DataDistributor):
    """Windows of W + 1 stored tokens, in order, one rank: declares windowed and sized."""

    windowed = True
    sized = True

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.consumed = rows, 0
        self.fetched = 0

    def stream(
        self, dp_rank: int, dp_world_size: int, worker_id: int, num_workers: int
    ) -> Iterator[Any]:
        for index in worker_share(self.indices(dp_rank, dp_world_size), worker_id, num_workers):
            yield self.fetch(index)

    def indices(self, dp_rank: int, dp_world_size: int) -> Iterator[int]:
        for index in range(self.consumed, len(self.rows)):
            self.consumed = index + 1
            yield index

    def fetch(self, index: int) -> dict:
        self.fetched += 1
        return self.fetch_windows([index]).items()[0]

    def fetch_windows(self, indices: list[int]) -> WindowBatch:
        return WindowBatch({"sequence": torch.from_numpy(self.rows[indices])})

    def sample_length(self, index: int) -> int:
        return self.rows.shape[1] - 1

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state.get("consumed", 0))


class Undeclared(Windows):
    windowed = False
    sized = False


class Quiet(RawItemProcessor):
    changes_items = False

    def process(self, item: dict) -> dict:
        return item


class Pairs(SampleBatcher):
    group_size = 2
    consecutive_groups = True

    def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
        samples = iter(samples)
        while group := [s for _, s in zip(range(2), samples)]:
            yield group


class Greedy(SampleBatcher):
    """Packs in order up to a budget; declares that its sizes are token counts."""

    counts_tokens = True

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
        return self.plan((sample, token_count(sample)) for sample in samples)

    def plan(self, sized: Iterator[tuple[Any, int]]) -> Iterator[list[Any]]:
        group: list[Any] = []
        used = 0
        for thing, size in sized:
            if group and used + size > self.budget:
                yield group
                group, used = [], 0
            group.append(thing)
            used += size
        if group:
            yield group


class Sums(BatchCollator):
    """Sums each sample's input ids; declares the same from stored windows."""

    def collate(self, samples: list[dict]) -> dict:
        return {"sums": torch.stack([s["input_ids"].sum() for s in samples])}

    def collate_windows(self, arrays: dict[str, torch.Tensor]) -> dict:
        return {"sums": arrays["sequence"][:, :-1].long().sum(1)}


def rows(count: int = 10) -> np.ndarray:
    return np.arange(count * (WINDOW + 1), dtype=np.int32).reshape(count, WINDOW + 1)


@pytest.mark.parametrize(
    "processor, batcher, collator",
    [
        (Quiet(), Pairs(), Sums()),
        (IdentityProcessor(), SimpleBatcher(2), DefaultBatchCollator()),
        (Quiet(), Pairs(), PackedCollator()),
    ],
    ids=["custom", "built-in", "custom-packed"],
)
def test_custom_roles_that_declare_hooks_get_the_window_path(calls, processor, batcher, collator):
    declared, undeclared = Windows(rows()), Undeclared(rows())
    path, got, _ = observe((declared, processor, batcher, collator), calls)
    assert path == "window groups" and declared.fetched == 0
    general, reference, _ = observe((undeclared, processor, batcher, collator), calls)
    assert general == "items" and undeclared.fetched == 10
    assert same(got, reference)


def test_a_custom_packing_batcher_that_declares_counts_tokens_plans_from_lengths(calls):
    declared, undeclared = Windows(rows(9)), Undeclared(rows(9))
    path, got, _ = observe((declared, Quiet(), Greedy(3 * WINDOW), PackedCollator()), calls)
    assert path == "planned windows" and declared.fetched == 0
    general, reference, _ = observe(
        (undeclared, Quiet(), Greedy(3 * WINDOW), PackedCollator()), calls
    )
    assert general == "items" and undeclared.fetched == 9
    assert same(got, reference) and [b["num_tokens"] for b, _, _ in got] == [21, 21, 21]
    items = MapDistributor(ToyDataset("sft", 20), seed=SEED, num_epochs=1)
    assert read_path(items, Quiet(), Greedy(24)) == "planned items"


# --- share_reads ----------------------------------------------------------------------------


def test_share_reads_tells_each_worker_what_it_reads():
    class Recording(IterableDistributor):
        def share_reads(self, worker_id: int, num_workers: int, block: int) -> None:
            self.shared = (worker_id, num_workers, block)

    items = toy_items("seq", 12)
    for batcher, block in ((SimpleBatcher(3), 3), (SequentialPackingBatcher(30), 0)):
        distributor = Recording(items)
        list(
            run_roles(distributor, IdentityProcessor(), batcher, DefaultBatchCollator(), 0, 1, 1, 2)
        )
        assert distributor.shared == (1, 2, block)
    mapped = MapDistributor(ToyDataset("seq", 12))
    assert mapped.reads is None
    mapped.share_reads(1, 2, 3)
    assert mapped.reads == (1, 2, 3)  # handed to order_prefetch with the order


# --- misuse, named --------------------------------------------------------------------------


def test_a_role_in_the_wrong_slot_or_no_role_is_refused_by_name():
    distributor = MapDistributor(ToyDataset("seq", 8))
    with pytest.raises(
        TypeError, match="the processor is a SimpleBatcher, a SampleBatcher: pass it as the batcher"
    ):
        DataflowLoader(distributor, processor=SimpleBatcher(2), batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the batcher is a PackedCollator, a BatchCollator"):
        DataflowLoader(distributor, batcher=PackedCollator(), collator=PackedCollator())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the distributor is a list, not a DataDistributor"):
        DataflowLoader([1, 2], batch_size=2)  # type: ignore[arg-type]

    class Duck:
        def process(self, item: dict) -> dict:
            return item

    with pytest.raises(
        TypeError, match="the processor is a Duck, not a RawItemProcessor; subclass"
    ):
        DataflowLoader(distributor, processor=Duck(), batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="MixtureDistributor: source 1 is a list, not a DataDistributor"
    ):
        MixtureDistributor([distributor, [1]], [1, 1])  # type: ignore[list-item]


def test_a_hook_of_the_wrong_kind_is_refused_by_name():
    distributor = MapDistributor(ToyDataset("seq", 8), num_epochs=1)

    def refused(batcher: SampleBatcher, match: str, **roles: Any) -> None:
        with pytest.raises(TypeError, match=match):
            DataflowLoader(roles.pop("distributor", distributor), batcher=batcher, **roles)

    class Text(SampleBatcher):
        group_size = "4"  # type: ignore[assignment]

        def batches(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
            yield list(samples)

    class Zero(Text):
        group_size = 0

    class Loose(Text):
        group_size = None
        consecutive_groups = True

    class NoPlan(Text):
        group_size = None
        counts_tokens = True

    class Restarts(Text):
        group_size = None
        restart_every = 0

    refused(Zero(), r"Zero.group_size is 0; it must be None .* or a positive int")
    refused(Text(), r"Text.group_size is '4'")
    refused(Loose(), "Loose.consecutive_groups is True but its group_size is None")
    refused(NoPlan(), r"NoPlan.counts_tokens is True but it defines no plan\(sized\)")
    refused(Restarts(), "Restarts.restart_every is 0")

    class Claims(Windows):
        sized = True

        sample_length = DataDistributor.sample_length  # type: ignore[assignment]

    refused(
        SimpleBatcher(2),
        "Claims.sized is True but it defines no sample_length",
        distributor=Claims(rows()),
    )

    class Counting(Text):
        group_size = None
        counters = [1]  # type: ignore[assignment]

    with pytest.raises(TypeError, match="Counting.counters is a list; it must be a mapping"):
        list(DataflowLoader(distributor, batcher=Counting()))

    class DictWindows(Windows):
        def fetch_windows(self, indices: list[int]) -> WindowBatch:
            return {"sequence": torch.from_numpy(self.rows[indices])}  # type: ignore[return-value]

    with pytest.raises(
        TypeError,
        match="DictWindows.fetch_windows returned dict; a windowed distributor promises a WindowBatch",
    ):
        list(DataflowLoader(DictWindows(rows()), batch_size=2))

    class Listing(Sums):
        def collate_windows(self, arrays: dict[str, torch.Tensor]) -> dict:
            return [arrays]  # type: ignore[return-value]

    with pytest.raises(
        TypeError, match="Listing.collate_windows returned list; it must return the batch dict"
    ):
        list(DataflowLoader(Windows(rows()), batcher=SimpleBatcher(2), collator=Listing()))


def test_a_dataset_hook_of_the_wrong_kind_is_refused_by_name():
    class FloatLengths(ToyDataset):
        def sample_length(self, index: int) -> int:
            return 2.5  # type: ignore[return-value]

    loader = DataflowLoader(
        MapDistributor(FloatLengths("sft", 8), num_epochs=1),
        batcher=SequentialPackingBatcher(24),
        collator=PackedCollator(),
    )
    with pytest.raises(
        TypeError,
        match=r"FloatLengths.sample_length\(\d+\) returned float; StoredLengths promises an int",
    ):
        list(loader)

    class HalfWindows(ToyDataset):
        fixed_windows = True

    with pytest.raises(
        TypeError, match="HalfWindows.fixed_windows is True but it has no read_windows"
    ):
        assert MapDistributor(HalfWindows("seq", 8)).windowed

    class Stamped(ToyDataset):
        tokenizer_provenance = "qwen"

    with pytest.raises(
        TypeError, match="Stamped.tokenizer_provenance is 'qwen'; it must be None or"
    ):
        MixtureDistributor(
            [MapDistributor(Stamped("seq", 4)), MapDistributor(ToyDataset("seq", 4))], [1, 1]
        )


def test_provenance_is_each_distributors_declared_hook():
    class Stamped(ToyDataset):
        def __init__(self, kind: str, size: int, fingerprint: str) -> None:
            super().__init__(kind, size)
            self.tokenizer_provenance = (fingerprint, f"tokenizers/{fingerprint}")

    a, b = MapDistributor(Stamped("seq", 4, "aaaa")), IterableDistributor(toy_items("seq", 4))
    assert a.tokenizer_provenance == ("aaaa", "tokenizers/aaaa") and b.tokenizer_provenance is None
    nested = MixtureDistributor([b, a], [1, 1])
    assert nested.tokenizer_provenance == a.tokenizer_provenance
    other = IterableDistributor([Stamped("seq", 2, "bbbb")[0], Stamped("seq", 2, "bbbb")[1]])
    assert other.tokenizer_provenance is None  # a list says nothing
    with pytest.raises(
        ValueError,
        match="source 0 was tokenized with tokenizers/aaaa .* source 1 with tokenizers/bbbb",
    ):
        RankPartitionedDistributor([nested, MapDistributor(Stamped("seq", 4, "bbbb"))], [1, 1])


# --- LoaderOptions --------------------------------------------------------------------------


def test_loader_options_are_the_keywords_as_one_value():
    def make(**kw: Any) -> DataflowLoader:
        return DataflowLoader(MapDistributor(ToyDataset("seq", 20), seed=9, num_epochs=1), **kw)

    by_keywords = make(batch_size=3, num_threads=2, lookahead=1, dp_rank=0, dp_world_size=2)
    options = LoaderOptions(batch_size=3, num_threads=2, lookahead=1, dp_rank=0, dp_world_size=2)
    by_options = make(options=options)
    assert by_options.options is options and by_keywords.options == options
    assert (by_options.num_threads, by_options.lookahead, by_options.dp_world_size) == (2, 1, 2)
    first = [(b, by_keywords.state_dict()) for b in by_keywords]
    assert same([(b, by_options.state_dict()) for b in by_options], first)
    packed = LoaderOptions(num_workers=0, rank_keyed=True)
    loader = make(
        batcher=PoolPackingBatcher(24, pool_size=5), collator=PackedCollator(), options=packed
    )
    assert "dp_rank_0" in loader.state_dict()
    with pytest.raises(
        ValueError, match="num_workers, timeout given both as a keyword and in options"
    ):
        make(num_workers=2, timeout=5, options=LoaderOptions(batch_size=2))
    with pytest.raises(ValueError, match="not both"):
        make(batcher=SimpleBatcher(2), options=LoaderOptions(batch_size=2))
    with pytest.raises(TypeError, match="options is a dict, not LoaderOptions"):
        make(batch_size=2, options={"num_workers": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_workers and num_threads must be >= 0"):
        LoaderOptions(num_workers=-1)
    with pytest.raises(ValueError, match="not both"):
        LoaderOptions(num_workers=1, num_threads=1)
    with pytest.raises(ValueError, match="lookahead must be >= 0"):
        LoaderOptions(lookahead=-1)
    with pytest.raises(FrozenInstanceError):
        options.num_workers = 2  # type: ignore[misc]


# --- one token count: KTO items pack and mix by tokens --------------------------------------


def kto(index: int, length: int, trained: int) -> dict:
    return {
        "completion": torch.arange(length) + 100 * index,
        "completion_mask": torch.arange(length) >= length - trained,
        "label": torch.tensor(float(index % 2)),
    }


class KTOItems:
    """A map-style dataset of KTO items that knows their lengths without reading them."""

    def __init__(self, size: int) -> None:
        self.items = [kto(i, 2 + (7 * i) % 9, 1 + i % 2) for i in range(size)]
        self.fingerprint = f"kto-{size}"
        self.reads = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        self.reads += 1
        return self.items[index]

    def sample_length(self, index: int) -> int:
        return len(self.items[index]["completion"])


class Lengths(BatchCollator):
    def collate(self, samples: list[dict]) -> dict:
        return {
            "first": torch.stack([s["completion"][0] for s in samples]),
            "lengths": torch.tensor([len(s["completion"]) for s in samples]),
        }


def test_kto_items_count_their_tokens_and_trained_tokens():
    item = kto(0, 5, 2)
    assert token_count(item) == schema.token_count(item) == 5
    assert trained_tokens(item) == schema.trained_tokens(item) == 2
    assert token_count is schema.token_count and trained_tokens is schema.trained_tokens


@pytest.mark.parametrize(
    "batcher", [lambda: SequentialPackingBatcher(12), lambda: PoolPackingBatcher(12, pool_size=4)]
)
def test_kto_items_pack_by_tokens_measured_or_planned(batcher):
    class Unmeasured(KTOItems):
        sample_length = None  # type: ignore[assignment]

    measured_data, planned_data = Unmeasured(20), KTOItems(20)

    def make(data: Any) -> DataflowLoader:
        distributor = MapDistributor(data, seed=SEED, num_epochs=1)
        return DataflowLoader(distributor, batcher=batcher(), collator=Lengths())

    planned = make(planned_data)
    assert read_path(planned.distributor, planned.processor, planned.batcher) == "planned items"
    measured_loader = make(measured_data)  # no stored lengths: each item read and counted
    measured = [(b, measured_loader.state_dict()) for b in measured_loader]
    assert same([(b, planned.state_dict()) for b in planned], measured)
    assert planned_data.reads == 20
    assert all(int(b["lengths"].sum()) <= 12 for b, _ in measured)
    firsts = sorted(int(f) for b, _ in measured for f in b["first"])
    assert firsts == [100 * i for i in range(20)]  # every item once


def test_kto_sources_mix_by_trained_tokens():
    def make() -> MixtureDistributor:
        a = MapDistributor([kto(i, 6, 4) for i in range(40)], shuffle=False, num_epochs=1)
        b = MapDistributor([kto(1000 + i, 6, 1) for i in range(40)], shuffle=False, num_epochs=1)
        return MixtureDistributor([a, b], [1, 1], by="tokens")

    picks = [int(x["completion"][0] >= 100_000) for x in make().stream(0, 1, 0, 1)]
    assert picks[:10] == [0, 1, 1, 1, 1, 0, 1, 1, 1, 1]  # 4 trained tokens vs 1: four b per a


class _KTOItems(torch.utils.data.Dataset):
    """Three KTO items of different lengths; says its items' type."""

    train_type = "kto"

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> dict:
        n = 3 + index
        return {
            "completion": torch.arange(n),
            "completion_mask": torch.arange(n) > 0,
            "label": torch.tensor(1.0),
        }


def test_a_distributor_that_declares_its_item_datasets_gets_their_collator():
    from tokenmill.dataflow import KTOPaddingCollator

    class Logged(MapDistributor):  # fetch of its own: the built-in no longer tells
        def fetch(self, index):
            return super().fetch(index)

    plain = DataflowLoader(Logged(_KTOItems(), shuffle=False), batch_size=2)
    assert type(plain.collator) is DefaultBatchCollator

    class Declared(Logged):
        def item_datasets(self):
            return [self.dataset]

    loader = DataflowLoader(Declared(_KTOItems(), shuffle=False), batch_size=2)
    assert type(loader.collator) is KTOPaddingCollator
    batch = next(iter(loader))
    assert batch["completion"].shape == (2, 4)
