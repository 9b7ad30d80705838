"""Batches of windows read at once (WindowBatch): the same tensors as the items' default
collation, handed across the worker pipe as int32, for windows inside and across shards."""

from __future__ import annotations

import multiprocessing
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from helpers import write_sft_rows
from resume import same

from tokenmill.dataflow import (
    DataflowLoader,
    DefaultBatchCollator,
    MapDistributor,
    PackedCollator,
    PoolPackingBatcher,
    SimpleBatcher,
)
from tokenmill.dataflow.processors import IdentityProcessor, RawItemProcessor
from tokenmill.dataflow.roles import run_roles
from tokenmill.training import windows
from tokenmill.training.datasets import SEQDataset, SFTDataset
from tokenmill.training.mmap_store import MmapStore
from tokenmill.training.state import epoch_order
from tokenmill.training.windows import WindowBatch

SFT = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}
WINDOW, BATCH, SEED = 7, 4, 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 3 to 20 tokens in shards of about 40: many windows cross a shard boundary."""
    return write_sft_rows(tmp_path_factory.mktemp("windows"), 0, rows=40, lengths=(3, 21), shard=40)


def dataset(kind: str, root: Path):
    store = MmapStore(window_size=WINDOW).load(root)
    return SEQDataset(store) if kind == "seq" else SFTDataset(store, sample="window")


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("kind", ["seq", "sft"])
@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"num_workers": 2},
        {"num_workers": 2, "shared": True},
        {"num_threads": 1},
        {"num_threads": 3},
    ],
    ids=str,
)
def test_window_batches_equal_the_default_collation_of_the_items(shards, kind, mode, monkeypatch):
    mode = dict(mode)  # pytest hands every `kind` the same dict
    if mode.pop("shared", False):  # batches over PIPE_BYTES cross in shared memory (fork: the
        monkeypatch.setattr(windows, "PIPE_BYTES", 0)  # workers see the patched value)
        mode["multiprocessing_context"] = "fork"
    ds = dataset(kind, shards)
    assert len(ds.store._loaded()) > 3  # several shards
    batches = list(
        DataflowLoader(MapDistributor(ds, seed=SEED, num_epochs=1), batch_size=BATCH, **mode)
    )
    order = epoch_order(len(ds), SEED, 0).tolist()
    assert len(batches) == -(-len(ds) // BATCH)
    for b, batch in enumerate(batches):
        expected = DefaultBatchCollator().collate(
            [ds[i] for i in order[b * BATCH : (b + 1) * BATCH]]
        )
        assert sorted(batch) == sorted(expected)
        for key, tensor in expected.items():
            assert batch[key].dtype == tensor.dtype and torch.equal(batch[key], tensor), key
            assert batch[key].is_contiguous(), key  # `.view(-1)` works, as on stacked items


def crossed(value):
    """`value` after a trip through a multiprocessing queue, as a worker's batch takes it."""
    pipe = multiprocessing.get_context("fork").Queue()
    try:
        pipe.put(value)
        return pipe.get(timeout=60)
    finally:
        pipe.close()


