"""Dataset statistics for `tokenmill inspect`: what a trainer is about to learn from, in numbers.

Reads shards the way the stores do (meta.json + flat arrays, memory-mapped) and
computes per domain: documents and the packed rows that hold them (counted and measured
apart: document lengths decide truncation, row lengths decide batching), tokens, shards,
trained-token share, packing fill, DPO length gaps, GRPO group sizes and rewards; and the
run's ledger from the manifest (tokens read, written, dropped by reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.preprocess.ledger import Ledger
from tokenmill.preprocess.run.runlog import Summary
from tokenmill.shards.format import (
    Column,
    DocumentLengths,
    positions_mark_documents,
    primary_key,
    shard_records,
)
from tokenmill.shards.manifest import read_manifest
from tokenmill.shards.reader import find_shards, map_shard, read_meta
from tokenmill.shards.schema import ItemSchema, stored_schema

PERCENTILES = (50, 90, 99)


def _record_lengths(column: Column, stream_length: int) -> np.ndarray:
    """Elements of each record (all items of a group); a stream-only key is one long record."""
    if column.offsets is None:
        return np.asarray([stream_length], dtype=np.int64)
    bounds = column.offsets if column.items is None else column.items[column.offsets]
    return np.diff(bounds)


def domain_stats(shards: list[Path], manifest: dict | None) -> dict[str, Any]:
    keys: dict[str, dict[str, Any]] = {}
    lengths: dict[str, list[np.ndarray]] = {}
    groups: list[np.ndarray] = []
    rewards: list[np.ndarray] = []
    trained: dict[str, int] = {}
    documents = DocumentLengths(positions_mark_documents(manifest))
    counted = False  # whether the shards hold documents (sequences), not records
    schema: ItemSchema | None = None  # which keys hold tokens, masks and values
    rows = 0
    for shard in shards:
        meta = read_meta(shard)
        columns = map_shard(shard, meta)
        rows += shard_records(meta)
        schema = schema or stored_schema(meta)
        grouped = schema if schema is not None and schema.grouped else None  # GRPO's
        group_keys = list(grouped.tokens) if grouped else []  # a group of sequences per row
        reward_keys = grouped.values if grouped else ()
        if "doc_lengths" in columns or "sequence" in columns:
            documents.add(columns)
            counted = True
        columns.pop("doc_lengths", None)  # boundaries, not tokens
        for key, column in columns.items():
            n = len(column.values)
            info = keys.setdefault(key, {"dtype": meta[key]["dtype"], "elements": 0})
            info["elements"] += n
            if meta[key]["dtype"] == "bool":  # a mask (any config's): which tokens train
                trained[key] = trained.get(key, 0) + int(np.count_nonzero(column.values))
            elif key in reward_keys:
                rewards.append(np.asarray(column.values, dtype=np.float64))
            else:
                lengths.setdefault(key, []).append(_record_lengths(column, n))
            if key in group_keys and column.items is not None and column.offsets is not None:
                groups.append(np.diff(column.offsets))
    docs = documents.lengths()
    out: dict[str, Any] = {
        "rows": rows,
        "documents": len(docs) if counted else rows,
        "shards": len(shards),
        "keys": {},
    }
    if counted:
        out["document_length"] = _percentiles(docs)
    for key, info in keys.items():
        row: dict[str, Any] = {"dtype": info["dtype"], "tokens": info["elements"]}
        if key in lengths:
            lens = np.concatenate(lengths[key])
            row.update(_percentiles(lens))
        if key in trained:
            row["trained_share"] = trained[key] / info["elements"] if info["elements"] else 0.0
        out["keys"][key] = row
    stream_mask = schema.tokens.get("sequence") if schema is not None else None
    if stream_mask in trained:  # the token stream's own mask: its share is the dataset's
        out["trained_share"] = out["keys"][stream_mask]["trained_share"]
    pair = list(schema.tokens) if schema is not None and schema.train_type == "dpo" else []
    if pair and all(key in lengths for key in pair):
        gap = np.concatenate(lengths[pair[0]]) - np.concatenate(lengths[pair[1]])
        out["dpo_length_gap"] = {
            "mean": float(gap.mean()),
            "mean_abs": float(np.abs(gap).mean()),
            "chosen_longer_share": float((gap > 0).mean()),
        }
    if groups:
        sizes = np.concatenate(groups)
        out["grpo_group_size"] = {
            "min": int(sizes.min()),
            "mean": float(sizes.mean()),
            "max": int(sizes.max()),
        }
    if rewards:
        r = np.concatenate(rewards)
        out["grpo_rewards"] = {
            "mean": float(r.mean()),
            "std": float(r.std()),
            "min": float(r.min()),
            "max": float(r.max()),
        }
    fill = _packing_fill(manifest, out)
    if fill is not None:
        out["packing_fill"] = fill
    return out


def _percentiles(lens: np.ndarray) -> dict[str, Any]:
    if len(lens) == 0:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    values = np.percentile(lens, PERCENTILES, method="lower")
    return {
        **{f"p{p}": int(v) for p, v in zip(PERCENTILES, values, strict=True)},
        "max": int(lens.max()),
    }


def _packing_fill(manifest: dict | None, stats: dict) -> float | None:
    """Share of each packed row's budget holding tokens (1.0 = no padding needed)."""
    if not manifest or "sequence" not in stats["keys"]:
        return None
    pre = manifest.get("config", {}).get("preprocessing", {})
    if pre.get("packing_strategy", "none") == "none" or not stats["rows"]:
        return None
    return stats["keys"]["sequence"]["tokens"] / (stats["rows"] * pre["max_packed_len"])


