"""Store read speed next to a raw np.memmap floor, and store open time from 1e4 to 1e7 records.

Fetch: random windows of SFT shards written by the real ShardWriter, read by MmapStore.fetch,
by SFTDataset and SEQDataset items, and by the floor (the same windows of the same files sliced
from np.memmap and copied into tensors; an item floor shifts and widens in numpy), in one
process and through a DataLoader with 2 workers; random records (4,096-token rows) by
fetch_row next to their offsets and values read from np.memmap. Open:
MmapStore.load + one fetch_row on record-oriented shards of 1e4, 1e6 and 1e7 records.
Run: python benchmarks/bench_store.py [--quick] [--window 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from tokenmill.shards.format import Column
from tokenmill.shards.writer import ShardWriter, write_shard
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.factory import StoreFactory

KEYS = ["sequence", "loss_mask", "position_ids"]
SFT_DTYPES = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}
ROW = 4096  # tokens per written record (one packed row)
RECORD_TOKENS = 3  # tokens per record of the open-time shards: 1e7 records stay ~200 MB


# --- data ---------------------------------------------------------------------------------------
def write_sft(out: Path, tokens: int, shards: int, seed: int = 0) -> None:
    """SFT-shaped packed rows through the real ShardWriter, rolled into `shards` shards."""
    rng = np.random.default_rng(seed)
    with ShardWriter(out, SFT_DTYPES, "sequence", max_tokens_per_shard=tokens // shards) as writer:
        for _ in range(tokens // ROW):
            writer.add(
                {
                    "sequence": rng.integers(0, 150_000, ROW, dtype=np.int32),
                    "loss_mask": rng.random(ROW) < 0.7,
                    "position_ids": np.arange(ROW, dtype=np.int32) % 1024,
                }
            )


def write_records(out: Path, records: int, shards: int = 2) -> None:
    """Record-oriented shards of RECORD_TOKENS tokens per record, via the real write_shard."""
    per_shard = records // shards
    for s in range(shards):
        values = (np.arange(per_shard * RECORD_TOKENS, dtype=np.int64) % 50_000).astype(np.int32)
        offsets = np.arange(per_shard + 1, dtype=np.int64) * RECORD_TOKENS
        write_shard(
            out / f"shard_{s:05d}", {"sequence": Column(values, offsets)}, {"sequence": "int32"}
        )


class FloorDataset(Dataset):
    """The floor: window i of one shard's files sliced from np.memmap and copied into tensors.

    Slices a plain ndarray view of each map, the fastest raw read (np.memmap's own slicing runs
    Python hooks per slice; NaiveFloor keeps them). `extra` tokens past the window are read
    too: an SFT item reads one more, for the shifted target.
    """

    def __init__(self, shard: Path, window: int, extra: int = 0):
        self.window, self.extra = window, extra
        meta = json.loads((shard / "meta.json").read_text())
        maps = {k: np.memmap(shard / f"{k}.bin", dtype=meta[k]["dtype"], mode="r") for k in KEYS}
        self.arrays = {k: self.raw(m) for k, m in maps.items()}
        self.count = (len(maps["sequence"]) - 1 - window) // window + 1

    @staticmethod
    def raw(mapped: np.memmap) -> np.ndarray:
        return mapped.view(np.ndarray)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        begin = i * self.window
        end = begin + self.window + self.extra
        return {k: torch.from_numpy(np.array(a[begin:end])) for k, a in self.arrays.items()}


class NaiveFloor(FloorDataset):
    """The loop most people write first: slices of the np.memmap objects themselves."""

    @staticmethod
    def raw(mapped: np.memmap) -> np.ndarray:
        return mapped


class SFTItemFloor(FloorDataset):
    """The least an SFT item costs: window + 1 token, shifted and widened to int64 in numpy."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        begin = i * self.window
        end = begin + self.window + 1
        tokens = self.arrays["sequence"][begin:end].astype(np.int64)
        return {
            "input_ids": torch.from_numpy(tokens[:-1]),
            "target_ids": torch.from_numpy(tokens[1:]),
            "loss_mask": torch.from_numpy(np.array(self.arrays["loss_mask"][begin + 1 : end])),
            "position_ids": torch.from_numpy(
                self.arrays["position_ids"][begin : end - 1].astype(np.int64)
            ),
        }