@pytest.mark.parametrize("size", [windows.PIPE_BYTES, windows.PIPE_BYTES + 8])
def test_a_window_batch_crosses_a_pipe_by_value_up_to_pipe_bytes(size):
    """Up to PIPE_BYTES the pickle holds the bytes (numpy, by value); above, the tensors, which
    torch's pickler shares in memory: a handle of a few hundred bytes."""
    sequence = torch.arange(size // 4, dtype=torch.int32).reshape(2, -1)
    batch = WindowBatch({"sequence": sequence})
    payload = bytes(ForkingPickler.dumps(batch))
    back = crossed(batch)
    assert isinstance(back, WindowBatch) and torch.equal(back.arrays["sequence"], sequence)
    assert back.arrays["sequence"].dtype == torch.int32
    if size <= windows.PIPE_BYTES:
        assert len(payload) > size
    else:
        assert len(payload) < 4096
    halves = WindowBatch({"sequence": sequence[:, :8].to(torch.bfloat16)})  # no numpy dtype
    back = crossed(halves)
    assert torch.equal(back.arrays["sequence"], halves.arrays["sequence"])


def test_a_collated_batch_crosses_a_pipe_by_value_and_arrives_as_the_dict():
    """A worker's collated batch (PipedBatch): tensors by value up to PIPE_BYTES, back as a
    plain dict of the same tensors and values; bfloat16 (no numpy dtype) and a batch over
    PIPE_BYTES cross as torch shares them."""
    batch = {
        "input_ids": torch.arange(12).reshape(2, 6),
        "loss_mask": torch.tensor([[True, False, True]]),
        "cu_seqlens": torch.tensor([0, 3, 6], dtype=torch.int32),
        "max_seqlen": 3,
    }
    payload = bytes(ForkingPickler.dumps(windows.PipedBatch(batch)))
    back = crossed(windows.PipedBatch(batch))
    assert type(back) is dict and list(back) == list(batch) and back["max_seqlen"] == 3
    for key in ("input_ids", "loss_mask", "cu_seqlens"):
        assert back[key].dtype == batch[key].dtype and torch.equal(back[key], batch[key])
    assert b"numpy" in payload  # by value
    halves = {"h": torch.ones(4, dtype=torch.bfloat16)}
    assert b"numpy" not in bytes(ForkingPickler.dumps(windows.PipedBatch(halves)))
    assert torch.equal(crossed(windows.PipedBatch(halves))["h"], halves["h"])
    large = {"x": torch.zeros(windows.PIPE_BYTES // 8 + 1, dtype=torch.int64)}
    payload = bytes(ForkingPickler.dumps(windows.PipedBatch(large)))
    assert len(payload) < 4096 and torch.equal(crossed(windows.PipedBatch(large))["x"], large["x"])


@pytest.mark.parametrize("kind", ["seq", "sft"])
def test_a_worker_hands_over_one_int32_window_per_sample(shards, kind):
    ds = dataset(kind, shards)
    roles = (
        MapDistributor(ds, seed=SEED),
        IdentityProcessor(),
        SimpleBatcher(BATCH),
        DefaultBatchCollator(),
    )
    batch, position, _ = next(run_roles(*roles, 0, 1))
    assert isinstance(batch, WindowBatch)
    assert batch.arrays["sequence"].dtype == torch.int32
    assert batch.arrays["sequence"].shape == (BATCH, WINDOW + 1)
    assert position["distributor"]["consumed"] == BATCH


def test_a_processor_or_another_collator_reads_item_by_item(shards):
    """Only what gives the same batch takes the batched read: no processor, the default collator."""

    class Doubling(IdentityProcessor):
        def process(self, item: dict) -> dict:
            return {k: v * 2 for k, v in item.items()}

    ds = dataset("seq", shards)
    batch, _, _ = next(
        run_roles(
            MapDistributor(ds, seed=SEED),
            Doubling(),
            SimpleBatcher(BATCH),
            DefaultBatchCollator(),
            0,
            1,
        )
    )
    first = ds[epoch_order(len(ds), SEED, 0)[0]]
    assert isinstance(batch, dict) and torch.equal(batch["input_ids"][0], first["input_ids"] * 2)
    rows = SFTDataset(MmapStore(window_size=40).load(shards))  # rows vary in length
    assert not rows.fixed_windows and not MapDistributor(rows).windowed


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("mode", [{}, {"num_workers": 2}, {"num_threads": 2}], ids=str)
def test_packed_windows_cross_as_stored_and_collate_as_the_items_would(shards, mode):
    """Packing plans from stored lengths, the group crosses as one WindowBatch, and the training
    side's PackedCollator gives the batches that collating the read items in the worker gives."""
    ds = dataset("sft", shards)

    def make(measure: bool, **kw) -> DataflowLoader:
        batcher = PoolPackingBatcher(3 * WINDOW, pool_size=5)
        if measure:  # a size_fn of its own: items are read and collated in the worker
            batcher.size_fn = lambda item: len(item["input_ids"])
        distributor = MapDistributor(ds, seed=SEED, num_epochs=1)
        return DataflowLoader(distributor, batcher=batcher, collator=PackedCollator(), **kw)

    batch, _, _ = next(run_roles(*roles_of(make(False)), 0, 1))
    assert isinstance(batch, WindowBatch)
    reference = list(make(True))
    assert same(list(make(False, **mode)), reference)
    assert sum(b["num_tokens"] for b in reference) == len(ds) * WINDOW  # every window once


def roles_of(loader: DataflowLoader) -> tuple:
    return loader.distributor, loader.processor, loader.batcher, loader.collator


class _Doubled(RawItemProcessor):
    """A processor: items read and changed in the reading thread, so no window path."""

    def process(self, item: dict) -> dict:
        return {**item, "input_ids": item["input_ids"] * 2}


@pytest.mark.parametrize("mode", [{}, {"num_threads": 2}], ids=str)
@pytest.mark.parametrize("packed", [True, False], ids=["packed-windows", "collated-items"])
def test_pin_memory_pins_every_tensor_of_an_in_process_batch_and_keeps_its_ints(
    shards, mode, packed, monkeypatch
):
    """pin_memory=True pins each tensor of a batch made in this process (packed windows carry
    ints too: max_seqlen, num_tokens). This machine has no CUDA, so pinning is stood in for;
    workers' batches are pinned by torch's DataLoader itself."""
    pinned: list[torch.Tensor] = []

    def pin(tensor: torch.Tensor, *device) -> torch.Tensor:
        pinned.append(tensor)
        return tensor.clone()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    distributor = MapDistributor(dataset("sft", shards), seed=SEED, num_epochs=1)
    if packed:
        roles = {"batcher": PoolPackingBatcher(3 * WINDOW, pool_size=5)}
        roles["collator"] = PackedCollator()
    else:
        roles = {"batch_size": BATCH, "processor": _Doubled()}
    batches = list(DataflowLoader(distributor, pin_memory=True, **roles, **mode))
    tensors = [v for b in batches for v in b.values() if isinstance(v, torch.Tensor)]
    assert len(tensors) == len(pinned) > 0
    assert {id(t) for t in pinned}.isdisjoint(id(t) for t in tensors)  # the pinned copies
    if packed:
        assert all(type(b["max_seqlen"]) is int and type(b["num_tokens"]) is int for b in batches)
