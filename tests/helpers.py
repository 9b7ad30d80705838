"""What many test modules share: where the repository, its shipped data and tokenizers are."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = ROOT / "data"
TOKENIZERS = DATA / "tokenizers"
QWEN = TOKENIZERS / "qwen2.5"
GOLDEN = TESTS / "golden"