class SEQItemFloor(FloorDataset):
    """The least a SEQ item costs: window + 1 token, widened to int64, shifted by one."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        begin = i * self.window
        tokens = self.arrays["sequence"][begin : begin + self.window + 1].astype(np.int64)
        return {
            "input_ids": torch.from_numpy(tokens[:-1]),
            "target_ids": torch.from_numpy(tokens[1:]),
        }


class RecordFloor:
    """The least a record costs: its offsets read from the map, its values copied to a tensor."""

    def __init__(self, shard: Path) -> None:
        meta = json.loads((shard / "meta.json").read_text())
        entry = meta["sequence"]
        self.values = np.memmap(shard / "sequence.bin", dtype=entry["dtype"], mode="r").view(
            np.ndarray
        )
        self.offsets = np.memmap(shard / entry["offsets"]["file"], dtype=np.int64, mode="r").view(
            np.ndarray
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.values[self.offsets[i] : self.offsets[i + 1]]))


# --- measuring ----------------------------------------------------------------------------------
def rate(read: Callable[[int], object], indices: list[int]) -> float:
    """Windows per CPU second of `read` over `indices` in this process, garbage collector off
    as timeit does: a busy neighbour taking the core, or a full collection over torch's
    objects falling into one run and not another, would count otherwise."""
    gc.disable()
    try:
        start = time.process_time()
        for i in indices:
            read(i)
        return len(indices) / (time.process_time() - start)
    finally:
        gc.enable()


def loader(dataset: Dataset, indices: list[int], batch_size: int, workers: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=indices,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def loader_rate(batches: DataLoader, windows: int) -> float:
    """Windows per second of one pass (workers already started by a warm-up pass)."""
    start = time.perf_counter()
    for _ in batches:
        pass
    return windows / (time.perf_counter() - start)


def rounds(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each run's figure in each of `repeats` rounds; a round runs them all back to back,
    starting one later each time, so drift on a shared machine hits every run alike."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            figures[name].append(runs[name]())
    return figures


def paired_ratio(figures: dict[str, list[float]], name: str, base: str) -> float:
    """Median over rounds of name / base within the round: steadier than a ratio of medians."""
    return statistics.median(a / b for a, b in zip(figures[name], figures[base], strict=True))


def fetch_table(
    root: Path, window: int, windows: int, repeats: int, batch_size: int, workers: int
) -> dict[str, float]:
    shard = root / "one_shard" / "shard_00000"
    floors = {
        "floor": FloorDataset(shard, window),
        "naive": NaiveFloor(shard, window),
        "floor+1": FloorDataset(shard, window, extra=1),
        "sft_floor": SFTItemFloor(shard, window),
    }
    store = StoreFactory.create("bin", window_size=window).load(root / "one_shard")
    store8 = StoreFactory.create("bin", window_size=window).load(root / "eight_shards")
    ds = DatasetFactory.load("sft", root / "one_shard", window_size=window, sample="window")
    seq = DatasetFactory.load("seq", root / "one_shard", window_size=window)
    floors["seq_floor"] = SEQItemFloor(shard, window)
    record_floor = RecordFloor(shard)
    records = np.random.default_rng(2).integers(0, len(record_floor), 2 * windows).tolist()
    if not len(floors["floor"]) == len(store) == len(store8) == len(ds):
        raise RuntimeError(f"window counts differ: {len(floors['floor'])}, {len(store)}, {len(ds)}")
    # single-process reads are ~20x faster than DataLoader batches: twice the windows and
    # three times the rounds, so their in-round ratios ride out a busy neighbour
    many = np.random.default_rng(1).integers(0, len(ds), 2 * windows).tolist()
    indices = many[:windows]

    def fetch(s):  # what store[i] does, spelled out as the seed's API
        return lambda i: s.fetch(*s.window_at(i), KEYS)

    reads = {name: f.__getitem__ for name, f in floors.items()}
    reads |= {"store": fetch(store), "store8": fetch(store8), "sft": ds.__getitem__}
    reads |= {"seq": seq.__getitem__}
    runs = {n: lambda r=r: rate(r, many) for n, r in reads.items()}
    runs["record_floor"] = lambda: rate(record_floor.__getitem__, records)
    runs["record"] = lambda: rate(lambda i: store.fetch_row(i, "sequence"), records)
    runs["record8"] = lambda: rate(lambda i: store8.fetch_row(i, "sequence"), records)
    single = rounds(runs, 3 * repeats)
    datasets = {"floor": floors["floor"], "store": store}
    datasets |= {"floor+1": floors["floor+1"], "sft_floor": floors["sft_floor"], "sft": ds}
    loaders = {n: loader(d, indices, batch_size, workers) for n, d in datasets.items()}
    for batches in loaders.values():  # start the workers, fill the page cache
        loader_rate(batches, windows)
    multi = rounds({n: lambda b=b: loader_rate(b, windows) for n, b in loaders.items()}, repeats)
    loaders.clear()  # drops the iterators, which stops the persistent workers now
    rows = [  # (path, figures, name, base name)
        ("floor: memmap window", single, "floor", "floor"),
        ("naive: np.memmap slicing", single, "naive", "floor"),
        ("MmapStore.fetch, 1 shard", single, "store", "floor"),
        ("MmapStore.fetch, 8 shards", single, "store8", "floor"),
        ("floor: window + 1 token", single, "floor+1", "floor+1"),
        ("floor: SFT item in numpy", single, "sft_floor", "floor+1"),
        ("SFTDataset ds[i]", single, "sft", "floor+1"),
        ("floor: SEQ item in numpy", single, "seq_floor", "floor+1"),
        ("SEQDataset ds[i]", single, "seq", "floor+1"),
        ("floor: record from offsets", single, "record_floor", "record_floor"),
        ("fetch_row, 1 shard", single, "record", "record_floor"),
        ("fetch_row, 8 shards", single, "record8", "record_floor"),
        ("floor: memmap window", multi, "floor", "floor"),
        ("MmapStore store[i]", multi, "store", "floor"),
        ("floor: window + 1 token", multi, "floor+1", "floor+1"),
        ("floor: SFT item in numpy", multi, "sft_floor", "floor+1"),
        ("SFTDataset ds[i]", multi, "sft", "floor+1"),
    ]
    print(
        f"random window fetch: window {window}, keys {KEYS}, {len(ds)} windows; 1 process: "
        f"{len(many)} random windows per CPU second; DataLoader: {windows} per wall second, "
        f"batch {batch_size}; medians of {3 * repeats} and {repeats} rounds, "
        "ratio = median of in-round ratios"
    )
    print(f"{'path':<28}{'mode':<15}{'windows/s':>12}{'tokens/s':>15}{'ratio':>8}")
    for path, figures, name, base in rows:
        mode = "1 process" if figures is single else f"DataLoader x{workers}"
        value = statistics.median(figures[name])
        ratio = paired_ratio(figures, name, base)
        print(f"{path:<28}{mode:<15}{value:>12,.0f}{value * window:>15,.0f}{ratio:>8.2f}")
    return {
        "fetch_ratio": paired_ratio(single, "store", "floor"),
        "fetch_ratio_vs_naive": paired_ratio(single, "store", "naive"),
        "fetch_8_shards_ratio": paired_ratio(single, "store8", "floor"),
        "sft_item_ratio": paired_ratio(single, "sft", "floor+1"),
        "sft_item_ratio_vs_item_floor": paired_ratio(single, "sft", "sft_floor"),
        "seq_item_ratio_vs_item_floor": paired_ratio(single, "seq", "seq_floor"),
        "record_fetch_ratio": paired_ratio(single, "record", "record_floor"),
        "record_fetch_8_shards_ratio": paired_ratio(single, "record8", "record_floor"),
        "loader_store_ratio": paired_ratio(multi, "store", "floor"),
        "loader_sft_ratio": paired_ratio(multi, "sft", "floor+1"),
        "loader_sft_ratio_vs_item_floor": paired_ratio(multi, "sft", "sft_floor"),
        "fetch_windows_per_s": statistics.median(single["store"]),
        "floor_windows_per_s": statistics.median(single["floor"]),
    }


def open_seconds(path: Path) -> float:
    """Seconds of MmapStore.load + one fetch_row (the middle record)."""
    start = time.perf_counter()
    store = StoreFactory.create("bin").load(path)
    store.fetch_row(store.num_rows // 2, "sequence")
    return time.perf_counter() - start


def open_table(root: Path, sizes: tuple[int, ...], repeats: int) -> dict[str, float]:
    """Writes every size first, then opens them in turn, so the sizes share the same moments."""
    paths = {n: root / f"records_{n}" for n in sizes}
    for records, path in paths.items():
        write_records(path, records)
        open_seconds(path)  # warm-up: meta.json and the touched pages in the page cache
    times = rounds({n: lambda p=p: open_seconds(p) for n, p in paths.items()}, repeats)
    seconds = {n: statistics.median(t) for n, t in times.items()}
    for path in paths.values():
        shutil.rmtree(path)
    base = seconds[sizes[0]]
    print(
        f"open time: MmapStore.load + fetch_row, 2 shards, {RECORD_TOKENS} tokens per record, "
        f"median of {repeats}"
    )
    print(f"{'records':>12}{'ms':>10}{'ratio':>8}")
    for records, s in seconds.items():
        print(f"{records:>12,}{1000 * s:>10.2f}{s / base:>8.2f}")
    out = {f"open_ms_{n:.0e}".replace("+0", ""): 1000 * s for n, s in seconds.items()}
    out["open_ratio_largest"] = seconds[sizes[-1]] / base
    return out


def main(
    quick: bool = False,
    window: int = 2048,
    repeats: int = 5,
    batch_size: int = 16,
    workers: int = 2,
) -> dict[str, float]:
    """Prints the fetch and open-time tables; returns their headline figures."""
    tokens = (4 if quick else 16) * 2**20
    windows = 2_000 if quick else 5_000
    sizes = (10_000, 1_000_000) if quick else (10_000, 1_000_000, 10_000_000)
    repeats = 3 if quick else repeats
    with tempfile.TemporaryDirectory(prefix="bench_store_") as tmp:
        root = Path(tmp)
        write_sft(root / "one_shard", tokens, shards=1)
        write_sft(root / "eight_shards", tokens, shards=8)
        figures = fetch_table(root, window, windows, repeats, batch_size, workers)
        print()
        figures |= open_table(root, sizes, 5 if quick else 11)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repeats")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    main(args.quick, args.window, args.repeats, args.batch_size, args.workers)
