"""Memory and start-up at scale: a loader worker's private memory next to a bare torch worker's,
from 1e4 to 1e8 samples, and import plus open of a dataset next to importing torch.

Worker memory: DataflowLoader(MapDistributor(SEQDataset)) with 2 workers reads 100 batches of
a store of N one-token windows (N + 1 int32 tokens: the cheapest store with 1e8 samples); each
worker's private memory (Private_Dirty of /proc/PID/smaps_rollup: its heap and the pages it
copied on write, not the page cache it shares) is compared with a bare torch DataLoader worker
over a dataset of the same length that returns a constant (the floor). An epoch order held as
an array would cost 8 bytes per sample per worker: 800 MB at 1e8.
Start-up: a fresh interpreter importing torch (the floor) and one importing tokenmill, opening
the 1e6-sample store with DatasetFactory.load and reading one item, median of 5.
Run: python benchmarks/bench_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from tokenmill.dataflow import DataflowLoader, MapDistributor
from tokenmill.shards.writer import ShardWriter
from tokenmill.training.datasets import SEQDataset
from tokenmill.training.mmap_store import MmapStore

BATCHES, WORKERS, MIB = 100, 2, 2**20


class Constant(Dataset):
    """The floor: N items that cost nothing to read."""

    def __init__(self, n: int) -> None:
        self.n, self.item = n, torch.zeros(2, dtype=torch.int64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.item


def write_store(root: Path, samples: int) -> Path:
    """N + 1 tokens in shards of 2**26: N windows of one token (and its target)."""
    with ShardWriter(root, {"sequence": "int32"}, "sequence", max_tokens_per_shard=2**26) as w:
        for start in range(0, samples + 1, 1 << 24):
            count = min(1 << 24, samples + 1 - start)
            w.add({"sequence": (np.arange(start, start + count) % 150_000).astype(np.int32)})
    return root


def children() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return pids


def private_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no Private_Dirty for {pid}")


def worker_mib(loader) -> float:
    """Mean private memory of the loader's workers after BATCHES batches."""
    before = set(children())
    it = iter(loader)
    for _ in range(BATCHES):
        next(it)
    workers = [p for p in children() if p not in before]
    mib = statistics.mean(private_mib(p) for p in workers)
    del it
    return mib


def startup_seconds(code: str, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main(quick: bool = False) -> dict[str, float]:
    sizes = (10**4, 10**6) if quick else (10**4, 10**6, 10**8)
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"private memory per loader worker ({WORKERS} workers, {BATCHES} batches of 8)")
        print(
            f"{'samples':>13} {'bare torch MiB':>15} {'DataflowLoader MiB':>19} {'extra MiB':>10}"
        )
        for n in sizes:
            root = write_store(Path(tmp) / f"s{n}", n)
            ds = SEQDataset(MmapStore(window_size=1).load(root), max_len=1)
            assert len(ds) == n
            bare = worker_mib(DataLoader(Constant(n), batch_size=8, num_workers=WORKERS))
            flow = worker_mib(DataflowLoader(MapDistributor(ds), batch_size=8, num_workers=WORKERS))
            print(f"{n:>13,} {bare:>15.1f} {flow:>19.1f} {flow - bare:>10.1f}")
            figures[f"worker extra MiB at {n:.0e}"] = flow - bare
        path = Path(tmp) / f"s{10**6}"
        repeats = 3 if quick else 5
        floor = startup_seconds("import torch", repeats)
        opened = startup_seconds(
            "import torch\n"
            "from tokenmill.training.dataset_factory import DatasetFactory\n"
            f"DatasetFactory.load('seq', {str(path)!r}, window_size=2048)[0]\n",
            repeats,
        )
    print(f"\nstart-up (fresh interpreter, median of {repeats})")
    print(
        f"import torch: {floor:.2f} s; + import tokenmill, open a store, read an item: "
        f"{opened:.2f} s; beyond torch: {opened - floor:.2f} s"
    )
    figures["start-up beyond torch s"] = opened - floor
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
