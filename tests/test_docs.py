"""Every command of the README and the docs runs as written, on the shipped data.

A fenced ```bash block is a promise: its commands run from the repository root of a fresh
clone once `tokenmill` is installed. This test runs them in that order (in a scratch folder
that sees the repository's data/ and examples/), checks each exit status, and checks the
ledger every `tokenmill preprocess` prints: tokens read = tokens written + tokens dropped.
Then a page's ```python recipe blocks run, as one script, in the same folder.
Placeholders live in ```text blocks, which are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # runs the CLI end to end

ALL_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands(page: Path) -> list[str]:
    """The commands of the page's ```bash blocks: continuations joined, comments dropped."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


def recipes(page: Path) -> str:
    """The page's ```python recipe blocks, as one script."""
    return "\n".join(re.findall(r"```python recipe\n(.*?)```", page.read_text(), re.S))


def number(text: str, name: str) -> int:
    match = re.search(rf"^{name} +([\d,]+)", text, re.M)
    assert match, f"no {name!r} line in:\n{text}"
    return int(match.group(1).replace(",", ""))


PAGES = [page for page in ALL_PAGES if commands(page)]


def test_the_readme_and_the_examples_page_have_commands_to_run():
    assert {ROOT / "README.md", ROOT / "docs" / "examples.md"} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_runs_as_written(page, tmp_path):
    found = commands(page)
    for name in ("data", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in found:
        argv = shlex.split(command)
        assert argv[0] == "tokenmill", f"{page.name}: not a tokenmill command: {command}"
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{page.name}: {command}\n{done.stdout}\n{done.stderr}"
        if argv[1] == "preprocess":
            out = done.stdout
            read, written = number(out, "tokens read"), number(out, "tokens written")
            assert read == written + number(out, "tokens dropped"), f"{command}\n{out}"
            assert number(out, "records read") > 0
    script = recipes(page)
    if script:  # after the commands, which write the data the recipes read
        (tmp_path / "recipes.py").write_text(script)
        done = subprocess.run(
            [sys.executable, "recipes.py"], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, f"{page.name} recipes:\n{done.stdout}\n{done.stderr[-6000:]}"
