"""What a trainer gets from DataflowLoader next to a plain torch DataLoader, in the same run.

Data: 2,048-token windows (int32 tokens, the target shifted by one) in batches of 8. The floors
read the same windows of the same file (the shard's own sequence.bin) with np.memmap, as int64
input_ids and target_ids per item, batched by torch's default collate: a plain DataLoader with
the same num_workers, and a plain in-process loop (num_workers=0). tokenmill: DataflowLoader
over MapDistributor(SEQDataset(MmapStore)); the packing loader packs the same windows to the
same tokens per batch (PoolPackingBatcher, PackedCollator). Rates are medians of `repeats`
interleaved rounds; a ratio is the median of its in-round ratios (a busy moment hits a loader
and its floor alike). Resume time is load_state_dict plus the first batch.
Run: python benchmarks/bench_loader.py [--batches 1500] [--repeats 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from tokenmill.dataflow import DataflowLoader, MapDistributor, PackedCollator, PoolPackingBatcher
from tokenmill.shards.writer import ShardWriter
from tokenmill.training.datasets import SEQDataset
from tokenmill.training.mmap_store import MmapStore
from tokenmill.training.state import advance_position, order_at

WINDOW, BATCH, WINDOWS = 2048, 8, 40_000


class WindowDataset(Dataset):
    """The floor: window i of a flat int32 file, as int64 input_ids and target_ids."""

    def __init__(self, path: Path, window: int) -> None:
        self.tokens = np.memmap(path, dtype=np.int32, mode="r")
        self.window = window

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.window

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = torch.from_numpy(
            self.tokens[i * self.window : (i + 1) * self.window + 1].astype(np.int64)
        )
        return {"input_ids": chunk[:-1], "target_ids": chunk[1:]}


def write_tokens(root: Path, count: int) -> Path:
    """One shard of `count` random tokens through the real ShardWriter; returns its folder."""
    rng = np.random.default_rng(0)
    with ShardWriter(root, {"sequence": "int32"}, "sequence", max_tokens_per_shard=count) as w:
        for start in range(0, count, 1 << 20):
            w.add({"sequence": rng.integers(0, 150_000, min(1 << 20, count - start))})
    return root


def rate(loader, batches: int) -> float:
    """Batches per second over `batches` batches, after the first (worker start-up)."""
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - start
    close = getattr(it, "close", None)
    if close is not None:
        close()
    del it
    return batches / seconds


def loaders(floor: WindowDataset, ds: SEQDataset, workers: int) -> dict:
    """Name -> (a function building a fresh loader, the floor it is measured against)."""
    flow = MapDistributor
    return {
        "floor: DataLoader": (
            lambda: DataLoader(floor, batch_size=BATCH, shuffle=True, num_workers=workers),
            "floor: DataLoader",
        ),
        "DataflowLoader": (
            lambda: DataflowLoader(flow(ds), batch_size=BATCH, num_workers=workers),
            "floor: DataLoader",
        ),
        "DataflowLoader packing": (
            lambda: DataflowLoader(
                flow(ds),
                batcher=PoolPackingBatcher(BATCH * WINDOW, pool_size=4 * BATCH),
                collator=PackedCollator(),
                num_workers=workers,
            ),
            "DataflowLoader",
        ),
        "floor: in-process loop": (
            lambda: DataLoader(floor, batch_size=BATCH, shuffle=True, num_workers=0),
            "floor: in-process loop",
        ),
        "DataflowLoader num_threads=1": (
            lambda: DataflowLoader(flow(ds), batch_size=BATCH, num_threads=1),
            "floor: in-process loop",
        ),
        "DataflowLoader in process": (
            lambda: DataflowLoader(flow(ds), batch_size=BATCH),
            "floor: in-process loop",
        ),
    }


def resume_seconds(ds: SEQDataset, workers: int, at: int) -> float:
    """load_state_dict at sample `at` plus the first batch; checks that batch's samples."""
    state = DataflowLoader(MapDistributor(ds), batch_size=BATCH).state_dict()
    epoch, consumed = advance_position(0, 0, at, len(ds), 1, False)
    state["position"]["distributor"].update(epoch=epoch, consumed=consumed)
    state["consumed_batches"] = at // BATCH
    loader = DataflowLoader(MapDistributor(ds), batch_size=BATCH, num_workers=workers)
    start = time.perf_counter()
    loader.load_state_dict(state)
    batch = next(iter(loader))
    seconds = time.perf_counter() - start
    expected = order_at(np.arange(consumed, consumed + BATCH), len(ds), 42, epoch)
    assert torch.equal(batch["input_ids"], torch.stack([ds[int(i)]["input_ids"] for i in expected]))
    return seconds


def main(batches: int = 1500, repeats: int = 5, workers: int = 2) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        shard = write_tokens(Path(tmp) / "seq", WINDOWS * WINDOW + 1)
        floor = WindowDataset(shard / "shard_00000" / "sequence.bin", WINDOW)
        ds = SEQDataset(MmapStore(window_size=WINDOW).load(shard), max_len=WINDOW)
        assert len(ds) == len(floor) and torch.equal(ds[5]["target_ids"], floor[5]["target_ids"])
        print(
            f"{len(ds):,} windows of {WINDOW} tokens, batch {BATCH}, num_workers={workers}, "
            f"median of {repeats}"
        )
        makers = loaders(floor, ds, workers)
        runs: dict[str, list[float]] = {name: [] for name in makers}
        for _ in range(repeats):  # interleaved, so a busy moment hits every loader alike
            for name, (make, _) in makers.items():
                runs[name].append(rate(make(), batches))
        results = {name: statistics.median(values) for name, values in runs.items()}
        print(f"{'loader':<30} {'batches/s':>10} {'tokens/s':>13} {'ratio':>7}  against")
        figures = {}
        for name, value in results.items():
            base = makers[name][1]
            ratio = statistics.median(a / b for a, b in zip(runs[name], runs[base], strict=True))
            print(
                f"{name:<30} {value:>10.1f} {value * BATCH * WINDOW:>13,.0f} {ratio:>6.2f}x  {base}"
            )
            if base != name:
                figures[f"{name} ratio"] = ratio
        for w in (0, workers):
            seconds = statistics.median(
                resume_seconds(ds, w, 10**6 + 12_345) for _ in range(repeats)
            )
            print(f"resume at sample 1,012,345 (num_workers={w}): {seconds * 1000:.1f} ms")
            figures[f"resume ms (num_workers={w})"] = seconds * 1000
        return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    main(args.batches, args.repeats, args.workers)
