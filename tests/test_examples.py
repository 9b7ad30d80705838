"""Every example of docs/examples.md runs and prints the summary (and ledger) the page shows."""

import re

import pytest
from helpers import ROOT

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import DEFAULT_CONFIGS
from tokenmill.preprocess.run.pipeline import Pipeline

PAGE = (ROOT / "docs" / "examples.md").read_text()


@pytest.mark.parametrize("train_type", list(DEFAULT_CONFIGS))
def test_example_runs_as_documented(tmp_path, train_type):
    folder = ROOT / "examples" / train_type
    config = PipelineConfig.from_file(folder / "config.yaml")
    assert config == PipelineConfig.from_dict(DEFAULT_CONFIGS[train_type])
    summary = Pipeline(
        config,
        [folder / "records.jsonl"],
        tmp_path / "out",
        ROOT / "data" / "tokenizers" / "qwen2.5",
        workers=1,
    ).run()
    section = PAGE.split(f"## {train_type}\n")[1].split("\n## ")[0]
    pattern = r"^(\w[\w ]*?) {2,}([\d,]+)"
    expected = dict(re.findall(pattern, section, re.M))
    printed = dict(re.findall(pattern, summary.format(), re.M))
    assert {"tokens read", "tokens written", "tokens dropped"} <= set(expected)  # the ledger
    assert expected == {k: printed.get(k) for k in expected}
    assert summary.ledger().unbalanced() == []
