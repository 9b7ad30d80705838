"""Packing speed and fill per strategy, for 1e3 to 1e5 documents.

Lengths are log-normal (median 600 tokens, sigma 1), so about 0.5% of documents
exceed the default max_packed_len of 8192 and simple/bfd truncate them. Fill is
the share of real tokens if every row were padded to max_len.
Run: python benchmarks/bench_packing.py [--max-len 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tokenmill.preprocess.packing import PACKING_STRATEGIES, plan_packing

SIZES = (1_000, 10_000, 100_000)


def doc_lengths(num_docs: int, seed: int = 0) -> np.ndarray:
    """Log-normal document lengths, at least one token."""
    rng = np.random.default_rng(seed)
    return np.maximum(rng.lognormal(np.log(600), 1.0, num_docs).astype(np.int64), 1)


def measure(lengths: np.ndarray, max_len: int, strategy: str, repeats: int) -> dict[str, float]:
    """Median time of `repeats` plans, with the plan's row count, fill and dropped share."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rows, dropped = plan_packing(lengths, max_len, strategy)
        times.append(time.perf_counter() - start)
    placed = int(lengths.sum()) - dropped
    return {
        "ms": 1000 * statistics.median(times),
        "rows": len(rows),
        "fill": placed / (len(rows) * max_len),
        "dropped": dropped / int(lengths.sum()),
    }


def main(max_len: int = 8192, repeats: int = 3) -> dict[str, float]:
    print(f"plan_packing, max_len={max_len}, median of {repeats} runs")
    print(
        f"{'strategy':<10} {'docs':>8} {'ms':>9} {'us/doc':>7} {'rows':>7} {'fill':>7} {'dropped':>8}"
    )
    figures: dict[str, float] = {}
    for strategy in PACKING_STRATEGIES:
        for num_docs in SIZES:
            m = measure(doc_lengths(num_docs), max_len, strategy, repeats)
            figures[f"{strategy} fill at {num_docs} docs"] = m["fill"]
            print(
                f"{strategy:<10} {num_docs:>8} {m['ms']:>9.1f} {1000 * m['ms'] / num_docs:>7.2f} "
                f"{m['rows']:>7} {m['fill']:>7.2%} {m['dropped']:>8.2%}"
            )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.max_len, args.repeats)
