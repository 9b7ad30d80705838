"""`tokenmill export` and `tokenmill import`: tokenmill datasets in the formats other trainers read.

Export: to Megatron `.bin/.idx` (one Megatron sequence and document per tokenmill document;
token ids only, so a loss mask is refused unless dropped on purpose), and to Hugging Face
Arrow (hf_export.py). Import: a Megatron corpus as a `sequence` dataset, one row per
Megatron document, token for token. Shards are read through shards/reader.py and written
through shards/writer.py.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import __version__
from tokenmill.preprocess.config import OutputConfig
from tokenmill.preprocess.ledger import Ledger
from tokenmill.preprocess.run.runlog import Summary
from tokenmill.shards.format import RUN_DIR, Column, DocumentLengths, positions_mark_documents
from tokenmill.shards.manifest import local_not_ours, read_manifest, write_manifest
from tokenmill.shards.reader import find_shards, map_shard, read_meta
from tokenmill.shards.schema import stored_schema
from tokenmill.shards.writer import ShardWriter
from tokenmill.tools.megatron import paths, read_megatron, token_dtype, write_megatron

EXPORT_FORMATS = ("megatron", "hf")


_TOKENS_PER_WRITE = 1 << 24


# --- reading a tokenmill dataset ----------------------------------------------------------------
def dataset_shards(root: str | Path) -> tuple[dict | None, list[tuple[str, Path]]]:
    """(manifest, [(domain, shard folder)]) of a finished dataset, in the order stores read it."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a tokenmill dataset folder")
    manifest = read_manifest(root)
    if manifest is None:
        if (root / RUN_DIR).is_dir():
            raise ValueError(
                f"{root}: the run writing this dataset has not finished (no manifest.json); "
                "re-run the same preprocess command first"
            )
        # written by another tool in the seed's format: domains are the shards' parent folders
        shards = [(_domain_of(s.relative_to(root)), s) for s in find_shards(root)]
    else:
        if manifest.get("storage_format") == "jsonl":
            raise ValueError(
                f"{root}: stored as JSONL parts; export reads memory-mapped shards "
                "(preprocess with output.storage_format: bin)"
            )
        shards = [
            (domain, root / domain / info["name"] if domain else root / info["name"])
            for domain, infos in manifest.get("domains", {}).items()
            for info in infos
        ]
    if not shards:
        raise FileNotFoundError(f"{root}: no shard (a folder with meta.json) below it")
    return manifest, shards


def _domain_of(relative: Path) -> str:
    parent = relative.parent.as_posix()
    return "" if parent == "." else parent


def shard_columns(shard: Path) -> dict[str, Column]:
    return map_shard(shard, read_meta(shard))


