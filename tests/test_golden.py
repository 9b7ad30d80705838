"""Golden guards: the bytes a run writes and the JSON shape of every saved state, pinned.

A restructure must change neither: shards, meta.json, rejects and the manifest (less what
names the machine or the moment) hash to the values in `golden/`, and every state_dict
keeps its keys and values. After an intended change, regenerate with TOKENMILL_REGEN_GOLDEN=1.
"""

from __future__ import annotations

import hashlib
import json
import os
from itertools import islice
from pathlib import Path

import pytest
from helpers import GOLDEN, ROOT

from tokenmill import (
    BatchCollator,
    DataflowLoader,
    DatasetFactory,
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
    PackedCollator,
    Pipeline,
    PipelineConfig,
    PoolPackingBatcher,
    RankPartitionedDistributor,
    RDSampler,
    SequentialPackingBatcher,
    SimpleBatcher,
    default_config,
)

DATA = ROOT / "data"
QWEN = DATA / "tokenizers" / "qwen2.5"
REGEN = bool(os.environ.get("TOKENMILL_REGEN_GOLDEN"))
# what names the machine, the moment or the input's stamp, not the data
VOLATILE = ("seconds", "tokenizer_path", "inputs", "run_id")

RUNS = {
    "seq": ("pretrain_c4_300.jsonl", {}),
    "sft": ("chat_sharegpt_1000.jsonl", {"preprocessing": {"packing_strategy": "bfd"}}),
    "instruction": ("instruction_humaneval.jsonl", {}),
    "dpo": ("dpo_en_300.jsonl", {}),
    "grpo": ("grpo_from_dpo_300.jsonl", {}),
    "sft_jsonl": ("chat_sharegpt_1000.jsonl", {"output": {"storage_format": "jsonl"}}),
    "seq_split": (
        "pretrain_shakespeare.jsonl",
        {
            "preprocessing": {
                "packing_strategy": "bfd_split",
                "max_seq_len": 100000,
                "max_packed_len": 512,
            },
            "output": {"max_tokens_per_shard": 3000, "position_ids_mode": "doc_reset"},
        },
    ),
}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _config(name: str) -> PipelineConfig:
    train_type = name.split("_")[0]
    base = default_config(train_type).model_dump(mode="json", exclude_unset=True)
    return PipelineConfig.from_dict(_merge(base, RUNS[name][1]), origin=name)


def _digest_tree(out: Path, src: Path) -> dict[str, str]:
    """sha256 of every file below `out`; the manifest without its volatile fields, paths relative."""
    digests = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = path.relative_to(out).as_posix()
        data = path.read_bytes()
        if rel == "manifest.json":
            manifest = json.loads(data)
            for key in VOLATILE:
                manifest.pop(key, None)
            manifest["summary"].pop("seconds", None)
            manifest["summary"]["first_errors"] = {
                k: [m.replace(str(src), "SRC") for m in v]
                for k, v in manifest["summary"]["first_errors"].items()
            }
            data = json.dumps(manifest, sort_keys=True).encode()
        elif rel == "rejects.jsonl":
            data = data.replace(str(src).encode(), b"SRC")
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


def _check(name: str, now: dict) -> None:
    path = GOLDEN / f"{name}.json"
    if REGEN:
        path.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    assert now == json.loads(path.read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_written_bytes_match_golden(tmp_path, name):
    file, _ = RUNS[name]
    src = tmp_path / "input.jsonl"
    with open(DATA / file, "rb") as f:
        src.write_bytes(b"".join(islice(f, 60)))
    out = tmp_path / "out"
    Pipeline(_config(name), [src], out, QWEN, workers=1, on_error="skip", progress=False).run()
    _check(f"bytes_{name}", _digest_tree(out, src))


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sft")
    src = tmp / "input.jsonl"
    with open(DATA / "chat_sharegpt_1000.jsonl", "rb") as f:
        src.write_bytes(b"".join(islice(f, 40)))
    Pipeline(
        default_config("sft"), [src], tmp / "out", QWEN, workers=1, on_error="skip", progress=False
    ).run()
    return tmp / "out"


class AsList(BatchCollator):
    def collate(self, samples: list[dict]) -> dict:
        return {"samples": samples}


def _json(state):
    return json.loads(json.dumps(state))


def test_state_dicts_match_golden(sft_dir):
    ds = DatasetFactory.load("sft", sft_dir, window_size=64, sample="window")
    items = [{"input_ids": list(range(n % 7 + 1))} for n in range(50)]
    states = {}

    sampler = RDSampler(ds, seed=3)
    it = iter(sampler)
    next(it), next(it)
    states["RDSampler"] = sampler.state_dict()

    loader = DataflowLoader(MapDistributor(ds, seed=5), batch_size=2, num_workers=0)
    batches = iter(loader)
    next(batches), next(batches)
    states["DataflowLoader/MapDistributor"] = loader.state_dict()

    loader = DataflowLoader(
        MapDistributor(ds, seed=5),
        batcher=SequentialPackingBatcher(200),
        collator=PackedCollator(),
        num_workers=0,
    )
    batches = iter(loader)
    next(batches), next(batches)
    states["DataflowLoader/SequentialPacking"] = loader.state_dict()

    loader = DataflowLoader(
        IterableDistributor(items),
        batcher=PoolPackingBatcher(12, pool_size=8),
        collator=AsList(),
        num_workers=0,
    )
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    states["DataflowLoader/PoolPacking"] = loader.state_dict()

    states["SimpleBatcher"] = SimpleBatcher(4).state_dict()
    states["RankPartitionedDistributor"] = RankPartitionedDistributor(
        [IterableDistributor(items), IterableDistributor(items[:10])], [0.5, 0.5]
    ).state_dict()
    states["MixtureDistributor"] = MixtureDistributor(
        [IterableDistributor(items), IterableDistributor(items[:10])], [0.7, 0.3]
    ).state_dict()
    _check("states", _json(states))
