"""The formats users have, rendered exactly: ShareGPT and OpenAI tool calls, TRL preference
data, template keyword arguments. Oracle: transformers' apply_chat_template with the same
messages, tools and keyword arguments; masks train the assistant's turns (tool calls
included) and never a tool result or its closing markup."""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import DATA, TOKENIZERS

from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.chat.training_templates import FOLDER as TEMPLATES_DIR
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.inputs.fields import check_messages
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.presets import default_config

FAMILIES = ["qwen2.5", "qwen3", "deepseek-v3"]


@pytest.fixture(scope="module")
def oracles():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    return {f: transformers.AutoTokenizer.from_pretrained(str(TOKENIZERS / f)) for f in FAMILIES}


def oracle_ids(oracle, messages, **kwargs) -> list[int]:
    out = oracle.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def chat_config(field: str = "messages", **section) -> PipelineConfig:
    data = default_config("sft").model_dump(mode="json")
    data["input"]["sections"][0].update(field=field, **section)
    data["preprocessing"].update(max_seq_len=100_000, min_chars=0)
    return PipelineConfig.from_dict(data)


def trained_runs(bundle, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [
        bundle.tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        for a, b in edges.reshape(-1, 2)
    ]


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_sharegpt_tool_calls_match_transformers_and_train_only_the_assistant(family, oracles):
    """LLaMA-Factory's ShareGPT tool data (function_call / observation, tools as JSON text)."""
    bundle = load_tokenizer(TOKENIZERS / family)
    masker = RecordMasker(chat_config("conversations"), bundle)
    records = json.loads((DATA / "toolcall_glaive_zh_300.json").read_text())[:40]
    calls = 0
    for n, data in enumerate(records):
        record = Record("toolcall_glaive_zh_300.json", n + 1, data)
        out = masker.process(record)
        messages = check_messages(record, "conversations", data["conversations"], None)
        tools = json.loads(data["tools"]) if data.get("tools") else None
        assert out["sequence"].tolist() == oracle_ids(oracles[family], messages, tools=tools), n
        for run in trained_runs(bundle, out["sequence"], out["loss_mask"]):
            assert run.endswith("<|im_end|>\n") and "<|im_start|>" not in run, run
            assert "tool_response" not in run
            calls += "<tool_call>" in run
    assert calls >= 10


def openai_record(family: str) -> dict:
    """An OpenAI-style chat: text parts, a null content beside two tool calls, two results."""
    args = '{"city": "Paris"}'
    return {
        "messages": [
            {"role": "system", "content": "You answer with tools."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Weather in Paris "},
                    {"type": "text", "text": "and Rome?"},
                ],
            },
            # DeepSeek-V3's template reads a tool call's content, so there it is "" (not null)
            {
                "role": "assistant",
                "content": "" if family == "deepseek-v3" else None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": args}},
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    },
                ],
            },
            {"role": "tool", "content": "22 C, sunny", "name": "get_weather"},
            {"role": "tool", "content": "25 C, clear", "name": "get_weather"},
            {"role": "assistant", "content": "Paris: 22 C and sunny. Rome: 25 C and clear."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather now",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_tool_calls_and_results_are_exact_and_results_stay_masked(family, oracles):
    bundle = load_tokenizer(TOKENIZERS / family)
    data = openai_record(family)
    record = Record("chat.jsonl", 1, data)
    messages = check_messages(record, "messages", data["messages"], None)
    assert messages[1]["content"] == "Weather in Paris and Rome?"  # text parts joined
    template = None
    if family == "deepseek-v3":  # its own template renders no call beside a content: refused
        with pytest.raises(RecordError, match=r"chat\.jsonl:1: .*tool_calls\[0\]\.name does not"):
            RecordMasker(chat_config(), bundle).process(record)
        template = (TEMPLATES_DIR / "deepseek_v3_tools.jinja").read_text()
    config = chat_config().model_dump(mode="json")
    config["chat_template"] = "deepseek-v3-tools" if template else None
    out = RecordMasker(PipelineConfig.from_dict(config), bundle).process(record)
    want = oracle_ids(oracles[family], messages, tools=data["tools"], chat_template=template)
    assert out["sequence"].tolist() == want
    trained = "".join(trained_runs(bundle, out["sequence"], out["loss_mask"]))
    masked = bundle.tokenizer.decode(
        out["sequence"][~out["loss_mask"]].tolist(), skip_special_tokens=False
    )
    assert "Paris: 22 C and sunny." in trained  # the answer
    assert trained.count("get_weather") == 2  # the tool calls train with the assistant turn
    assert "22 C, sunny" in masked and "22 C, sunny" not in trained
    closing = {"deepseek-v3": "<｜tool▁outputs▁end｜>"}.get(family, "</tool_response><|im_end|>")
    assert closing in masked and closing not in trained


def test_trl_preference_formats_render_the_prompt_and_each_reply_as_one_conversation(oracles):
    """Explicit prompt (TRL), implicit prompt, and a reply that repeats its prompt: the same
    conversation, the prompt byte-identical between chosen and rejected, only the reply trained."""
    bundle, oracle = load_tokenizer(TOKENIZERS / "qwen2.5"), oracles["qwen2.5"]
    masker = RecordMasker(default_config("dpo"), bundle)
    prompt = [{"role": "user", "content": "Name a prime number."}]
    chosen, rejected = (
        [{"role": "assistant", "content": "7"}],
        [{"role": "assistant", "content": "8"}],
    )
    forms = [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected},
        {"chosen": prompt + chosen, "rejected": prompt + rejected},
        {"prompt": prompt, "chosen": prompt + chosen, "rejected": prompt + rejected},
    ]
    outs = [masker.process(form) for form in forms]
    want = oracle_ids(oracle, prompt + chosen)
    assert want.count(bundle.tokenizer.token_to_id("<|im_start|>")) == 3  # one system prompt
    for out in outs:
        assert out["chosen"].tolist() == want
        assert out["rejected"].tolist() == oracle_ids(oracle, prompt + rejected)
        shared = len(oracle_ids(oracle, prompt, add_generation_prompt=True))
        assert out["chosen"][:shared].tolist() == out["rejected"][:shared].tolist()
        assert trained_runs(bundle, out["chosen"], out["chosen_mask"]) == ["7<|im_end|>\n"]