def dataset_stats(root: str | Path) -> dict[str, Any]:
    """Statistics of every domain below root, plus the manifest's provenance."""
    root = Path(root)
    manifest = read_manifest(root)
    shards = find_shards(root)
    if not shards:
        raise FileNotFoundError(f"{root}: no shard (a folder with meta.json) below it")
    by_domain: dict[str, list[Path]] = {}
    for shard in shards:
        rel = shard.relative_to(root)
        by_domain.setdefault(rel.parent.as_posix() if rel.parent != Path(".") else "", []).append(
            shard
        )
    domains = {d: domain_stats(s, manifest) for d, s in by_domain.items()}
    total = sum(d["documents"] for d in domains.values())
    ledgers = ((manifest or {}).get("summary") or {}).get("domains", {})
    for name, d in domains.items():
        d["document_share"] = d["documents"] / total if total else 0.0
        if name in ledgers:
            d["ledger"] = ledgers[name]
    out: dict[str, Any] = {"path": str(root), "domains": domains}
    if manifest:
        out["provenance"] = {
            k: manifest.get(k)
            for k in (
                "tool",
                "fingerprint",
                "tokenizer_fingerprint",
                "config_fingerprint",
                "tokenizer_path",
            )
        }
        out["summary"] = manifest.get("summary")
        if out["summary"] and "tokens_read" in out["summary"]:
            out["ledger"] = Summary(**out["summary"]).ledger().as_dict()
    return out


def format_stats(stats: dict[str, Any]) -> str:
    lines = [f"dataset {stats['path']}"]
    for k, v in (stats.get("provenance") or {}).items():
        lines.append(f"  {k:<22} {v}")
    if "ledger" in stats:
        lines += ["", "ledger (every input token: read = written + dropped)"]
        lines += Ledger.from_dict(stats["ledger"]).format(indent="  ")
    for name, d in stats["domains"].items():
        lines.append("")
        lines.append(
            f"domain {name or '(root)'}: {d['documents']:,} documents in {d['rows']:,} rows, "
            f"{d['shards']} shard(s), {d['document_share']:.1%} of documents"
        )
        if "ledger" in d and len(stats["domains"]) > 1:
            lines += Ledger.from_dict(d["ledger"]).format(indent="  ")
        lines.append(
            f"  {'lengths':<16}{'dtype':<9}{'tokens':>14}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}{'trained':>9}"
        )
        if "document_length" in d:
            cells = "".join(f"{d['document_length'][p]:>8,}" for p in ("p50", "p90", "p99", "max"))
            lines.append(f"  {'documents':<16}{'':<9}{'':>14}{cells}")
        for key, row in d["keys"].items():
            share = f"{row['trained_share']:.1%}" if "trained_share" in row else ""
            cells = "".join(
                f"{row[p]:>8,}" if p in row else f"{'':>8}" for p in ("p50", "p90", "p99", "max")
            )
            label = f"{key} (rows)" if key == "sequence" and "document_length" in d else key
            lines.append(f"  {label:<16}{row['dtype']:<9}{row['tokens']:>14,}{cells}{share:>9}")
        for extra in ("trained_share", "packing_fill"):
            if extra in d:
                lines.append(f"  {extra:<22} {d[extra]:.1%}")
        for extra in ("dpo_length_gap", "grpo_group_size", "grpo_rewards"):
            if extra in d:
                lines.append(
                    f"  {extra:<22} " + ", ".join(f"{k}={v:.3g}" for k, v in d[extra].items())
                )
    return "\n".join(lines)


def plot_stats(root: str | Path, stats: dict[str, Any], path: str | Path) -> None:
    """Document and row length histograms per domain, and trained share per domain, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = Path(root)
    marks = positions_mark_documents(read_manifest(root))
    fig, (docs_ax, rows_ax, ax2) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name in stats["domains"]:
        folder = root / name if name else root
        documents = DocumentLengths(marks)
        counted = False  # documents of sequences; else each row is one
        rows = []
        for shard in find_shards(folder):
            if name == "" and shard.parent != root:
                continue
            meta = read_meta(shard)
            columns = map_shard(shard, meta)
            key = primary_key(list(meta))
            rows.append(_record_lengths(columns[key], meta[key]["shape"][0]))
            if "doc_lengths" in columns or "sequence" in columns:
                documents.add(columns, key)
                counted = True
        label = name or "(root)"
        if rows:
            row_lengths = np.concatenate(rows)
            docs = documents.lengths() if counted else row_lengths
            docs_ax.hist(docs, bins=50, alpha=0.6, label=label)
            rows_ax.hist(row_lengths, bins=50, alpha=0.6, label=label)
    docs_ax.set(
        title="document length (stored, after truncation)", xlabel="tokens", ylabel="documents"
    )
    rows_ax.set(title="row length (documents packed)", xlabel="tokens", ylabel="rows")
    docs_ax.legend()
    rows_ax.legend()
    names = list(stats["domains"])
    shares = [
        stats["domains"][n].get("trained_share", _mean_mask_share(stats["domains"][n]))
        for n in names
    ]
    ax2.bar([n or "(root)" for n in names], shares, color="tab:green")
    ax2.set(title="trained-token share per domain", ylim=(0, 1), ylabel="share of tokens trained")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean_mask_share(domain: dict) -> float:
    shares = [row["trained_share"] for row in domain["keys"].values() if "trained_share" in row]
    return float(np.mean(shares)) if shares else 1.0
