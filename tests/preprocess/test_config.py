"""PipelineConfig: every documented field and default, strict errors with dotted paths."""

import json

import pytest
from helpers import ROOT

from tokenmill.preprocess.config import ConfigError, PipelineConfig
from tokenmill.preprocess.presets import DEFAULT_CONFIGS, default_config

SFT = {"input": {"sections": [{"field": "messages", "template": True, "action": "$role"}]}}


def test_defaults_match_system_md():
    c = PipelineConfig.from_dict(SFT)
    assert c.version == 1
    assert c.mask_default == "mask"
    p = c.preprocessing
    assert (p.max_seq_len, p.min_chars, p.max_chars, p.max_items, p.batch_size) == (
        2048,
        50,
        2_000_000,
        None,
        256,
    )
    assert (p.packing_strategy, p.max_packed_len, p.truncation_mode) == ("simple", 8192, "auto")
    o = c.output
    assert (o.domain_key, o.storage_format, o.max_tokens_per_shard) == (None, "bin", 100_000_000)
    assert (o.dtype, o.position_ids_mode) == ({}, "doc_reset")
    s = c.input.sections[0]
    assert (s.field, s.action, s.template, s.add_special_tokens) == (
        "messages",
        "$role",
        True,
        None,
    )


def test_every_field_round_trips_from_json_and_yaml(tmp_path):
    full = {
        "version": 1,
        "input": {
            "sources": {
                "prompts": {
                    "sections": [
                        {
                            "field": "prompt",
                            "template": True,
                            "action": "mask",
                            "generation_prompt": True,
                        }
                    ]
                },
                "responses": {
                    "sections": [
                        {
                            "field": "responses",
                            "action": "train",
                            "eos": True,
                            "add_special_tokens": False,
                        }
                    ],
                    "list_field": True,
                    "mask_key": "masks",
                },
                "rewards": {"sections": [{"field": "rewards", "action": "value"}]},
            }
        },
        "mask": {"user": "mask", "assistant": "train", "tool": "train"},
        "mask_default": "train",
        "preprocessing": {
            "max_seq_len": 16,
            "min_chars": 0,
            "max_chars": 99,
            "max_items": 3,
            "batch_size": 4,
            "task_bytes": 1_000_000,
            "packing_strategy": "bfd_split",
            "max_packed_len": 32,
            "truncation_mode": "keep_end",
            "map": "mypkg.clean:fix",
            "filter": "mypkg.clean:keep",
            "validation": {"fraction": 0.1, "by": "record", "seed": 7, "root": "data"},
            "dedup": "exact",
        },
        "output": {
            "domain_key": "lang",
            "storage_format": "jsonl",
            "max_tokens_per_shard": 1000,
            "dtype": {"responses": "uint32"},
            "position_ids_mode": "continuous",
        },
    }
    (tmp_path / "c.json").write_text(json.dumps(full))
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(full))
    a = PipelineConfig.from_file(tmp_path / "c.json")
    b = PipelineConfig.from_file(tmp_path / "c.yaml")
    assert a == b
    assert a.model_dump(mode="json")["preprocessing"] == full["preprocessing"]
    assert a.fingerprint() == b.fingerprint()
    assert a.multi_output and a.role_trains("tool") and a.role_trains("unlisted")


@pytest.mark.parametrize(
    "patch, expected",
    [
        (
            {"input": {"sections": [{"field": "t", "acton": "train"}]}},
            "input.sections[0].acton: unknown field",
        ),
        (
            {"input": {"sections": [{"field": "t", "action": "trian"}]}},
            "input.sections[0].action: Input should be 'train', 'mask', '$role' or 'value'",
        ),
        (
            {"preprocessing": {"packing_strategy": "fast"}},
            "preprocessing.packing_strategy: Input should be 'none', 'simple', 'bfd', 'bfd_split' or 'stream'",
        ),
        (
            {"preprocessing": {"truncation_mode": "middle"}},
            "preprocessing.truncation_mode: Input should be 'auto', 'none', 'latest_turns', 'cut_prompt', 'keep_start' or 'keep_end'",
        ),
        (
            {"output": {"storage_format": "arrow"}},
            "output.storage_format: Input should be 'bin' or 'jsonl'",
        ),
        (
            {"output": {"position_ids_mode": "reset"}},
            "output.position_ids_mode: Input should be 'none', 'doc_reset' or 'continuous'",
        ),
        ({"output": {"dtype": {"sequence": "int33"}}}, "output.dtype.sequence: Input should be"),
        ({"mask": {"assistant": "yes"}}, "mask.assistant: Input should be 'train' or 'mask'"),
        ({"version": 2}, "version: Input should be 1"),
        (
            {"preprocessing": {"max_seq_len": 0}},
            "preprocessing.max_seq_len: Input should be greater than 0",
        ),
        ({"outptu": {}}, "outptu: unknown field"),
        (
            {"input": {"sections": [{"field": "t", "action": "$role"}]}},
            'input.sections[0]: action "$role" needs template: true',
        ),
        ({"input": {"sections": []}}, "input: give input.sections"),
    ],
)
def test_bad_values_name_the_dotted_path_and_choices(patch, expected):
    data = {**SFT, **patch}
    with pytest.raises(ConfigError) as err:
        PipelineConfig.from_dict(data, origin="c.yaml")
    assert f"c.yaml: {expected}" in str(err.value)


def test_bad_file_syntax_names_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="c.json: not valid json"):
        PipelineConfig.from_file(path)


def test_default_configs_all_validate():
    for name in DEFAULT_CONFIGS:
        assert default_config(name).version == 1
    with pytest.raises(ValueError, match="valid: "):
        default_config("ppo")


def test_docs_config_reference_is_generated_from_the_model():

    from tokenmill.preprocess.config import config_reference

    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc.endswith(config_reference()), (
        "docs/config.md is stale: regenerate it from config_reference()"
    )
    for name in ("max_seq_len", "packing_strategy", "position_ids_mode", "list_field", "mask_key"):
        assert f".{name}`" in doc
