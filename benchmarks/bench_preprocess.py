"""Preprocessing throughput vs the raw `tokenizers` floor, per training type, in the same run.

Floor: `Tokenizer.encode_batch` (Rust, all cores) over the exact texts the pipeline tokenizes:
chat SFT, each rendered conversation; DPO, each rendered prompt + reply (both replies); text,
each document; on a plain tokenizer loaded from the file (the goal's floor), and on the
pipeline's own tokenizer object (its larger word cache: that ratio is what the pipeline adds
to the tokenizer). Candidate: the whole Pipeline (read, validate, render, tokenize, mask, pack,
write shards) on the same records with all cores, on the `sft`, `dpo` and `seq` presets. Every
measurement starts with an empty word cache, as a fresh process does. Each corpus repeats a
sample file to at least `tokens` tokens, so that a run is long enough to time (and every word
is cached after the first copy: real data, which does not repeat, gains less from the larger
cache); so each type is also measured on one copy of its sample, no record twice (about a
tenth of the tokens, so noisier), which shows whether the repeats flatter the ratios. The
pipeline and the floors take turns going first (the host's speed drifts within a round).
Prints medians and each type's ratios (medians of per-repeat ratios, with the lowest and
highest repeat's: the spread that the host's noise leaves); the goal is >= 0.9x of the plain
floor.
Run: python benchmarks/bench_preprocess.py [--tokens 10000000] [--repeats 5] [--workers N]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
import tokenizers

from tokenmill.preprocess.chat.template import render_text
from tokenmill.preprocess.chat.tokenizer import empty_word_cache, load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "data" / "tokenizers" / "qwen2.5"
# label: (preset, sample file); the samples' DPO replies repeat their prompt, so the
# conversation the pipeline renders for a reply is the reply's own messages
TYPES = {
    "chat SFT": ("sft", "chat_sharegpt_1000.jsonl"),
    "DPO": ("dpo", "dpo_en_300.jsonl"),
    "text": ("seq", "pretrain_c4_300.jsonl"),
}


def corpus(copies: int, folder: Path, sample: str = "chat_sharegpt_1000.jsonl") -> Path:
    path = folder / sample
    path.write_bytes((ROOT / "data" / sample).read_bytes() * copies)
    return path


def texts(train_type: str, sample: str) -> list[str]:
    """What the pipeline tokenizes for each record of one copy of `sample`, in order."""
    bundle = load_tokenizer(TOKENIZER)
    records = [orjson.loads(line) for line in (ROOT / "data" / sample).read_bytes().splitlines()]
    if train_type == "seq":
        return [r["text"] for r in records]
    keys = ["chosen", "rejected"] if train_type == "dpo" else ["messages"]
    return [render_text(bundle, r[key]) for r in records for key in keys]


def floor(texts: list[str], add_special_tokens: bool, own: bool = False) -> tuple[float, int]:
    """(seconds, tokens) of one `encode_batch` over all the texts: on a plain tokenizer, or
    (`own`) on the pipeline's tokenizer object with its word cache emptied."""
    if own:
        tokenizer = load_tokenizer(TOKENIZER).tokenizer
        empty_word_cache(tokenizer)  # as a run starts (the pipeline's Maskers empty it too)
    else:
        tokenizer = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    start = time.perf_counter()
    encodings = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
    seconds = time.perf_counter() - start
    return seconds, sum(len(e.ids) for e in encodings)


def run(
    path: Path, out: Path, workers: int, engine: str = "local", train_type: str = "sft"
) -> tuple[float, int, int]:
    """(seconds, records read, tokens written) of one end-to-end Pipeline run on `engine`,
    from an empty word cache (each run's Maskers empty it, on the driver and on Ray's workers)."""
    config = default_config(train_type).model_dump(mode="json")
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


def main(
    tokens: int = 10_000_000, repeats: int = 5, workers: int | None = None
) -> dict[str, float]:
    workers = workers or os.cpu_count() or 1
    figures: dict[str, float] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, (train_type, sample) in TYPES.items():
            one = texts(train_type, sample)
            add_special = train_type == "seq"  # chat renderings carry their own special tokens
            copies = math.ceil(tokens / floor(one, add_special)[1])
            for n in sorted({copies, 1}, reverse=True):  # quick runs may have one copy only
                path = corpus(n, Path(tmp), sample)
                rates: dict[str, list[float]] = {"plain": [], "own": [], "pipeline": []}
                for i in range(repeats):  # the pipeline goes first in odd rounds, last in even
                    kinds = ("plain", "own", "pipeline")
                    for kind in kinds if i % 2 == 0 else kinds[::-1]:
                        if kind == "pipeline":
                            out = Path(tmp) / f"out{i}"
                            seconds, _, written = run(path, out, workers, "local", train_type)
                            rates["pipeline"].append(written / seconds)
                            continue
                        seconds, floor_tokens = floor(one * n, add_special, kind == "own")
                        rates[kind].append(floor_tokens / seconds)
                f, o, p = (statistics.median(rates[k]) for k in ("plain", "own", "pipeline"))
                pairs = zip(rates["pipeline"], rates["plain"], rates["own"], strict=True)
                per_round, per_round_own = zip(*((a / b, a / c) for a, b, c in pairs))
                r, r_own = statistics.median(per_round), statistics.median(per_round_own)
                key = train_type if n == copies else f"{train_type}_one_copy"
                figures[f"{key}_floor_tokens_per_s"] = f
                figures[f"{key}_pipeline_tokens_per_s"] = p
                figures[f"{key}_ratio"] = r
                figures[f"{key}_ratio_same_tokenizer"] = r_own
                spread = (min(per_round), max(per_round))
                figures[f"{key}_lowest_round"], figures[f"{key}_highest_round"] = spread
                rows.append((label, n, len(one) * n, floor_tokens, f, o, p, r, spread, r_own))
    print(f"preprocessing end to end vs tokenizers encode_batch ({workers} workers, median of {repeats})")  # fmt: skip
    print(f"{'type':<10}{'copies':>7}{'texts':>9}{'tokens':>13}{'floor tok/s':>14}{'same tok. tok/s':>17}{'pipeline tok/s':>16}{'ratio':>7}{'rounds':>12}{'vs same':>9}")  # fmt: skip
    for label, n, texts_n, count, f, o, p, r, (low, high), r_own in rows:
        print(f"{label:<10}{n:>7}{texts_n:>9,}{count:>13,}{f:>14,.0f}{o:>17,.0f}{p:>16,.0f}{r:>7.2f}{low:>7.2f}-{high:.2f}{r_own:>9.2f}")  # fmt: skip
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=10_000_000, help="tokens per type, at least")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    main(args.tokens, args.repeats, args.workers)
    sys.exit(0)
