"""The demo, reduced: every type preprocessed, a tiny model trained, stopped, resumed, exactly once."""

import math

import pytest

from tokenmill.tools.demo import run_demo

pytestmark = pytest.mark.slow  # the whole demo


def test_demo_trains_stops_resumes_exactly_once(tmp_path):
    lines: list[str] = []
    result = run_demo(tmp_path, steps=120, stop_at=60, num_workers=2, log=lines.append)
    text = "\n".join(lines)
    for train_type in ("seq", "instruction", "sft", "dpo", "grpo"):
        assert f"== preprocess {train_type}" in text
    assert result["ok"] and result["same_as_uninterrupted"] and result["duplicates"] == 0
    assert result["last_loss"] < result["first_loss"]
    # whole prompt-and-response samples: every batch trains, and no loss is nan
    assert len(result["losses"]) == 120 and all(math.isfinite(x) for x in result["losses"])
    assert "exactly-once: PASSED" in text
    assert (tmp_path / "loader_state.json").exists()
