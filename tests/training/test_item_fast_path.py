"""The item fast path (the view read last, sliced straight to what an item keeps) gives the
same items as the token stream itself and as the batched read, in any order, across shards,
under any open-shard limit; it keeps the open-shard limit and never travels in a pickle."""

from __future__ import annotations

import json
import pickle  # dumps only: the size of what a worker is sent
from copy import deepcopy
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import write_sft_rows

from tokenmill.training.datasets import SEQDataset, SFTDataset
from tokenmill.training.jsonl_store import JsonlStore
from tokenmill.training.mmap_store import MmapStore

SFT = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}
WINDOW, STRIDE = 6, 4


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 2 to 14 tokens in shards of about 25: many windows cross a shard boundary."""
    return write_sft_rows(tmp_path_factory.mktemp("items"), 1, rows=30, lengths=(2, 15), shard=25)


def stream(store) -> dict[str, np.ndarray]:
    """Every key's whole token stream, read in one general fetch."""
    return {k: v.numpy() for k, v in store.fetch(0, store.token_count, list(SFT)).items()}


def expected_item(tokens: dict[str, np.ndarray], index: int, n: int, kind: str) -> dict:
    begin = (index % n) * STRIDE
    ids = tokens["sequence"][begin : begin + WINDOW + 1].astype(np.int64)
    item = {"input_ids": ids[:-1], "target_ids": ids[1:]}
    if kind == "sft":
        item["loss_mask"] = tokens["loss_mask"][begin + 1 : begin + WINDOW + 1]
        item["position_ids"] = tokens["position_ids"][begin : begin + WINDOW].astype(np.int64)
    return item


def assert_item(got: dict[str, torch.Tensor], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        want = torch.from_numpy(np.array(value))
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
        assert got[key].numpy().flags.writeable  # the item's own copy, never the map


@pytest.mark.slow  # every window in 4 orders, 8 cases
@pytest.mark.parametrize("kind", ["seq", "sft"])
@pytest.mark.parametrize("limit", [0, 1, 2, 32])
def test_items_in_any_order_equal_the_stream_and_the_batched_read(root, kind, limit):
    store = MmapStore(window_size=WINDOW, stride=STRIDE).load(root)
    store.max_open_shards = limit
    ds = SEQDataset(store) if kind == "seq" else SFTDataset(store, sample="window")
    n = len(ds)
    assert len(store._loaded()) > 4 and n > 20
    tokens = stream(MmapStore().load(root))
    rng = np.random.default_rng(0)
    order = [*range(n), *range(-n, 0), *rng.integers(-n, n, 200).tolist(), 0, 0, n - 1, n - 1]
    for index in order:
        assert_item(ds[index], expected_item(tokens, index, n, kind))
        assert len(store._opened) <= limit
    batched = ds.read_windows(order).items()
    for index, item in zip(order, batched, strict=True):
        assert_item(ds[index], {k: v.numpy() for k, v in item.items()})
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match="out of range"):
            ds[bad]


def test_jsonl_store_items_take_the_same_path(tmp_path):
    lines = [{"sequence": list(range(i, i + 9)), "loss_mask": [1, 0] * 4 + [1]} for i in range(5)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(f"{json.dumps(line)}\n" for line in lines))
    store = JsonlStore(window_size=WINDOW, stride=STRIDE).load(path)
    ds = SEQDataset(store)
    tokens = store.fetch(0, store.token_count, "sequence").numpy()
    for index in [*range(len(ds)), 2, 0, -1]:
        assert_item(ds[index], expected_item({"sequence": tokens}, index, len(ds), "seq"))
    before = len(pickle.dumps(store))
    ds[1]
    assert len(pickle.dumps(store)) == before  # the view read last is not pickled again


def test_locate_finds_the_one_view_holding_a_range(root):
    store = MmapStore().load(root)
    starts = store._shared_starts
    tokens = stream(store)
    for begin, end in [(0, 3), (starts[1], starts[2]), (starts[2] - 2, starts[2]), (5, 5)]:
        values, lo = store.locate(begin, end)
        assert sorted(values) == sorted(SFT)
        for key, array in values.items():
            assert np.array_equal(array[lo : lo + end - begin], tokens[key][begin:end])
    assert store.locate(starts[1] - 1, starts[1] + 1) is None  # across views
    assert store.locate(starts[-1] - 1, starts[-1] + 1) is None  # past the end
    assert store.locate(-1, 2) is None
    with pytest.raises(RuntimeError, match="not loaded"):
        MmapStore().locate(0, 1)


def test_the_open_shard_limit_keeps_the_most_recently_read(root):
    """Reads inside the view read last skip the LRU's bookkeeping; its order stays exact."""
    store = MmapStore().load(root)
    store.max_open_shards = 2
    starts = store._shared_starts
    for view in (0, 1, 0, 0, 2):
        store.read("sequence", starts[view], starts[view] + 1)
    assert list(store._opened) == [0, 2]  # 1 was the least recently read
    store.max_open_shards = 0
    store.read("sequence", starts[3], starts[3] + 1)
    assert store.read("sequence", starts[3], starts[3] + 2).tolist() == (
        stream(MmapStore().load(root))["sequence"][starts[3] : starts[3] + 2].tolist()
    )
    assert not store._opened and store._hot[0] == -1  # no view held past the limit


def test_a_copied_store_carries_no_map_and_reads_the_same(root):
    """copy.deepcopy takes the state pickling sends a worker (`__getstate__`), with no bytes
    to unpickle."""
    store = MmapStore(window_size=WINDOW, stride=STRIDE).load(root)
    ds = SFTDataset(store, sample="window")
    first = ds[3]
    assert store._hot[0] >= 0  # a view is held for the next read
    copy = deepcopy(ds)
    assert copy.store._hot[0] == -1 and not copy.store._opened  # paths travel, maps do not
    for key, value in copy[3].items():
        assert torch.equal(value, first[key])
