"""What people expect of a command line: --version, --json for machines, colour only on a
terminal and never under NO_COLOR, and one `tokenmill: error: ...` line (exit 2, no traceback)
for every user error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers import DATA, QWEN

from tokenmill.tools.cli import main

TEXT = DATA / "pretrain_c4_300.jsonl"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow  # a Python subprocess
def test_version_is_the_installed_package_version():
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout == f"tokenmill {version('tokenmill')}\n"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small")
    src = root / "in.jsonl"
    src.write_text("".join(TEXT.read_text().splitlines(keepends=True)[:20]))
    return src


def test_preprocess_and_verify_print_one_json_object(capsys, small, tmp_path):
    out = tmp_path / "out"
    code, printed, _ = run(
        capsys, "preprocess", small, "-o", out, "--type", "seq", "--tokenizer", QWEN,
        "--workers", "1", "--json",
    )  # fmt: skip
    summary = json.loads(printed)
    manifest = json.loads((out / "manifest.json").read_text())
    assert code == 0 and summary == manifest["summary"] and summary["records_written"] == 20

    code, printed, _ = run(capsys, "verify", out, "--json")
    assert code == 0 and json.loads(printed) == {"dataset": str(out), "ok": True, "problems": []}
    (out / "shard_00000_000" / "sequence.bin").write_bytes(b"\0\0\0\0")
    code, printed, _ = run(capsys, "verify", out, "--json")
    report = json.loads(printed)
    assert code == 1 and not report["ok"] and "sequence.bin" in report["problems"][0]


@pytest.mark.parametrize(
    "tty, no_color, choice, colored",
    [
        (True, None, "auto", True),
        (False, None, "auto", False),
        (True, "1", "auto", False),
        (True, None, "never", False),
        (False, None, "always", True),  # asked for by name, for `| less -R`
        (True, "1", "always", False),  # NO_COLOR wins over everything
    ],
)
def test_colour_only_on_a_terminal_and_never_under_no_color(
    capsys, monkeypatch, tty, no_color, choice, colored
):
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    code, printed, _ = run(
        capsys, "show", DATA / "chat_sharegpt_1000.jsonl", "--type", "sft", "--tokenizer", QWEN,
        "--color", choice,
    )  # fmt: skip
    assert code == 0 and ("\033[" in printed) == colored
    assert ("[masked]" in printed) != colored


def user_errors(tmp: Path) -> dict[str, list]:
    """Each user error's command line, and a piece of the message it must print."""
    (tmp / "a_file").write_text("not a folder")
    (tmp / "empty_tok").mkdir(exist_ok=True)
    (tmp / "bad.yaml").write_text("input:\n  sections:\n    - field: text\n      acton: train\n")
    seq = ["--type", "seq", "--tokenizer", QWEN, "--workers", "1"]
    return {
        "output is a file": (["preprocess", TEXT, "-o", tmp / "a_file", *seq], "is a file"),
        "output below a file": (
            ["preprocess", TEXT, "-o", tmp / "a_file" / "out", *seq],
            "is a file",
        ),
        "unreachable URL": (
            ["preprocess", "http://127.0.0.1:9/x.jsonl", "-o", tmp / "o", *seq],
            "http://127.0.0.1:9/x.jsonl: cannot read",
        ),
        "missing tokenizer": (
            ["preprocess", TEXT, "-o", tmp / "o", "--type", "seq", "--tokenizer", tmp / "nope"],
            "tokenizer.json: not found",
        ),
        "tokenizer folder without a tokenizer": (
            [
                "preprocess",
                TEXT,
                "-o",
                tmp / "o",
                "--type",
                "seq",
                "--tokenizer",
                tmp / "empty_tok",
            ],
            "tokenizer.json: not found",
        ),
        "bad config": (
            ["preprocess", TEXT, "-o", tmp / "o", "-c", tmp / "bad.yaml", "--tokenizer", QWEN],
            "input.sections[0].acton: unknown field",
        ),
        "missing config": (
            ["preprocess", TEXT, "-o", tmp / "o", "-c", tmp / "nope.yaml", "--tokenizer", QWEN],
            "nope.yaml: No such file or directory",
        ),
        "missing input": (
            ["preprocess", tmp / "nope.jsonl", "-o", tmp / "o", *seq],
            "input not found",
        ),
        "unsupported input": (
            ["preprocess", tmp / "bad.yaml", "-o", tmp / "o", *seq],
            "unsupported",
        ),
        "missing dataset to export": (
            ["export", tmp / "nope", "--to", "hf", "-o", tmp / "hf"],
            "not a tokenmill dataset folder",
        ),
        "missing corpus to import": (
            ["import", tmp / "nope", "-o", tmp / "imported"],
            "nope.idx: not found",
        ),
        "import into a file": (["import", tmp / "nope", "-o", tmp / "a_file"], "is a file"),
        "missing dataset to inspect": (["inspect", tmp / "nope"], "no shard"),
    }


@pytest.mark.parametrize("case", list(user_errors(Path("/tmp"))))
def test_every_user_error_is_one_line_without_traceback(capsys, tmp_path, case):
    argv, message = user_errors(tmp_path)[case]
    code, printed, err = run(capsys, *argv)
    assert code == 2 and printed == ""
    assert err.startswith("tokenmill: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err


def test_the_console_command_prints_no_traceback(tmp_path):
    (tmp_path / "a_file").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill", "preprocess", str(TEXT), "-o", str(tmp_path / "a_file"),
         "--type", "seq", "--tokenizer", str(QWEN)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr == f"tokenmill: error: output {tmp_path / 'a_file'} is a file, not a folder\n"
    )


def test_an_hf_input_that_cannot_be_reached_is_one_line_and_exit_2(tmp_path):
    """The Hub unreachable (here: its endpoint a closed port on loopback) is one line naming the
    URL, exit 2, as the docs promise; it was a 36-frame traceback and exit 1."""
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill", "preprocess", "hf://datasets/org/name/x.jsonl"]
        + ["-o", str(tmp_path / "o"), "--type", "seq", "--tokenizer", str(QWEN)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenmill: error: "), done.stderr
    assert "hf://datasets/org/name/x.jsonl" in lines[0]