def test_template_keyword_arguments_reach_the_template(oracles):
    bundle = load_tokenizer(TOKENIZERS / "qwen3")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for kwargs in ({"enable_thinking": False}, {}):
        out = RecordMasker(chat_config(template_kwargs=kwargs), bundle).process(
            {"messages": messages}
        )
        assert out["sequence"].tolist() == oracle_ids(oracles["qwen3"], messages, **kwargs)


@pytest.mark.parametrize(
    "data, where",
    [
        ({"messages": [{"from": "robot", "value": "x"}]}, "messages[0].from: expected one of"),
        ({"messages": [{"from": "human"}]}, "messages[0].value: missing field"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": "f()"}]},
            "messages[0].tool_calls: expected a list",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]: expected a text part",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": "{not json"},
            "tools: not valid JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [1]},
            "tools: expected a list of tool schemas",
        ),
        (
            {"messages": [{"from": "function_call", "value": "[]"}]},
            "messages[0].value: expected a function call",
        ),
    ],
)
def test_a_bad_record_in_any_format_names_file_line_and_field(data, where):
    masker = RecordMasker(chat_config(), load_tokenizer(TOKENIZERS / "qwen2.5"))
    with pytest.raises(RecordError, match="^" + re.escape(f"in.jsonl:7: {where}")):
        masker.process(Record("in.jsonl", 7, data))


def test_trl_standard_preference_formats_tokenize_as_trl_does():
    """Text preference data: the prompt (explicit, or the shared start of the replies) masked,
    each reply trained and closed with EOS; a BOS where the tokenizer adds one."""
    for family in ("qwen2.5", "deepseek-v3"):
        bundle = load_tokenizer(TOKENIZERS / family)
        masker = RecordMasker(default_config("dpo"), bundle)
        explicit = masker.process(
            {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
        )
        implicit = masker.process({"chosen": "The sky is blue.", "rejected": "The sky is green."})
        for out in (explicit, implicit):
            for side, reply in (("chosen", " blue."), ("rejected", " green.")):
                ids, mask = out[side], out[f"{side}_mask"]
                assert bundle.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False) == (
                    reply + bundle.tokenizer.id_to_token(bundle.eos_id)
                )
                assert (
                    bundle.tokenizer.decode(ids[~mask].tolist(), skip_special_tokens=True)
                    == "The sky is"
                )
            assert (out["chosen"][0] == bundle.bos_id) == bundle.add_bos_token


def test_an_implicit_conversational_prompt_trains_only_the_final_reply(oracles):
    bundle, oracle = load_tokenizer(TOKENIZERS / "qwen2.5"), oracles["qwen2.5"]
    shared = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a prime."},
    ]
    record = {
        "chosen": shared + [{"role": "assistant", "content": "7"}],
        "rejected": shared + [{"role": "assistant", "content": "8"}],
    }
    out = RecordMasker(default_config("dpo"), bundle).process(record)
    assert out["chosen"].tolist() == oracle_ids(oracle, record["chosen"])
    assert trained_runs(bundle, out["chosen"], out["chosen_mask"]) == ["7<|im_end|>\n"]


