"""Hostile chat templates (issue 39): every operation that can spend time or memory without
bound is refused by its budget before it spends it, and ends as a counted template_error,
never a hang, never a MemoryError traceback. No test here reads a clock: each asserts the
error raised (what stopped it) and the memory the rendering took (tracemalloc)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tracemalloc

import pytest
from helpers import ROOT

from tokenmill.preprocess.chat import template as chat_template
from tokenmill.preprocess.chat.template import TemplateBudget, TemplateRunBudget, render_text
from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.engines.chunks import prerender
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.presets import default_config

QWEN = ROOT / "data" / "tokenizers" / "qwen2.5"
NS = "{% set ns = namespace(x=3, s='ab', l=[1]) %}"

# name -> (template, what the error says): each one of issue 39's repros, and more
HOSTILE = {
    "big_power": ("{{ (10 ** 100000000) > 1 }}", "10 ** 100000000 computes an integer"),
    "power_huge_exponent": ("{{ 7 ** 1000000000000 > 1 }}", "computes an integer"),
    "repeated_squaring": (
        NS + "{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 1 }}",
        "'*' computes an integer",
    ),
    "wordwrap_of_many_words": ("{{ ('a ' * 30000000)|wordwrap(1) }}", "the filter wordwrap"),
    "string_doubling_plus": (
        NS + "{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
        "'+' would build",
    ),
    "string_doubling_tilde": (
        NS + "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "'~' would build",
    ),
    "list_doubling": (
        NS + "{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
        "'+' would build",
    ),
    "doubling_by_recursion": (
        "{% macro d(s, n) %}{{ d(s ~ s, n + 1) if n < 60 else s|length }}{% endmacro %}"
        "{{ d('ab', 0) }}",
        "'~' would build",
    ),
    "string_times_huge": ("{{ 'a' * 10**10 }}", "'*' would build"),
    "center_filter": ("{{ 'a'|center(10**10) }}", "the filter center"),
    "center_filter_literal": ("{{ 'a'|center(10000000000) }}", "the filter center"),
    "indent_filter": ("{{ 'a\nb'|indent(10**9) }}", "the filter indent"),
    "center_method": ("{{ 'a'.center(10**10) }}", "str.center"),
    "ljust_method": ("{{ 'a'.ljust(10**10) }}", "str.ljust"),
    "zfill_method": ("{{ 'a'.zfill(10**10) }}", "str.zfill"),
    "expandtabs_method": ("{{ ('\t' * 1000).expandtabs(10**7) }}", "str.expandtabs"),
    "percent_width": ("{{ '%1000000000d' % 1 }}", "'%' would build"),
    "percent_star": ("{{ '%*d' % (10**9, 1) }}", "'%' would build"),
    "format_width": ("{{ '{:>10000000000}'.format(1) }}", "str.format"),
    "format_nested_width": ("{{ '{:>{w}}'.format(1, w=10**10) }}", "str.format"),
    "format_filter": ("{{ '%1000000000s'|format('x') }}", "the filter format"),
    "join_of_references": ("{{ (['a' * 1000000] * 1000)|join(',') }}", "the filter join"),
    "join_method": ("{{ ','.join(['a' * 1000000] * 1000) }}", "str.join"),
    "replace_empty": (
        "{{ ('a' * 1000000)|replace('', 'b' * 100) }}",
        "'*' would build",  # 'b' * 100 is fine; the replace is not
    ),
    "replace_method": ("{{ ('a' * 1000000).replace('', 'b' * 100) }}", "str.replace"),
    "batch_fill": ("{{ [1]|batch(10**9, 'x')|list|length }}", "the filter batch"),
    "slice_count": ("{{ [1]|slice(10**9)|list|length }}", "the filter slice"),
    "tojson_indent": ("{{ [1, [2]]|tojson(indent=10**9) }}", "tojson: an indent"),
    "list_as_text": ("{{ ['a' * 1000000] * 1000 }}", "the output would build"),
    "list_in_concat": ("{{ 'x' ~ (['a' * 1000000] * 1000) }}", "'~' would build"),
    "string_filter_of_list": ("{{ (['a' * 1000000] * 1000)|string }}", "the filter string"),
    "sum_of_lists": ("{{ ([[1] * 1000000] * 1000)|sum(start=[])|length }}", "the filter sum"),
    "lipsum": ("{{ lipsum(10**6) }}", "lipsum would build"),
    "many_small_values": (
        "{% for i in range(100000) %}{% set x = 'a' * 100000 %}{% endfor %}",
        "in all",
    ),
    "nested_loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "took longer than",
    ),
}
HOSTILE["replace_empty"] = (HOSTILE["replace_empty"][0], "the filter replace")


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer(QWEN)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_refused_by_its_budget_within_bounded_memory(name, qwen, monkeypatch):
    """Each hostile template raises TemplateBudget saying which operation went over, having
    allocated at most a few hundred megabytes (a 64M-item value at most, never the
    gigabytes the operation asked for)."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    chat_template.start_run()
    template, said = HOSTILE[name]
    bundle = dataclasses.replace(qwen, chat_template=template)
    tracemalloc.start()
    try:
        with pytest.raises(TemplateBudget) as caught:
            render_text(bundle, [{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert said in str(caught.value), str(caught.value)
    assert peak < 600 * 2**20, f"{name}: {peak:,} bytes"


def _hostile_bundle(tmp_path, kinds):
    """The Qwen tokenizer with a template that turns hostile on a user message naming a kind."""
    folder = tmp_path / "hostile"
    shutil.copytree(QWEN, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    branches = "".join(
        ("{% if" if k == 0 else "{% elif")
        + f" messages[0].content == '{kind}' %}}"
        + HOSTILE[kind][0]
        for k, kind in enumerate(kinds)
    )
    config["chat_template"] = branches + "{% else %}" + config["chat_template"] + "{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _records(contents):
    return [
        {"messages": [{"role": "user", "content": c}, {"role": "assistant", "content": f"ok {k}"}]}
        for k, c in enumerate(contents)
    ]


def _sft_config(**pre):
    data = default_config("sft").model_dump(mode="json")
    data["preprocessing"].update(min_chars=0, **pre)
    return PipelineConfig.from_dict(data)


def test_hostile_templates_in_a_run_are_counted_template_errors_and_good_records_written(
    tmp_path, monkeypatch
):
    """A run under --on-error skip over every hostile kind: each record is one named
    template_error in rejects.jsonl (its line, its reason), the good records around them are
    written; no MemoryError, no hang."""
    from tokenmill.preprocess.run.pipeline import Pipeline

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    kinds = [k for k in HOSTILE if k != "nested_loops"] + ["nested_loops"]
    folder = _hostile_bundle(tmp_path, kinds)
    src = tmp_path / "in.jsonl"
    rows = _records(["hello there", *kinds, "goodbye now"])
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = Pipeline(
        _sft_config(batch_size=8),
        [src],
        tmp_path / "out",
        folder,
        workers=1,
        on_error="skip",
        progress=False,
    ).run()
    assert summary.records_written == 2
    assert summary.skipped == {"template_error": len(kinds)}
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").open()]
    assert [r["line"] for r in rejects] == list(range(2, 2 + len(kinds)))
    assert {r["reason"] for r in rejects} == {"template_error"}
    for reject, kind in zip(rejects, kinds, strict=True):
        assert HOSTILE[kind][1] in reject["message"], (kind, reject["message"])


def test_a_record_stopped_by_its_budget_is_not_rendered_again_by_its_own_pass(
    tmp_path, monkeypatch
):
    """The chunk's prerendering stops each spinning record once; the record's own pass fails
    at once with the same reason (the issue's 12 records took two budgets each): the run
    counts one stopped rendering per record, not two."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)
    bundle = load_tokenizer(_hostile_bundle(tmp_path, ["nested_loops"]))
    masker = RecordMasker(_sft_config(), bundle)
    chat_template.start_run()  # as a run's worker does when it sets up (chunks.Maskers)
    records = [Record("in.jsonl", k + 1, r) for k, r in enumerate(_records(["nested_loops"] * 3))]
    prerender(masker, records)
    assert chat_template._RUN["renderings"] == 3
    for record in records:
        with pytest.raises(RecordError) as caught:
            masker.process_counted(record)
        assert caught.value.reason == "template_error"
        assert "took longer than 0.2 s" in str(caught.value)
    assert chat_template._RUN["renderings"] == 3


def test_the_run_budget_stops_a_run_whose_template_is_hostile_on_every_record(
    tmp_path, monkeypatch
):
    """Renderings stopped by their budget count against the run's (RUN_SECONDS): once it is
    spent, the run stops with one error saying so (not a RecordError to skip: under
    --on-error skip a million hostile records would take a million budgets)."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)
    monkeypatch.setattr(chat_template, "RUN_SECONDS", 0.5)
    bundle = load_tokenizer(_hostile_bundle(tmp_path, ["nested_loops"]))
    masker = RecordMasker(_sft_config(), bundle)
    chat_template.start_run()  # as a run's worker does when it sets up (chunks.Maskers)
    stopped = 0
    records = _records(["nested_loops"] * 100)  # each its own (a repeated one fails at once)
    with pytest.raises(TemplateRunBudget) as caught:
        for line, record in enumerate(records, 1):
            try:
                masker.process(record, "in.jsonl", line)
            except RecordError as err:
                assert err.reason == "template_error"
                stopped += 1
    assert stopped <= 2  # each stopped rendering took at least 0.2 s: the third is past 0.5 s
    assert chat_template._RUN["renderings"] == stopped + 1
    assert "over the run's budget of 0.5 s" in str(caught.value)
    assert not isinstance(caught.value, RecordError)
    chat_template.start_run()
    with pytest.raises(RecordError):  # a new run starts with its budget whole
        masker.process(_records(["nested_loops"])[0], "in.jsonl", 1)
