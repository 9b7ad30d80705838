"""Ray engine throughput next to the local engine, on the same machine, data and worker count.

Both runs are the whole Pipeline (read, mask, pack, write shards) over chat SFT records; the
Ray engine's time includes its scan pass and its actor pool's start (Ray itself is started once,
before timing). Prints records/s and tokens/s, medians of `repeats`, and the Ray/local ratio.
Run: python benchmarks/bench_ray.py [--copies 3] [--repeats 3] [--workers 2] [--ray-address ADDR]
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
    copies: int = 3, repeats: int = 3, workers: int | None = None, ray_address: str | None = None
) -> dict[str, float]:
    import ray

    workers = workers or os.cpu_count() or 1
    if ray_address:
        ray.init(address=ray_address)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    rates: dict[str, list[tuple[float, float]]] = {"local": [], "ray": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = corpus(copies, Path(tmp))
            for i in range(repeats):
                for engine in rates:
                    seconds, records, tokens = run(
                        path, Path(tmp) / f"{engine}{i}", workers, engine
                    )
                    rates[engine].append((records / seconds, tokens / seconds))
    finally:
        ray.shutdown()
    med = {
        e: (statistics.median(r for r, _ in v), statistics.median(t for _, t in v))
        for e, v in rates.items()
    }
    print(
        f"preprocessing engines, chat SFT ({copies}x1000 records, {workers} workers, median of {repeats})"
    )
    print(f"{'engine':<8}{'records/s':>12}{'tokens/s':>14}{'ratio':>8}")
    for engine, (records, tokens) in med.items():
        print(f"{engine:<8}{records:>12,.0f}{tokens:>14,.0f}{tokens / med['local'][1]:>8.2f}")
    return {
        "local_tokens_per_s": med["local"][1],
        "ray_tokens_per_s": med["ray"][1],
        "local_records_per_s": med["local"][0],
        "ray_records_per_s": med["ray"][0],
        "ratio": med["ray"][1] / med["local"][1],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--ray-address", default=None)
    args = parser.parse_args()
    main(args.copies, args.repeats, args.workers, args.ray_address)
    sys.exit(0)
