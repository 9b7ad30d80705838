"""A mixture declared in a recipe file, over three real SFT datasets preprocessed from the
shipped data: its declared shares hold over the epoch, every sample once per pass, a real
DataLoader with workers resumes it exactly, an edited recipe is refused by name, and
`tokenmill mix` prints what it will give."""

from __future__ import annotations

import argparse
import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml
from helpers import DATA, QWEN

from tokenmill.dataflow import DataflowLoader, SFTPaddingCollator
from tokenmill.preprocess.config import ConfigError, PipelineConfig
from tokenmill.preprocess.presets import DEFAULT_CONFIGS
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.tools import mix
from tokenmill.tools.recipe import load_recipe, realised_mix

FILES = {  # name -> (shipped file, records kept, preset): three kinds of SFT data
    "chat": ("chat_sharegpt_1000.jsonl", 30, "sft"),
    "tools": ("toolcall_glaive_zh_300.json", 12, "sft"),
    "code": ("instruction_humaneval.jsonl", 9, "instruction"),  # prompt masked, code trained
}
RECIPE = {
    "train_type": "sft",
    "sample": "record",
    "window_size": 2048,
    "mixture": {
        "by": "samples",
        "on_exhausted": "stop",
        "sources": [
            {"path": "data/chat", "weight": 3, "repeats": 3, "name": "chat"},
            {"path": "data/tools", "weight": 1, "repeats": 2, "name": "tools"},
            {"path": "data/code", "weight": 1, "repeats": 3, "name": "code"},
        ],
    },
}


def preprocess(name: str, out: Path, records: int) -> None:
    config = copy.deepcopy(DEFAULT_CONFIGS[FILES[name][2]])
    config.setdefault("preprocessing", {})["max_items"] = records
    Pipeline(
        PipelineConfig.from_dict(config), [DATA / FILES[name][0]], out, QWEN,
        workers=1, on_error="skip", progress=False, overwrite=True,
    ).run()  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipe")
    for name, (_, records, _) in FILES.items():
        preprocess(name, root / "data" / name, records)
    return root


