"""What many test modules share: where the repository, its shipped data and tokenizers are,
and a writer of small SFT shards."""

from pathlib import Path

import numpy as np

from tokenmill.shards.writer import ShardWriter

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = ROOT / "data"
TOKENIZERS = DATA / "tokenizers"
QWEN = TOKENIZERS / "qwen2.5"
GOLDEN = TESTS / "golden"


SFT_DTYPES = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}


def write_sft_rows(root: Path, seed: int, rows: int, lengths: tuple[int, int], shard: int) -> Path:
    """`rows` random SFT rows of lengths in [lengths) in shards of about `shard` tokens."""
    rng = np.random.default_rng(seed)
    with ShardWriter(root, SFT_DTYPES, "sequence", max_tokens_per_shard=shard) as writer:
        for _ in range(rows):
            n = int(rng.integers(*lengths))
            writer.add(
                {
                    "sequence": rng.integers(0, 150_000, n),
                    "loss_mask": rng.random(n) < 0.6,
                    "position_ids": np.arange(n),
                }
            )
    return root
