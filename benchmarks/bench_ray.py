"""Ray engine throughput next to the local engine, on the same machine, data and worker count.

Both runs are the whole Pipeline (read, mask, pack, write shards) over chat SFT records; the
Ray engine's time includes its scan pass and its tasks' start, a fixed cost that a larger input
amortises: so each size in `copies` (copies of the 1,000-record sample; 8 is about 10M tokens,
bench_preprocess's size; 24 about 30M) gets its own row. Ray is started once, and each engine
runs once, before timing (a Ray session's first run starts Ray's worker processes, and each
engine's first run loads the tokenizer).
Prints records/s and tokens/s, medians of `repeats` rounds, and per size the Ray/local ratio
and the lowest and highest pair's (the spread that the host's noise leaves).
The engines take turns going first (local first in even rounds), and the ratio is taken over
each pair of rounds (local, Ray, Ray, local: both engines' tokens over both engines' seconds),
then the median over the pairs: the host's speed drifts (a 24,000-record run took 27 s and,
later, 51 s; the same chunk's CPU time moved by 1.5x within a minute), and a steady drift
weighs on both sides of a pair alike, where it would tilt each round's own ratio.
Run: python benchmarks/bench_ray.py [--copies 3 8 24] [--repeats 6] [--workers 2] [--ray-address ADDR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_preprocess import (  # the same corpus and end-to-end run as the local benchmark
    corpus,
    run,
)


def main(
    copies: int | tuple[int, ...] = (3, 8, 24),
    repeats: int = 6,
    workers: int | None = None,
    ray_address: str | None = None,
) -> dict[str, float]:
    import ray

    sizes = (copies,) if isinstance(copies, int) else tuple(copies)
    workers = workers or os.cpu_count() or 1
    if ray_address:
        ray.init(address=ray_address)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    rows: dict[int, dict[str, tuple[float, float]]] = {}
    ratios: dict[int, float] = {}
    spreads: dict[int, tuple[float, float]] = {}  # the lowest and highest pair's ratio
    try:
        for size in sizes:
            # per engine, (seconds, records, tokens) of each round
            runs: dict[str, list[tuple[float, int, int]]] = {"local": [], "ray": []}
            with tempfile.TemporaryDirectory() as tmp:
                path = corpus(size, Path(tmp))
                if size == sizes[0]:  # untimed: see above
                    for engine in ("local", "ray"):
                        run(path, Path(tmp) / f"{engine}-warm", workers, engine)
                for i in range(repeats):
                    for engine in ("local", "ray") if i % 2 == 0 else ("ray", "local"):
                        runs[engine].append(run(path, Path(tmp) / f"{engine}{i}", workers, engine))
            rows[size] = {
                e: (
                    statistics.median(r / s for s, r, _ in v),
                    statistics.median(t / s for s, _, t in v),
                )
                for e, v in runs.items()
            }
            pairs = [
                tokens_per_s(runs["ray"][j : j + 2]) / tokens_per_s(runs["local"][j : j + 2])
                for j in range(0, repeats, 2)
            ]
            ratios[size], spreads[size] = statistics.median(pairs), (min(pairs), max(pairs))
    finally:
        ray.shutdown()
    print(f"preprocessing engines, chat SFT ({workers} workers, median of {repeats})")
    print(f"{'records':>8} {'engine':<8}{'records/s':>12}{'tokens/s':>14}{'ratio':>8}{'pairs':>13}")
    figures: dict[str, float] = {}
    for size, med in rows.items():
        for engine, (records, tokens) in med.items():
            ratio = ratios[size] if engine == "ray" else 1.0
            low, high = spreads[size] if engine == "ray" else (1.0, 1.0)
            print(f"{size * 1000:>8,} {engine:<8}{records:>12,.0f}{tokens:>14,.0f}{ratio:>8.2f}{low:>8.2f}-{high:.2f}")  # fmt: skip
        figures[f"ratio at {size * 1000} records"] = ratios[size]
        figures[f"lowest pair at {size * 1000} records"] = spreads[size][0]
        figures[f"highest pair at {size * 1000} records"] = spreads[size][1]
    largest = rows[max(rows)]
    figures.update(
        local_tokens_per_s=largest["local"][1],
        ray_tokens_per_s=largest["ray"][1],
        ratio=ratios[max(rows)],
    )
    return figures


def tokens_per_s(runs: list[tuple[float, int, int]]) -> float:
    """Tokens over seconds of (seconds, records, tokens) runs taken together."""
    return sum(t for _, _, t in runs) / sum(s for s, _, _ in runs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, nargs="+", default=[3, 8, 24])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--ray-address", default=None)
    args = parser.parse_args()
    main(tuple(args.copies), args.repeats, args.workers, args.ray_address)
    sys.exit(0)
