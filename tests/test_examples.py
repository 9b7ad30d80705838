"""Every example of docs/examples.md runs and gives the summary the page shows."""

import re

import pytest
from helpers import ROOT

from tokenmill.preprocess.config import DEFAULT_CONFIGS, PipelineConfig
from tokenmill.preprocess.pipeline import Pipeline

ROOT = ROOT
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
    expected = {
        k: int(v.replace(",", ""))
        for k, v in re.findall(r"^(\w[\w ]*?) {2,}([\d,]+)", section, re.M)
    }
    got = {
        "records read": summary.records_read,
        "records written": summary.records_written,
        "rows": summary.rows,
        "tokens": summary.tokens,
        "trained tokens": summary.trained_tokens,
        "dropped tokens": summary.dropped_tokens,
        "records skipped": sum(summary.skipped.values()),
    }
    assert expected == got
