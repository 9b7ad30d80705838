"""DataflowLoader throughput next to a plain torch DataLoader, and resume time at sample 1e6.

Both read the same raw np.memmap window dataset (int32 tokens, one window per item, the
target shifted by one) with the same batch size and num_workers, in the same run; each
number is the median of several runs. Resume time is load_state_dict + the first batch.
Run: python benchmarks/bench_loader.py [--batches 400] [--repeats 3] [--workers 2]
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
from tokenmill.training.sampler import RDSampler
from tokenmill.training.state import advance_position, epoch_order

WINDOW, BATCH, WINDOWS = 512, 16, 200_000


class WindowDataset(Dataset):
    """Window i of a flat token file: input_ids and target_ids, as int64 tensors."""

    def __init__(self, path: Path, window: int) -> None:
        self.tokens = np.memmap(path, dtype=np.int32, mode="r")
        self.window = window
        self.fingerprint = f"{path.name}:{len(self.tokens)}"

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.window

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = torch.from_numpy(
            self.tokens[i * self.window : (i + 1) * self.window + 1].astype(np.int64)
        )
        return {"input_ids": chunk[:-1], "target_ids": chunk[1:]}

    def sample_length(self, i: int) -> int:
        return self.window


def write_tokens(path: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    tokens = np.memmap(path, dtype=np.int32, mode="w+", shape=(count,))
    for start in range(0, count, 1 << 22):
        stop = min(count, start + (1 << 22))
        tokens[start:stop] = rng.integers(0, 150_000, stop - start, dtype=np.int32)
    tokens.flush()


def rate(loader, batches: int) -> float:
    """Batches per second over `batches` batches, after the first (worker start-up)."""
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches / (time.perf_counter() - start)
    del it
    return rate


def loaders(ds: WindowDataset, workers: int) -> dict:
    """Name -> a function building a fresh loader."""
    return {
        "plain DataLoader": lambda: DataLoader(
            ds, batch_size=BATCH, shuffle=True, num_workers=workers
        ),
        "DataLoader + RDSampler": lambda: DataLoader(
            ds, batch_size=BATCH, sampler=RDSampler(ds), num_workers=workers
        ),
        "DataflowLoader": lambda: DataflowLoader(
            MapDistributor(ds), batch_size=BATCH, num_workers=workers
        ),
        "DataflowLoader packing": lambda: DataflowLoader(
            MapDistributor(ds),
            batcher=PoolPackingBatcher(BATCH * WINDOW, pool_size=4 * BATCH),
            collator=PackedCollator(),
            num_workers=workers,
        ),
    }


def resume_seconds(ds: WindowDataset, workers: int, at: int) -> float:
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
    expected = epoch_order(len(ds), 42, epoch)[consumed : consumed + BATCH]
    assert torch.equal(batch["input_ids"], torch.stack([ds[int(i)]["input_ids"] for i in expected]))
    return seconds


def main(batches: int = 400, repeats: int = 3, workers: int = 2) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        write_tokens(path, WINDOWS * WINDOW + 1)
        ds = WindowDataset(path, WINDOW)
        print(
            f"{len(ds)} windows of {WINDOW} tokens, batch {BATCH}, num_workers={workers}, median of {repeats}"
        )
        makers = loaders(ds, workers)
        runs: dict[str, list[float]] = {name: [] for name in makers}
        for _ in range(repeats):  # interleaved, so a busy moment hits every loader alike
            for name, make in makers.items():
                runs[name].append(rate(make(), batches))
        results = {name: statistics.median(values) for name, values in runs.items()}
        floor = results["plain DataLoader"]
        print(f"{'loader':<24} {'batches/s':>10} {'tokens/s':>12} {'vs plain':>9}")
        for name, value in results.items():
            print(
                f"{name:<24} {value:>10.1f} {value * BATCH * WINDOW:>12.0f} {value / floor:>8.2f}x"
            )
        figures = {f"{name} vs plain": value / floor for name, value in results.items()}
        for w in (0, workers):
            seconds = statistics.median(
                resume_seconds(ds, w, 10**6 + 12_345) for _ in range(repeats)
            )
            print(f"resume at sample 1,012,345 (num_workers={w}): {seconds * 1000:.1f} ms")
            figures[f"resume ms (num_workers={w})"] = seconds * 1000
        return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    main(args.batches, args.repeats, args.workers)
