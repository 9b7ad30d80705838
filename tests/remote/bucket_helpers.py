"""What the remote tests share: small datasets, and byte-for-byte comparisons."""

from __future__ import annotations

from pathlib import Path

from helpers import ROOT

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config

# --- datasets ---------------------------------------------------------------------------
DATA = ROOT / "data"
QWEN = DATA / "tokenizers" / "qwen2.5"
SOURCES = {"sft": ("chat_sharegpt_1000.jsonl", 160), "seq": ("pretrain_c4_300.jsonl", 60)}


def small_config(train_type: str, shard_tokens: int = 5_000) -> PipelineConfig:
    """The built-in config, with small chunks, tasks and shards: many of each from little data."""
    data = default_config(train_type).model_dump(mode="json")
    data["preprocessing"].update(batch_size=8, task_bytes=40_000)
    data["output"]["max_tokens_per_shard"] = shard_tokens
    return PipelineConfig.from_dict(data)


def source(train_type: str, folder: Path) -> Path:
    name, lines = SOURCES[train_type]
    text = (DATA / name).read_text().split("\n")
    dst = folder / f"{train_type}.jsonl"
    dst.write_text("".join(line + "\n" for line in [t for t in text if t][:lines]))
    return dst


def files_of(root: Path) -> dict[str, bytes]:
    """Every file below root but the manifest (which holds the run's time), by relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def download(url: str, options: dict, to: Path) -> Path:
    """A bucket prefix copied to a local folder with a plain fsspec get."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    to.mkdir(parents=True, exist_ok=True)
    fs.get(path.rstrip("/") + "/", str(to) + "/", recursive=True)
    return to