def test_grpo_prompt_only_data_gives_prompts_for_online_generation(tmp_path, oracles):
    from tokenmill.preprocess.run.pipeline import Pipeline
    from tokenmill.training.dataset_factory import DatasetFactory

    prompts = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(5)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    qwen = TOKENIZERS / "qwen2.5"
    summary = Pipeline(
        default_config("grpo"), [tmp_path / "in.jsonl"], tmp_path / "out", qwen, workers=1
    ).run()
    assert summary.records_written == 5 and summary.ledger().unbalanced() == []
    ds = DatasetFactory.load("grpo", tmp_path / "out", window_size=2048)
    for i, prompt in enumerate(prompts):
        item = ds[i]
        assert list(item) == ["prompts"]
        want = oracle_ids(oracles["qwen2.5"], prompt, add_generation_prompt=True)
        assert item["prompts"].tolist() == want


def test_the_lazy_dpo_route_keeps_the_explicit_prompt(tmp_path, oracles):
    from tokenmill.training.dataset_factory import DatasetFactory

    prompt = [{"role": "user", "content": "Name a prime number."}]
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "7"}],
        "rejected": [{"role": "assistant", "content": "8"}],
    }
    (tmp_path / "pairs.jsonl").write_text(json.dumps(record) + "\n")
    ds = DatasetFactory.load(
        "dpo", tmp_path / "pairs.jsonl", window_size=2048, tokenizer_path=TOKENIZERS / "qwen2.5"
    )
    assert type(ds.store).__name__ == "JsonlStore" and ds.store.lazy
    want = oracle_ids(oracles["qwen2.5"], prompt + record["chosen"])
    assert ds[0]["chosen"].tolist() == want


GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_generation_blocks_mark_what_trains_as_transformers_reads_them(tmp_path):
    """`train_spans: generation`: exactly the template's {% generation %} blocks train, as
    transformers' return_assistant_tokens_mask gives them."""
    import shutil

    import transformers

    shutil.copy(TOKENIZERS / "qwen2.5" / "tokenizer.json", tmp_path)
    config = json.loads((TOKENIZERS / "qwen2.5" / "tokenizer_config.json").read_text())
    config["chat_template"] = GENERATION_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    masker = RecordMasker(chat_config(train_spans="generation"), load_tokenizer(tmp_path))
    with open(DATA / "chat_sharegpt_1000.jsonl", encoding="utf-8") as f:
        chats = [json.loads(next(f))["messages"] for _ in range(20)]
    wants = []
    for messages in chats:
        out = masker.process({"messages": messages})
        want = oracle.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert out["sequence"].tolist() == list(want["input_ids"])
        assert out["loss_mask"].astype(int).tolist() == list(want["assistant_masks"])
        wants.append(out["loss_mask"].tolist())
    # as a run's threads do: two maskers rendering at once, each tracking its own blocks (the
    # GIL switched often, so that renderings interleave)
    config, bundle = chat_config(train_spans="generation"), load_tokenizer(tmp_path)
    maskers = [RecordMasker(config, bundle), RecordMasker(config, bundle)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(2) as threads:
            got = threads.map(
                lambda j: maskers[j % 2].process({"messages": chats[j % 20]})["loss_mask"].tolist(),
                range(200),
            )
            assert list(got) == wants * 10
    finally:
        sys.setswitchinterval(switch)
    with pytest.raises(ValueError, match="no {% generation %} blocks"):
        RecordMasker(chat_config(train_spans="generation"), load_tokenizer(TOKENIZERS / "qwen2.5"))


def test_kto_unpaired_preferences_load_with_their_labels(tmp_path, oracles):
    from tokenmill.preprocess.run.pipeline import Pipeline
    from tokenmill.training.dataset_factory import DatasetFactory

    prompt = [{"role": "user", "content": "Name a prime number."}]
    records = [
        {"prompt": prompt, "completion": [{"role": "assistant", "content": "7"}], "label": True},
        {"prompt": prompt, "completion": [{"role": "assistant", "content": "8"}], "label": False},
        {"prompt": "The sky is", "completion": " blue.", "label": True},  # standard (text) format
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    qwen = TOKENIZERS / "qwen2.5"
    Pipeline(
        default_config("kto"), [tmp_path / "in.jsonl"], tmp_path / "out", qwen, workers=1
    ).run()
    ds = DatasetFactory.load("kto", tmp_path / "out", window_size=2048)
    assert [float(ds[i]["label"]) for i in range(3)] == [1.0, 0.0, 1.0]
    bundle = load_tokenizer(qwen)
    for i in range(2):
        item = ds[i]
        assert item["completion"].tolist() == oracle_ids(
            oracles["qwen2.5"], prompt + records[i]["completion"]
        )
        reply = records[i]["completion"][0]["content"]
        assert trained_runs(
            bundle, item["completion"].numpy(), item["completion_mask"].numpy()
        ) == [f"{reply}<|im_end|>\n"]
    text = ds[2]
    assert bundle.tokenizer.decode(text["completion"][text["completion_mask"]].tolist()) == " blue."


def test_a_truncated_preference_pair_keeps_one_prompt_for_both_replies():
    """Over max_seq_len, chosen and rejected drop the same oldest turns of their shared
    prompt (as many as the longer one needs), so the prompt stays byte-identical."""
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    data = default_config("dpo").model_dump(mode="json")
    data["preprocessing"]["max_seq_len"] = 80
    masker = RecordMasker(PipelineConfig.from_dict(data), bundle)
    words = lambda n: " ".join(["word"] * n)  # noqa: E731
    prompt = [
        {"role": "user", "content": words(10)},
        {"role": "assistant", "content": words(5)},
        {"role": "user", "content": "question " + words(8)},
    ]
    record = {
        "chosen": prompt + [{"role": "assistant", "content": words(30)}],
        "rejected": prompt + [{"role": "assistant", "content": "no"}],
    }
    out, tally = masker.process_counted(Record("pairs.jsonl", 1, record))
    prompts = []
    for side in ("chosen", "rejected"):
        ids, mask = out[side], out[f"{side}_mask"]
        assert len(ids) <= 80 and mask.any()
        prompts.append(ids[: int(np.flatnonzero(mask)[0])].tolist())
    assert prompts[0] == prompts[1]
    assert "question" in bundle.tokenizer.decode(prompts[0]) and words(
        10
    ) not in bundle.tokenizer.decode(prompts[0])
    assert tally.truncated > 0


@pytest.mark.parametrize("ending", ["tool", "answer", "user"])
def test_qwen3_reasoning_beside_tool_calls_keeps_results_masked(ending, oracles):
    """Qwen3 renders reasoning only after the last user turn: the spans still keep every
    tool call with its assistant turn and every tool result masked."""
    bundle = load_tokenizer(TOKENIZERS / "qwen3")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [call],
        },
        {"role": "tool", "content": "22 C"},
    ]
    if ending != "tool":
        messages.append({"role": "assistant", "content": "22 C.", "reasoning_content": "done"})
    if ending == "user":
        messages += [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": "np"}]
    if ending == "user":  # Qwen3's own template drops reasoning before the last user query
        with pytest.raises(RecordError, match=r"messages\[1\].*its reasoning does not appear"):
            RecordMasker(chat_config(), bundle).process({"messages": messages})
        config = chat_config().model_dump(mode="json") | {"chat_template": "qwen3-keep-reasoning"}
        masker = RecordMasker(PipelineConfig.from_dict(config), bundle)
        out = masker.process({"messages": messages})
        template = (TEMPLATES_DIR / "qwen3_keep_reasoning.jinja").read_text()
        want = oracle_ids(oracles["qwen3"], messages, chat_template=template)
        assert out["sequence"].tolist() == want
    else:
        out = RecordMasker(chat_config(), bundle).process({"messages": messages})
        assert out["sequence"].tolist() == oracle_ids(oracles["qwen3"], messages)
    runs = trained_runs(bundle, out["sequence"], out["loss_mask"])
    assert all(r.endswith("<|im_end|>\n") and "<|im_start|>" not in r for r in runs)
    assert not any("tool_response" in r for r in runs)
    assert any("<tool_call>" in r for r in runs)
    assert len(runs) == {"tool": 1, "answer": 2, "user": 3}[ending]


def test_an_implicit_text_prompt_is_cut_where_trl_cuts_it():
    bundle = load_tokenizer(TOKENIZERS / "qwen2.5")
    masker = RecordMasker(default_config("dpo"), bundle)
    for chosen, rejected, reply in [
        ("What color is the sky?\nBlue.", "What color is the sky?\nGreen.", "Blue."),
        ("天空是蓝色的。", "天空是绿色的。", "蓝色的。"),
    ]:
        out = masker.process({"chosen": chosen, "rejected": rejected})
        trained = out["chosen"][out["chosen_mask"]].tolist()
        assert bundle.tokenizer.decode(trained) == reply


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_a_tool_chat_opening_with_a_call_keeps_the_preamble_masked(family, oracles):
    """The default system prompt and the tools block before the first message never train."""
    bundle = load_tokenizer(TOKENIZERS / family)
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "22 C"},
        {"role": "assistant", "content": "22 C."},
    ]
    out = RecordMasker(chat_config(), bundle).process({"messages": messages, "tools": tools})
    assert out["sequence"].tolist() == oracle_ids(oracles[family], messages, tools=tools)
    runs = trained_runs(bundle, out["sequence"], out["loss_mask"])
    assert len(runs) == 2 and not any("<|im_start|>" in r for r in runs)
