"""The tokenmill command on the shipped data: preprocess, inspect (checked independently), show, verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from tokenmill.tools.cli import main

ROOT = ROOT
DATA = ROOT / "data"
QWEN = DATA / "tokenizers" / "qwen2.5"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def head(src: Path, dst: Path, n: int) -> Path:
    lines = [x for x in src.read_text().split("\n") if x][:n]
    dst.write_text("\n".join(lines) + "\n")
    return dst


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    made = {}
    for t, name in (
        ("sft", "chat_sharegpt_1000.jsonl"),
        ("dpo", "dpo_en_300.jsonl"),
        ("grpo", "grpo_from_dpo_300.jsonl"),
    ):
        src = head(DATA / name, root / name, 30)
        out = root / t
        assert (
            main(
                [
                    "preprocess",
                    str(src),
                    "-o",
                    str(out),
                    "--type",
                    t,
                    "--tokenizer",
                    str(QWEN),
                    "--workers",
                    "1",
                    "--on-error",
                    "skip",
                ]
            )
            == 0
        )
        made[t] = out
    return made


def test_inspect_json_matches_independent_counts(capsys, datasets):
    code, out, _ = run(capsys, "inspect", datasets["sft"], "--json")
    assert code == 0
    stats = json.loads(out)
    shard = datasets["sft"] / "shard_00000_000"
    seq = np.fromfile(shard / "sequence.bin", dtype=np.int32)
    mask = np.fromfile(shard / "loss_mask.bin", dtype=np.bool_)
    offsets = np.fromfile(shard / "sequence.offsets.bin", dtype=np.int64)
    doc_lengths = np.fromfile(shard / "doc_lengths.bin", dtype=np.int32)
    d = stats["domains"][""]
    assert d["rows"] == len(offsets) - 1 and d["documents"] == len(doc_lengths) > d["rows"]
    assert d["document_length"]["max"] == int(doc_lengths.max())
    summary = json.loads((datasets["sft"] / "manifest.json").read_text())["summary"]
    assert stats["ledger"]["tokens_read"] == summary["tokens_read"]
    assert (
        stats["ledger"]["tokens_written"] + stats["ledger"]["dropped_tokens"]
        == summary["tokens_read"]
    )
    assert d["keys"]["sequence"]["tokens"] == len(seq)
    assert d["keys"]["sequence"]["max"] == int(np.diff(offsets).max())
    assert d["trained_share"] == pytest.approx(mask.sum() / len(mask))
    assert (
        stats["provenance"]["fingerprint"]
        == json.loads((datasets["sft"] / "manifest.json").read_text())["fingerprint"]
    )

    code, out, _ = run(capsys, "inspect", datasets["grpo"], "--json")
    g = json.loads(out)["domains"][""]
    raw = [
        json.loads(x)
        for x in (datasets["grpo"].parent / "grpo_from_dpo_300.jsonl").read_text().split("\n")
        if x
    ]
    rewards = np.array([r for rec in raw for r in rec["rewards"]])
    assert g["grpo_rewards"]["mean"] == pytest.approx(rewards.mean())
    assert g["grpo_group_size"] == {"min": 2, "mean": 2.0, "max": 2}
    code, out, _ = run(capsys, "inspect", datasets["dpo"])
    assert "dpo_length_gap" in out


@pytest.mark.slow  # imports matplotlib, renders a PNG
def test_inspect_plot_writes_a_png(capsys, datasets, tmp_path):
    png = tmp_path / "lengths.png"
    assert run(capsys, "inspect", datasets["sft"], "--plot", png)[0] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_marks_masked_tokens(capsys, datasets):
    code, out, _ = run(capsys, "show", datasets["dpo"], "--index", "0", "--tokenizer", QWEN)
    assert code == 0
    assert "[masked]<|im_start|>system" in out and "--- chosen:" in out and "--- rejected:" in out
    code, out, _ = run(
        capsys,
        "show",
        DATA / "chat_sharegpt_1000.jsonl",
        "--type",
        "sft",
        "--tokenizer",
        QWEN,
        "--index",
        "1",
        "--ids",
    )
    assert code == 0 and "[masked]" in out and "[151644" in out


def _copy(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


def test_verify_names_each_corruption(capsys, datasets, tmp_path):
    assert run(capsys, "verify", datasets["sft"])[0] == 0
    truncated = _copy(datasets["sft"], tmp_path / "truncated")
    path = truncated / "shard_00000_000" / "sequence.bin"
    path.write_bytes(path.read_bytes()[:-4])
    code, out, _ = run(capsys, "verify", truncated)
    assert code == 1 and "shard_00000_000" in out and "sequence.bin" in out

    flipped = _copy(datasets["sft"], tmp_path / "flipped")
    path = flipped / "shard_00000_000" / "loss_mask.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", flipped)
    assert code == 1 and "loss_mask" in out and "checksum" in out

    bad = _copy(datasets["dpo"], tmp_path / "offsets")
    path = bad / "shard_00000_000" / "chosen.offsets.bin"
    offsets = np.fromfile(path, dtype=np.int64)
    offsets[3] = 10**12
    offsets.tofile(path)
    code, out, _ = run(capsys, "verify", bad)
    assert code == 1 and "chosen" in out and "offsets" in out


def test_bad_config_exits_2_naming_the_field(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("input:\n  sections:\n    - field: text\n      acton: train\n")
    code, _, err = run(
        capsys,
        "preprocess",
        DATA / "pretrain_c4_300.jsonl",
        "-o",
        tmp_path / "o",
        "-c",
        cfg,
        "--tokenizer",
        QWEN,
    )
    assert code == 2 and "input.sections[0].acton: unknown field" in err


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "preprocess" in out.stdout and "inspect" in out.stdout


def test_a_run_that_drops_every_record_exits_non_zero(capsys, tmp_path):
    """Issue 16: an all-rejected run used to exit 0 with a dataset verify rejects."""
    src = tmp_path / "short.jsonl"
    src.write_text('{"text": "too short"}\n{"text": "also short"}\n')
    out = tmp_path / "out"
    code, printed, err = run(
        capsys,
        "preprocess",
        src,
        "-o",
        out,
        "--type",
        "seq",
        "--tokenizer",
        ROOT / "data/tokenizers/qwen2.5",
    )
    assert code == 1 and "records skipped             2  (too_short: 2)" in printed
    assert f"no record written: all 2 dropped; see {out / 'rejects.jsonl'}" in err
    code, printed, _ = run(capsys, "verify", out)
    assert code == 1 and "the run wrote no record" in printed
