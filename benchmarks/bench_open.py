"""Opening a dataset of many shards: time and memory of the open, with and without its index.

Synthetic `seq` datasets of 1e3, 1e4 and 1e5 shards (8 int32 tokens in 2 rows each, written
as the shard writer lays them out). Each open runs in a fresh interpreter: DatasetFactory.load
then one item; its time, its Python heap (tracemalloc's peak) and its RSS growth (the
process's resident memory after the open minus before, index pages included). "old" is the
same dataset without `shards.index` (every meta.json read, every file stat'ed: the path of
datasets written before the index), measured up to 1e4 shards (1e5 is projected from it).
Worker start: a spawned DataLoader worker's first batch (the store re-made in the worker).
Goal: with the index, flat in the shard count within 2x, under 1 s and 64 MB at 1e5.
Run: python benchmarks/bench_open.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tokenmill.shards.format import file_hashes
from tokenmill.shards.index import INDEX_NAME, write_index

MIB = 2**20

PROBE = r"""
import json, sys, time, tracemalloc, warnings
warnings.simplefilter("ignore")
import torch
from tokenmill.training.dataset_factory import DatasetFactory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path, workers = sys.argv[1], int(sys.argv[2])
before = rss()
tracemalloc.start()
t = time.perf_counter()
ds = DatasetFactory.load("seq", path, window_size=4)
ds[len(ds) - 1]
opened = time.perf_counter() - t
heap = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
grown = rss() - before
first = 0.0
if workers:
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=1, multiprocessing_context="spawn"
    )
    t = time.perf_counter()
    next(iter(loader))
    first = time.perf_counter() - t
print(json.dumps({"open_s": opened, "heap": heap, "rss": grown, "worker_s": first}))
"""


def write_synthetic(root: Path, shards: int, tokens: int = 8) -> Path:
    """`shards` shards of `tokens` int32 tokens in 2 rows, laid out as the shard writer
    lays them out (meta.json with checksums, values and offsets files), without fsync."""
    values = np.arange(tokens, dtype="<i4")
    offsets = np.array([0, tokens // 2, tokens], dtype="<i8")
    meta = {
        "sequence": {
            "shape": [tokens],
            "dtype": "int32",
            "nbytes": values.nbytes,
            **file_hashes(values),
            "offsets": {"file": "sequence.offsets.bin", "count": 3, **file_hashes(offsets)},
        }
    }
    text = json.dumps(meta, indent=2).encode()
    data, bounds = values.tobytes(), offsets.tobytes()
    for s in range(shards):
        shard = root / f"shard_{s:05d}"
        shard.mkdir(parents=True)
        (shard / "sequence.bin").write_bytes(data)
        (shard / "sequence.offsets.bin").write_bytes(bounds)
        (shard / "meta.json").write_bytes(text)
    return root


def probe(path: Path, workers: int = 0) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(path), str(workers)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_probe(path: Path, repeats: int, workers: int = 0) -> dict:
    runs = [probe(path, workers) for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(quick: bool = False, repeats: int = 3) -> dict[str, float]:
    """Prints the open and worker-start tables; returns their headline figures."""
    counts = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    repeats = 1 if quick else repeats
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_open_") as tmp:
        rows = []
        for n in counts:
            root = write_synthetic(Path(tmp) / f"d{n}", n)
            old = median_probe(root, repeats) if n <= 10_000 else None
            write_index(root)
            new = median_probe(root, repeats)
            rows.append((n, new, old))
            if n == 10_000:
                spawned_new = median_probe(root, repeats, workers=1)
                (root / INDEX_NAME).unlink()
                spawned_old = median_probe(root, repeats, workers=1)
            shutil.rmtree(root)
    floor = rows[0][1]
    print("open (fresh process: DatasetFactory.load + one item), median of", repeats)
    print(
        f"{'shards':>8} {'open s':>8} {'x 1e3':>6} {'heap MB':>8} {'RSS MB':>7} "
        f"{'x 1e3':>6} | {'old open s':>10} {'old heap MB':>11} {'old/new':>7}"
    )
    for n, new, old in rows:
        line = (
            f"{n:>8,} {new['open_s']:>8.3f} {new['open_s'] / floor['open_s']:>6.2f} "
            f"{new['heap'] / MIB:>8.2f} {new['rss'] / MIB:>7.1f} "
            f"{max(new['rss'], 1) / max(floor['rss'], 1):>6.2f} | "
        )
        if old is not None:
            line += (
                f"{old['open_s']:>10.3f} {old['heap'] / MIB:>11.2f} "
                f"{old['open_s'] / new['open_s']:>7.1f}"
            )
        else:
            projected = rows[1][2]["open_s"] * n / rows[1][0] if rows[1][2] else float("nan")
            line += f"{projected:>10.1f} {'(projected)':>11}"
        print(line)
        figures[f"open_s_{n}"] = new["open_s"]
        figures[f"open_rss_mb_{n}"] = new["rss"] / MIB
        figures[f"open_heap_mb_{n}"] = new["heap"] / MIB
    print()
    print("spawned DataLoader worker, first batch, 1e4 shards")
    print(f"{'index s':>8} {'old s':>8} {'old/index':>9}")
    print(
        f"{spawned_new['worker_s']:>8.3f} {spawned_old['worker_s']:>8.3f} "
        f"{spawned_old['worker_s'] / spawned_new['worker_s']:>9.1f}"
    )
    figures["worker_first_batch_s"] = spawned_new["worker_s"]
    figures["worker_first_batch_old_s"] = spawned_old["worker_s"]
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="up to 1e4 shards, one run each")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.quick, args.repeats)
