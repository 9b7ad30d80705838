"""Preprocessing throughput vs the raw `tokenizers` floor, measured in the same run.

Floor: `Tokenizer.encode_batch` (Rust, all cores) over the exact rendered chat
texts the pipeline tokenizes. Candidate: the whole Pipeline (read, validate,
render, tokenize, mask, pack, write shards) on the same records with all cores.
Prints medians and the ratio; the goal is >= 0.85x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from tokenmill.preprocess.chat_template import render_text
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.pipeline import Pipeline
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "chat_sharegpt_1000.jsonl"
TOKENIZER = ROOT / "data" / "tokenizers" / "qwen2.5"


def corpus(copies: int, folder: Path) -> Path:
    path = folder / "chat.jsonl"
    path.write_bytes(DATA.read_bytes() * copies)
    return path


def floor(path: Path) -> tuple[float, int]:
    bundle = load_tokenizer(TOKENIZER)
    texts = [
        render_text(bundle, orjson.loads(line)["messages"])
        for line in path.read_bytes().splitlines()
    ]
    start = time.perf_counter()
    encodings = bundle.tokenizer.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(e.ids) for e in encodings)


def run(path: Path, out: Path, workers: int, engine: str = "local") -> tuple[float, int, int]:
    """(seconds, records read, tokens written) of one end-to-end Pipeline run on `engine`."""
    config = default_config("sft").model_dump(mode="json")
    config["preprocessing"].update(max_seq_len=1_000_000, max_packed_len=1_000_000, min_chars=0)
    start = time.perf_counter()
    summary = Pipeline(
        PipelineConfig.from_dict(config),
        [path],
        out,
        TOKENIZER,
        workers=workers,
        on_error="skip",
        engine=engine,
        overwrite=True,
        progress=False,
    ).run()
    return time.perf_counter() - start, summary.records_read, summary.tokens


def main(copies: int = 3, repeats: int = 3, workers: int | None = None) -> dict[str, float]:
    workers = workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = corpus(copies, Path(tmp))
        floors, runs = [], []
        for i in range(repeats):
            seconds, tokens = floor(path)
            floors.append(tokens / seconds)
            seconds, _, written = run(path, Path(tmp) / f"out{i}", workers)
            runs.append(written / seconds)
    f, p = statistics.median(floors), statistics.median(runs)
    print(
        f"preprocessing, chat SFT ({copies}x1000 records, {workers} workers, median of {repeats})"
    )
    print(f"{'what':<34}{'tokens/s':>14}{'ratio':>8}")
    print(f"{'floor: tokenizers encode_batch':<34}{f:>14,.0f}{1.0:>8.2f}")
    print(f"{'tokenmill Pipeline (end to end)':<34}{p:>14,.0f}{p / f:>8.2f}")
    return {"floor_tokens_per_s": f, "pipeline_tokens_per_s": p, "ratio": p / f}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    main(args.copies, args.repeats, args.workers)
    sys.exit(0)
