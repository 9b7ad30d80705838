"""The house's tooling agrees with itself: the pre-commit hooks run exactly the Makefile's
lint commands (`make lint`, which CI runs through `make test`), in the same order."""

from __future__ import annotations

import re

import yaml
from helpers import ROOT


def make_variables(text: str) -> dict[str, str]:
    """The Makefile's simple assignments (`A ?= x`, `A := x`, `A = x`)."""
    found = {}
    for name, value in re.findall(r"^(\w+)\s*(?:\?=|:=|=)\s*(.*?)\s*$", text, re.M):
        found.setdefault(name, value)
    return found


def expand(command: str, variables: dict[str, str]) -> str:
    """$(NAME) replaced by its value, until none is left."""
    while True:
        done = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], command)
        if done == command:
            return " ".join(done.split())
        command = done


def lint_recipe(text: str) -> list[str]:
    """The commands of a Makefile's `lint:` target, variables expanded."""
    match = re.search(r"^lint:[^\n]*\n((?:\t[^\n]*\n?)+)", text, re.M)
    assert match, "no lint target in the Makefile"
    variables = make_variables(text)
    return [expand(line.strip(), variables) for line in match.group(1).splitlines()]


def hook_commands() -> list[dict]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return [hook for repo in config["repos"] for hook in repo["hooks"]]


def test_pre_commit_runs_the_makefiles_lint_commands():
    hooks = hook_commands()
    commands = [" ".join([hook["entry"], *hook.get("args", [])]).strip() for hook in hooks]
    assert commands == lint_recipe((ROOT / "Makefile").read_text())


def test_pre_commit_hooks_use_the_projects_own_tools_on_the_whole_tree():
    """No download (the pinned versions in .venv) and no file list: a hook checks what the
    Makefile checks, not just the staged files."""
    for hook in hook_commands():
        assert hook["language"] == "system", hook["id"]
        assert hook["pass_filenames"] is False, hook["id"]
        assert hook["entry"].startswith(".venv/bin/"), hook["id"]


def test_the_recipe_is_read_as_make_would():
    text = "VENV ?= .venv\nPY := $(VENV)/bin/python\n\nlint: x\n\t$(PY) -m a  b\n\t$(VENV)/bin/c\n\nnext:\n"
    assert lint_recipe(text) == [".venv/bin/python -m a b", ".venv/bin/c"]