# --- export to Megatron -------------------------------------------------------------------------
def export_megatron(
    root: str | Path,
    prefix: str | Path,
    tokens_only: bool = False,
    overwrite: bool = False,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Writes the dataset's `sequence` tokens as PREFIX.bin/PREFIX.idx, in stored order.

    One Megatron sequence, and one document, per tokenmill document: a row's `doc_lengths`
    pieces, a piece that goes on with the one before it (positions counting on, as `stream`
    packing cuts documents at rows and shards) joined to it; without `doc_lengths`, each row.
    Megatron keeps token ids only: a dataset with a `loss_mask` is refused unless
    `tokens_only`, since every token of it, prompts included, would then train.
    """
    manifest, shards = dataset_shards(root)
    keys = list(read_meta(shards[0][1]))
    schema = stored_schema(keys)
    if schema is None or "sequence" not in schema.tokens:
        raise ValueError(
            f"{root}: no `sequence` key (keys: {', '.join(keys)}): Megatron's format holds one "
            "token stream, as seq and sft data have; export this one with --to hf"
        )
    dropped = [k for k in keys if k not in ("sequence", "position_ids", "doc_lengths")]
    mask = schema.tokens["sequence"]
    if mask is not None:
        if not tokens_only:
            raise ValueError(
                f"{root} has a {mask}, which Megatron's .bin/.idx cannot hold: every token "
                "would train, prompts included. Pass --tokens-only to export the tokens anyway, "
                "or export --to hf to keep the mask"
            )
        if warn is not None:
            warn(f"exporting tokens only: {', '.join(dropped)} left behind; all tokens will train")
    bin_path, idx_path = paths(prefix)
    for path in (bin_path, idx_path):
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass --overwrite to replace it")
    make_parent(bin_path)
    lengths, low, high = _document_lengths(shards, positions_mark_documents(manifest))
    dtype = token_dtype(low, high)
    write_megatron(prefix, dtype, lengths, _tokens(shards))
    return {
        "bin": str(bin_path),
        "idx": str(idx_path),
        "dtype": dtype.name,
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "left_behind": dropped,
    }


def _document_lengths(shards: list[tuple[str, Path]], marks: bool) -> tuple[np.ndarray, int, int]:
    """Every document's length, in order (`DocumentLengths`, a domain at a time: documents
    never run from one domain into the next), and the lowest and highest token id."""
    out: list[np.ndarray] = []
    low = 0
    high = 0
    documents: DocumentLengths | None = None
    domain: str | None = None
    for shard_domain, shard in shards:
        if documents is None or shard_domain != domain:
            if documents is not None:
                out.append(documents.lengths())
            documents = DocumentLengths(marks)
            domain = shard_domain
        columns = shard_columns(shard)
        sequence = columns["sequence"].values
        if len(sequence):
            low = min(low, int(sequence.min()))
            high = max(high, int(sequence.max()))
        documents.add(columns)
    if documents is not None:
        out.append(documents.lengths())
    lengths = np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)
    return lengths, low, high


def _tokens(shards: list[tuple[str, Path]]) -> Iterator[np.ndarray]:
    for _, shard in shards:
        values = shard_columns(shard)["sequence"].values
        for start in range(0, len(values), _TOKENS_PER_WRITE):
            yield values[start : start + _TOKENS_PER_WRITE]


# --- import from Megatron -----------------------------------------------------------------------
IMPORT_KEYS = {"sequence": "int32", "position_ids": "int32", "doc_lengths": "int32"}


def import_megatron(
    prefix: str | Path,
    out: str | Path,
    max_tokens_per_shard: int | None = None,
    overwrite: bool = False,
) -> Summary:
    """Writes a Megatron corpus as a tokenmill `seq` dataset: one row per Megatron document
    (its sequences joined), with `position_ids` from 0 and `doc_lengths` as the pipeline writes
    them, token for token in corpus order; an empty document is counted and left out."""
    start = time.perf_counter()
    corpus = read_megatron(prefix)
    if not int(corpus.lengths.sum()):
        raise ValueError(f"{prefix}: the corpus holds no token; nothing to import")
    if corpus.dtype.itemsize > 4 and len(corpus.tokens):
        low, high = int(corpus.tokens.min()), int(corpus.tokens.max())
        if low < 0 or high > np.iinfo(np.int32).max:
            raise ValueError(f"{prefix}: token ids in [{low}, {high}] do not fit int32")
    out = Path(out).absolute()
    for path in paths(prefix):
        if out.resolve() in path.resolve().parents:
            raise ValueError(f"{out} holds the corpus {path}; write the dataset elsewhere")
    _fresh_output(out, overwrite)
    if max_tokens_per_shard is None:
        max_tokens_per_shard = OutputConfig().max_tokens_per_shard
    writer = ShardWriter(out, IMPORT_KEYS, "sequence", max_tokens_per_shard)
    ledger = Ledger()
    try:
        for d in range(corpus.documents):
            tokens = corpus.document(d)
            ledger.records_read += 1
            if not len(tokens):
                ledger.drop("too_short", 1, 0)
                continue
            n = len(tokens)
            row = {
                "sequence": tokens,
                "position_ids": np.arange(n, dtype=np.int32),
                "doc_lengths": np.array([n], dtype=np.int32),
            }
            writer.add(row)
            ledger.records_written += 1
            ledger.tokens_read += n
            ledger.tokens_written += n
        infos = writer.close()
    except BaseException:
        writer.abort()
        shutil.rmtree(out, ignore_errors=True)
        raise
    empty = ledger.dropped.get("too_short", {}).get("records", 0)
    summary = Summary(
        records_read=ledger.records_read,
        records_written=ledger.records_written,
        skipped={"too_short": empty} if empty else {},
        rows=ledger.records_written,
        tokens=ledger.tokens_written,
        trained_tokens=ledger.tokens_written,
        shards=len(infos),
        seconds=time.perf_counter() - start,
        tokens_read=ledger.tokens_read,
        dropped=ledger.as_dict()["dropped"],
        domains={"": ledger.as_dict()},
    )
    bin_path, idx_path = paths(prefix)
    write_manifest(
        out,
        {
            "tool": f"tokenmill {__version__}",
            "source": {
                "format": "megatron",
                "bin": str(bin_path.absolute()),
                "idx": str(idx_path.absolute()),
                "dtype": corpus.dtype.name,
                "sequences": len(corpus.lengths),
                "documents": corpus.documents,
            },
            "keys": dict(IMPORT_KEYS),
            "primary_key": "sequence",
            "storage_format": "bin",
            "domains": {"": infos},
            "summary": summary.as_dict(),
        },
    )
    return summary


# --- output paths -------------------------------------------------------------------------------
def _fresh_output(out: Path, overwrite: bool) -> None:
    """An empty folder to write a dataset into; `overwrite` replaces only a tokenmill dataset."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is a file; give a folder to write")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it")
        why = local_not_ours(out)
        if why is not None:
            raise FileExistsError(
                f"{out} is not a tokenmill dataset ({why}): --overwrite replaces only what "
                "tokenmill wrote; remove it yourself"
            )
        shutil.rmtree(out)
    make_parent(out)
    out.mkdir(exist_ok=True)


def make_parent(path: Path) -> None:
    parent = path.absolute().parent
    for folder in (parent, *parent.parents):
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder}: is a file, so {path} cannot be written below it")
    parent.mkdir(parents=True, exist_ok=True)
