"""RecordMasker: exact ids and masks per section rule, and every way a record is refused."""

import pytest
from helpers import ROOT

from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.inputs.records import RecordError
from tokenmill.preprocess.presets import default_config

TOK = ROOT / "data" / "tokenizers"
QWEN = load_tokenizer(TOK / "qwen2.5")
DEEPSEEK = load_tokenizer(TOK / "deepseek-v3")
IM_END, IM_START = 151645, 151644


def lists(out):
    return {
        k: v.tolist() if hasattr(v, "tolist") else [x.tolist() for x in v] for k, v in out.items()
    }


def test_instruction_golden_ids_and_mask():
    out = RecordMasker(default_config("instruction"), QWEN).process(
        {"prompt": "Add 2 and 3.", "response": "5"}
    )
    assert lists(out) == {
        "sequence": [2212, 220, 17, 323, 220, 18, 13, 20, IM_END],
        "loss_mask": [False] * 7 + [True, True],
        "position_ids": list(range(9)),
    }


def test_text_sections_get_one_masked_bos_where_the_tokenizer_has_one():
    out = RecordMasker(default_config("instruction"), DEEPSEEK).process(
        {"prompt": "Add 2 and 3.", "response": "5"}
    )
    seq, mask = out["sequence"].tolist(), out["loss_mask"].tolist()
    assert seq[0] == DEEPSEEK.bos_id and seq.count(DEEPSEEK.bos_id) == 1 and mask[0] is False
    assert seq[-1] == DEEPSEEK.eos_id and mask[-1] is True


def test_all_trained_text_has_no_loss_mask_key():
    out = RecordMasker(default_config("seq"), QWEN).process(
        {"text": "Hello world, this is a text that is long enough to pass min_chars."}
    )
    assert sorted(out) == ["position_ids", "sequence"]


def test_grpo_golden_prompt_responses_rewards():
    out = RecordMasker(default_config("grpo"), QWEN).process(
        {
            "prompt": [{"role": "user", "content": "Say hi."}],
            "responses": ["hi", "hello"],
            "rewards": [1, 0],
        }
    )
    got = lists(out)
    assert got["responses"] == [[6023, IM_END], [14990, IM_END]]
    assert got["masks"] == [[True, True], [True, True]]
    assert got["rewards"] == [1.0, 0.0] and out["rewards"].dtype.name == "float32"
    # the prompt is the full rendering with the generation prompt; it ends "<|im_start|>assistant\n"
    assert got["prompts"][-3:] == [IM_START, 77091, 198]
    assert (
        QWEN.tokenizer.decode(got["prompts"], skip_special_tokens=False).count("You are Qwen") == 1
    )


def test_dpo_masks_train_only_the_assistant_turn():
    chat = [{"role": "user", "content": "Pick a colour."}]
    out = RecordMasker(default_config("dpo"), QWEN).process(
        {
            "chosen": chat + [{"role": "assistant", "content": "Blue."}],
            "rejected": chat + [{"role": "assistant", "content": "No."}],
        }
    )
    for key in ("chosen", "rejected"):
        ids, mask = out[key].tolist(), out[f"{key}_mask"].tolist()
        trained = QWEN.tokenizer.decode(
            [i for i, m in zip(ids, mask) if m], skip_special_tokens=False
        )
        assert trained == ("Blue." if key == "chosen" else "No.") + "<|im_end|>\n"


def test_mask_config_changes_which_roles_train():
    cfg = default_config("sft").model_dump(mode="json")
    cfg["mask"] = {"user": "train", "assistant": "mask"}
    masker = RecordMasker(PipelineConfig.from_dict(cfg), QWEN)
    out = masker.process(
        {
            "messages": [
                {"role": "user", "content": "A question that is long enough?"},
                {"role": "assistant", "content": "An answer that is long enough."},
            ]
        }
    )
    ids, mask = out["sequence"].tolist(), out["loss_mask"].tolist()
    trained = QWEN.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert "A question that is long enough?" in trained and "An answer" not in trained


@pytest.mark.parametrize(
    "train_type, data, reason, field",
    [
        ("sft", {"messages": []}, "empty", "messages"),
        (
            "sft",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "only a question, nothing trains here, and it is long enough to pass",
                    }
                ]
            },
            "no_trained_tokens",
            "messages",
        ),
        (
            "sft",
            {"messages": [{"role": "bot", "content": "x" * 60}]},
            "unknown_role",
            "messages[0].role",
        ),
        (
            "dpo",
            {"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "missing_field",
            "rejected",
        ),
        (
            "grpo",
            {"prompt": [{"role": "user", "content": "q"}], "responses": [], "rewards": []},
            "empty",
            "responses",
        ),
        (
            "grpo",
            {"prompt": [{"role": "user", "content": "q"}], "responses": ["a"], "rewards": [1, 2]},
            "bad_value",
            "rewards",
        ),
        (
            "grpo",
            {"prompt": [{"role": "user", "content": "q"}], "responses": ["a"], "rewards": ["1"]},
            "wrong_type",
            "rewards[0]",
        ),
        ("seq", {"text": 7}, "wrong_type", "text"),
        ("seq", {"text": "short"}, "too_short", None),
    ],
)
def test_refused_records_name_reason_and_field(train_type, data, reason, field):
    with pytest.raises(RecordError) as err:
        RecordMasker(default_config(train_type), QWEN).process(data, "f.jsonl", 7)
    assert (err.value.reason, err.value.field) == (reason, field)
    assert str(err.value).startswith("f.jsonl:7: ")


def test_truncation_modes():
    base = default_config("seq").model_dump(mode="json")
    text = {"text": " ".join(str(i) for i in range(100))}
    for mode, expect_eos in (("keep_start", False), ("keep_end", True)):
        base["preprocessing"].update(max_seq_len=10, truncation_mode=mode)
        out = RecordMasker(PipelineConfig.from_dict(base), QWEN).process(text)
        assert len(out["sequence"]) == 10
        assert (int(out["sequence"][-1]) == IM_END) is expect_eos


def test_one_bos_per_record_whatever_the_sections_and_truncation():
    cfg = PipelineConfig.from_dict(
        {
            "input": {
                "sections": [
                    {"field": "system", "action": "mask"},
                    {"field": "messages", "template": True, "action": "$role"},
                ]
            },
            "preprocessing": {"min_chars": 0},
        }
    )
    data = {
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"},
        ],
    }
    seq = RecordMasker(cfg, DEEPSEEK).process(data)["sequence"].tolist()
    assert seq[0] == DEEPSEEK.bos_id and seq.count(DEEPSEEK.bos_id) == 1
    base = default_config("seq").model_dump(mode="json")
    base["preprocessing"].update(max_seq_len=8, truncation_mode="keep_end")
    out = RecordMasker(PipelineConfig.from_dict(base), DEEPSEEK).process({"text": "word " * 40})
    assert len(out["sequence"]) == 8 and out["sequence"].tolist()[0] == DEEPSEEK.bos_id
    assert out["sequence"].tolist().count(DEEPSEEK.bos_id) == 1


def test_a_filtered_record_counts_as_filtered_even_if_nothing_trains():
    with pytest.raises(RecordError) as err:
        RecordMasker(default_config("sft"), QWEN).process(
            {"messages": [{"role": "user", "content": "hi"}]}
        )
    assert err.value.reason == "too_short"