def write(folder: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def edited(**mixture) -> dict:
    recipe = copy.deepcopy(RECIPE)
    recipe["mixture"].update(mixture)
    return recipe


def picks(recipe_path: Path, rank: int = 0, world: int = 1) -> list[tuple[int, int]]:
    return [index[:2] for index in load_recipe(recipe_path).distributor().indices(rank, world)]


def test_declared_shares_hold_over_the_epoch_and_every_sample_once_per_pass(folder):
    path = write(folder, RECIPE)
    mixture = load_recipe(path).distributor()
    sizes = [len(s.dataset) for s in mixture.sources]  # type: ignore[attr-defined]
    assert sizes == [30, 12, 9]
    got = picks(path)
    counts = Counter(i for i, _ in got)
    # stop: tools (12 x 2 passes at share 1/5) runs out first, asked for its 25th sample
    assert counts == {0: 73, 1: 24, 2: 24}
    for k in range(1, len(got) + 1):  # every prefix within one sample of the shares
        seen = Counter(i for i, _ in got[:k])
        assert all(abs(seen[i] - share * k) <= 1 for i, share in enumerate([0.6, 0.2, 0.2]))
    for i, size in enumerate(sizes):  # pass by pass: each a permutation, the last a part of one
        mine = [index for source, index in got if source == i]
        passes = [mine[p : p + size] for p in range(0, len(mine), size)]
        assert all(sorted(p) == list(range(size)) for p in passes[:-1])
        assert len(set(passes[-1])) == len(passes[-1])
    tools = [index for source, index in got if source == 1]
    assert tools[:12] != tools[12:]  # each pass a fresh order
    report = realised_mix(mixture)
    assert [row["samples"] for row in report["sources"]] == [73, 24, 24]
    assert [row["declared"] for row in report["sources"]] == [0.6, 0.2, 0.2]
    assert [row["realised"] for row in report["sources"]] == [73 / 121, 24 / 121, 24 / 121]
    assert [row["passes"] for row in report["sources"]] == [73 / 30, 2.0, 24 / 9]
    assert picks(path) == got  # the report ran on the mixture and left it as it was


def test_reweight_spends_every_source_and_by_tokens_balances_trained_tokens(folder):
    got = picks(write(folder, edited(on_exhausted="reweight"), "reweight.yaml"))
    assert Counter(i for i, _ in got) == {0: 30 * 3, 1: 12 * 2, 2: 9 * 3}  # all passes spent
    for i, (size, passes) in enumerate([(30, 3), (12, 2), (9, 3)]):
        mine = [index for source, index in got if source == i]
        assert sorted(mine) == sorted(list(range(size)) * passes)
    by_tokens = load_recipe(write(folder, edited(by="tokens"), "tokens.yaml")).distributor()
    taken = list(by_tokens.indices(0, 1))
    trained = [0, 0, 0]
    for source, _, item in taken:
        trained[source] += int(item["loss_mask"].sum())
    assert trained == by_tokens.counts
    total, largest = sum(trained), by_tokens.largest
    assert all(abs(t - share * total) <= largest for t, share in zip(trained, [0.6, 0.2, 0.2]))
    report = realised_mix(load_recipe(folder / "tokens.yaml").distributor())
    assert [row["samples"] for row in report["sources"]] == [
        sum(1 for s, *_ in taken if s == i) for i in range(3)
    ]


def sample_keys(folder: Path, recipe_path: Path) -> dict[tuple, tuple[int, int]]:
    """Each conversation's tokens -> (source, index), so a padded batch says what it holds."""
    keys = {}
    for i, source in enumerate(load_recipe(recipe_path).distributor().sources):
        dataset = source.dataset  # type: ignore[attr-defined]
        for j in range(len(dataset)):
            keys[tuple(dataset[j]["input_ids"].tolist())] = (i, j)
    return keys


def loader(recipe_path: Path, workers: int) -> DataflowLoader:
    return DataflowLoader(
        load_recipe(recipe_path).distributor(),
        batch_size=4,
        collator=SFTPaddingCollator(),
        num_workers=workers,
    )


def run(loader_: DataflowLoader, keys: dict, stop: int | None = None) -> list[tuple[int, int]]:
    out = []
    for step, batch in enumerate(loader_):
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            out.append(keys[tuple(ids[: int(mask.sum())].tolist())])
        if stop is not None and step + 1 == stop:
            break
    return out


@pytest.mark.parametrize(
    "mixture, workers",
    [
        ({}, 0),
        pytest.param({}, 2, marks=pytest.mark.slow),  # worker processes: seconds
        pytest.param({"by": "tokens", "on_exhausted": "reweight"}, 2, marks=pytest.mark.slow),
    ],
)
def test_a_real_loader_resumes_the_recipe_exactly_once(folder, mixture, workers):
    path = write(folder, edited(**mixture), f"resume{workers}{len(mixture)}.yaml")
    keys = sample_keys(folder, path)
    assert len(keys) == 30 + 12 + 9  # every conversation tells itself apart
    full = run(loader(path, workers), keys)
    assert full == picks(path)  # the loader gives the mixture's picks, in order
    first = loader(path, workers)
    head = run(first, keys, stop=7)
    state = json.loads(json.dumps(first.state_dict()))
    second = loader(path, workers)  # rebuilt from the recipe file
    second.load_state_dict(state)
    assert head + run(second, keys) == full


def test_an_edited_recipe_is_refused_by_name(folder):
    path = write(folder, RECIPE, "saved.yaml")
    first = loader(path, 0)
    run(first, sample_keys(folder, path), stop=3)
    state = json.loads(json.dumps(first.state_dict()))

    def refused(recipe: dict, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            loader(write(folder, recipe, "edited.yaml"), 0).load_state_dict(state)

    more = copy.deepcopy(RECIPE)
    more["mixture"]["sources"][1]["weight"] = 2
    refused(more, r"weights of tools: saved 1.0, now 2.0")
    fewer = copy.deepcopy(RECIPE)
    fewer["mixture"]["sources"][2]["repeats"] = None
    refused(fewer, r"repeats of code: saved 3, now None")
    refused(edited(on_exhausted="reweight"), r"on_exhausted: saved 'stop', now 'reweight'")
    refused(edited(by="tokens"), r"by: saved 'samples', now 'tokens'")
    preprocess("tools", folder / "data" / "tools", 13)  # the tools data changed
    try:
        refused(RECIPE, r"tools: MapDistributor cannot resume: fingerprint: saved '\w+', now '\w+'")
    finally:
        preprocess("tools", folder / "data" / "tools", FILES["tools"][1])


def test_recipe_errors_name_the_field(folder):
    bad = edited(by="rows")
    bad["mixture"]["sources"][0]["wieght"] = 3
    bad["mixture"]["sources"][1]["weight"] = 0
    with pytest.raises(ConfigError) as error:
        load_recipe(write(folder, bad, "bad.yaml"))
    lines = str(error.value).splitlines()
    assert lines == [
        f"{folder / 'bad.yaml'}: mixture.by: Input should be 'samples' or 'tokens'",
        f"{folder / 'bad.yaml'}: mixture.sources[0].wieght: unknown field",
        f"{folder / 'bad.yaml'}: mixture.sources[1].weight: Input should be greater than 0",
    ]


def test_tokenmill_mix_prints_the_realised_mix(folder, capsys):
    parser = argparse.ArgumentParser()
    mix.add_parser(parser.add_subparsers(dest="command"))
    path = write(folder, RECIPE)
    assert mix.main(parser.parse_args(["mix", str(path), "--json"])) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == realised_mix(load_recipe(path).distributor())
    assert mix.main(parser.parse_args(["mix", str(path)])) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "mix by samples, on_exhausted=stop"
    tokens = f"{printed['sources'][0]['tokens']:,}"
    assert table[2].split() == ["chat", "3", "3", "60.00%", "60.33%", "73", tokens, "2.43"]
    assert table[-1].split()[:2] == ["total", "121"]
    # the same mix on the command line
    argv = ["mix", "--type", "sft", "--window-size", "2048", "--json"]
    for source in RECIPE["mixture"]["sources"]:  # type: ignore[index]
        argv += [
            "--source",
            f"{folder / source['path']}:{source['weight']}:{source.get('repeats', 1)}",
        ]
    mix.main(parser.parse_args(argv))
    by_flags = json.loads(capsys.readouterr().out)
    rows = {k: v for k, v in RECIPE.items() if k != "sample"}  # flags give no sample: rows
    by_file = realised_mix(load_recipe(write(folder, rows, "rows.yaml")).distributor())
    assert [r["source"] for r in by_flags["sources"]] == [str(folder / "data" / n) for n in FILES]
    for row in by_flags["sources"] + by_file["sources"]:
        row.pop("source")
    assert by_flags == by_file
    assert mix.parse_source("s3://bucket/chat:3:null") == {
        "path": "s3://bucket/chat", "weight": 3, "repeats": None,
    }  # fmt: skip
    assert mix.parse_source("s3://bucket/chat:0.5") == {"path": "s3://bucket/chat", "weight": 0.5}
    assert mix.parse_source("chat:1e3") == {"path": "chat", "weight": 1000.0}  # as float() reads
