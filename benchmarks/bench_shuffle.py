"""Shards each machine downloads per epoch under the global and the shard-aware shuffle.

Pure counting of the sample order (training.order.order_at), no network: N shards of equal
size are read by M machines x R ranks in lockstep (global position p goes to rank p % (M * R),
on machine rank // R); each machine keeps an LRU cache of whole shards holding a tenth of the
data, and a miss downloads a shard. The floor is the machine's share (N / M shards), so the
ratio is bytes downloaded per machine per epoch over its share. Goal: at most 1.3x for the
shard-aware shuffle. Also: distinct shards a machine touches, and shard switches per rank
(consecutive reads from different shards). The last rows resume the shard-aware order
(canonical groups fixed by the first run's M x R ranks) under other world sizes.
Run: python benchmarks/bench_shuffle.py [--shards 1000] [--items 100] [--machines 4] [--ranks 8]
"""

from __future__ import annotations

import argparse
import statistics
from collections import OrderedDict

import numpy as np

from tokenmill.training.order import ShardLayout, epoch_order

GOAL = 1.3


def machine_downloads(shard_of: np.ndarray, world: int, ranks: int, cache: int) -> list[int]:
    """Shards each machine downloads reading `shard_of` (the shard at each global position) in
    lockstep, through an LRU cache of `cache` shards per machine."""
    machines = world // ranks
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(machines)]
    misses = [0] * machines
    for p, shard in enumerate(shard_of.tolist()):
        m = (p % world) // ranks
        lru = caches[m]
        if shard in lru:
            lru.move_to_end(shard)
            continue
        misses[m] += 1
        lru[shard] = None
        if len(lru) > cache:
            lru.popitem(last=False)
    return misses


def measure(
    shards: int,
    items: int,
    machines: int,
    ranks: int,
    shuffle: bool | str,
    groups: int,
    window: int,
) -> dict[str, float]:
    """One epoch's counts (see the module docstring)."""
    n, world = shards * items, machines * ranks
    layout = ShardLayout(np.arange(0, n + 1, items), groups, window)
    shard_of = epoch_order(n, 7, 0, shuffle, layout) // items
    cache = max(1, shards // 10)
    downloads = machine_downloads(shard_of, world, ranks, cache)
    share = shards / machines
    touched = [
        len(np.unique(shard_of[np.isin(np.arange(n) % world // ranks, [m])]))
        for m in range(machines)
    ]
    switches = [int(np.count_nonzero(np.diff(shard_of[r::world]))) for r in range(world)]
    return {
        "touched": statistics.mean(touched),
        "share": share,
        "downloaded": statistics.mean(downloads),
        "ratio": max(downloads) / share,
        "switches": statistics.median(switches),
        "reads": n / world,
    }


def main(
    shards: int = 1000, items: int = 100, machines: int = 4, ranks: int = 8, window: int = 4
) -> dict[str, float]:
    groups = machines * ranks  # the default: the first run's world size
    print(
        f"{shards} shards x {items} samples, read by machines x ranks; LRU cache of "
        f"{max(1, shards // 10)} shards (a tenth of the data) per machine; window {window} shards"
    )
    print(
        f"{'shuffle':<8} {'groups':>6} {'machines':>8} {'touched':>8} {'share':>6} "
        f"{'downloaded':>10} {'x share':>8} {'switches/rank':>13} {'reads/rank':>10}"
    )
    figures: dict[str, float] = {}
    rows = [
        ("global", True, machines),
        ("shards", "shards", machines),
        ("shards", "shards", max(1, machines // 2)),  # resumed on half the machines: divides
        ("shards", "shards", machines - 1 if machines > 2 else machines),  # does not divide
    ]
    for name, shuffle, now in rows:
        m = measure(shards, items, now, ranks, shuffle, groups, window)
        print(
            f"{name:<8} {groups if shuffle == 'shards' else '-':>6} {f'{now}x{ranks}':>8} "
            f"{m['touched']:>8.0f} {m['share']:>6.0f} {m['downloaded']:>10.0f} "
            f"{m['ratio']:>7.2f}x {m['switches']:>13.0f} {m['reads']:>10.0f}"
        )
        figures[f"{name} on {now}x{ranks}: downloads / share"] = round(m["ratio"], 3)
    shard_aware = figures[f"shards on {machines}x{ranks}: downloads / share"]
    verdict = "meets" if shard_aware <= GOAL else "MISSES"
    print(
        f"shard-aware shuffle: {shard_aware:.2f}x the machine's share ({verdict} goal <= {GOAL}x)"
    )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--window", type=int, default=4)
    args = parser.parse_args()
    main(args.shards, args.items, args.machines, args.ranks, args.window)
