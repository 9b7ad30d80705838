"""Resume grid on real data in real processes: num_workers {0, 1, 2} x world size {1, 2}
x train type {seq, sft, dpo, grpo} x packing {off, on}.

The test builds small real datasets with the Pipeline, then starts one
`torch.distributed.run --nproc_per_node=2` job (gloo) that runs this file as a script and
loops over the whole grid: every stream equals the num_workers=0 stream, and a loader saved
after k batches and resumed (under another num_workers) gives the rest bitwise. Elastic:
states saved at world size 2 resume at 1 and the reverse, each sample exactly once; packing
states refuse the other world size by name.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TESTS

pytestmark = pytest.mark.slow  # torchrun
SOURCES = {
    "seq": "pretrain_c4_300.jsonl",
    "sft": "chat_sharegpt_1000.jsonl",
    "dpo": "dpo_en_300.jsonl",
    "grpo": "grpo_from_dpo_300.jsonl",
}
WINDOW, RECORDS = 256, 24


def build_datasets(out: Path) -> None:
    """Real shards of every train type, written by the real pipeline."""
    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.presets import DEFAULT_CONFIGS
    from tokenmill.preprocess.run.pipeline import Pipeline

    for kind, source in SOURCES.items():
        config = copy.deepcopy(DEFAULT_CONFIGS[kind])
        config.setdefault("preprocessing", {})["max_items"] = RECORDS
        Pipeline(
            PipelineConfig.from_dict(config),
            [ROOT / "data" / source],
            out / kind,
            ROOT / "data" / "tokenizers" / "qwen2.5",
            workers=1,
            on_error="skip",
            progress=False,
        ).run()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_resume_grid_in_two_real_processes(tmp_path):
    build_datasets(tmp_path / "data")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        __file__, str(tmp_path / "data"), str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(TESTS)}  # the script imports helpers and resume
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sum(r["cells"] for r in reports) == 4 * 2 + 4 * 2 * 2  # world 1 split, world 2 on both
    assert all(r["elastic"] == 4 * 2 and r["packing_elastic"] == 4 * 2 for r in reports)


# --- the job each of the two processes runs -----------------------------------------


class Indexed(torch.utils.data.Dataset):
    """A dataset whose items also carry their index, so a batch says which samples it holds."""

    def __init__(self, dataset):
        self.dataset, self.fingerprint = dataset, dataset.fingerprint

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return {**self.dataset[i], "index": i}


def grid_roles(kind: str, packing: bool, indexed: bool = False):
    from tokenmill.dataflow import (
        BatchCollator,
        DefaultBatchCollator,
        DPOPaddingCollator,
        GRPOPaddingCollator,
        PackedCollator,
        PoolPackingBatcher,
        SequentialPackingBatcher,
        SimpleBatcher,
    )

    padding = {
        "seq": DefaultBatchCollator,
        "sft": DefaultBatchCollator,
        "dpo": DPOPaddingCollator,
        "grpo": GRPOPaddingCollator,
    }
    if not packing:
        batcher, collator = SimpleBatcher(3), padding[kind]()
    elif kind in ("seq", "sft"):
        batcher, collator = PoolPackingBatcher(3 * WINDOW, pool_size=7), PackedCollator()
    elif kind == "dpo":
        batcher, collator = SequentialPackingBatcher(4096), DPOPaddingCollator()
    else:
        batcher, collator = PoolPackingBatcher(4096, pool_size=5), GRPOPaddingCollator()
    if not indexed:
        return batcher, collator

    class WithIndex(BatchCollator):
        def collate(self, samples):
            plain = [{k: v for k, v in s.items() if k != "index"} for s in samples]
            return {**collator.collate(plain), "index": torch.tensor([s["index"] for s in samples])}

    return batcher, WithIndex()


def make_loader(dataset, kind, packing, workers, epochs=2, indexed=False, **coordinates):
    from tokenmill.dataflow import DataflowLoader, MapDistributor

    batcher, collator = grid_roles(kind, packing, indexed)
    distributor = MapDistributor(dataset, seed=17, num_epochs=epochs)
    return DataflowLoader(
        distributor, batcher=batcher, collator=collator, num_workers=workers, **coordinates
    )


def check_cell(dataset, kind, packing, coordinates) -> None:
    """Every num_workers gives the reference stream; save after k, resume under another num_workers."""
    from resume import first_difference, same

    reference = list(make_loader(dataset, kind, packing, 0, **coordinates))
    epoch = len(list(make_loader(dataset, kind, packing, 0, epochs=1, **coordinates)))
    where = f"{kind} packing={packing} {coordinates or 'world from torch.distributed'}"
    for workers, k in zip((0, 1, 2), (epoch, len(reference) // 3, epoch + 1)):
        first = make_loader(dataset, kind, packing, workers, **coordinates)
        batches = iter(first)
        head = [next(batches) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        whole = head + list(batches)
        assert same(whole, reference), (
            f"{where} workers={workers}: {first_difference(whole, reference)}"
        )
        second = make_loader(dataset, kind, packing, (workers + 1) % 3, **coordinates)
        second.load_state_dict(state)
        rest = list(second)
        assert same(rest, reference[k:]), (
            f"{where} resumed at {k}: {first_difference(rest, reference[k:])}"
        )


def consume(loader, count=None) -> list[int]:
    ids, batches = [], iter(loader)
    for batch in batches if count is None else (next(batches) for _ in range(count)):
        ids += batch["index"].tolist()
    return ids


def check_elastic(dataset, kind, rank) -> None:
    """Non-packing: 2 -> 1 and 1 -> 2 ranks read each sample exactly once (padding aside)."""
    import torch.distributed as dist

    from tokenmill.training.state import epoch_end, epoch_order

    data, n = Indexed(dataset), len(dataset)
    order = epoch_order(n, 17, 0).tolist()
    # world 2 -> 1
    wide = make_loader(data, kind, False, 0, epochs=1, indexed=True)
    seen, state = consume(wide, 2), wide.state_dict()
    states, seens = [None, None], [None, None]
    dist.all_gather_object(states, state)
    dist.all_gather_object(seens, seen)
    assert states[0] == states[1], f"{kind}: ranks saved different states"
    if rank == 0:
        narrow = make_loader(
            data, kind, False, 2, epochs=1, indexed=True, dp_rank=0, dp_world_size=1
        )
        narrow.load_state_dict(json.loads(json.dumps(state)))
        ids = seens[0] + seens[1] + consume(narrow)
        assert sorted(ids) == list(range(n)), f"{kind}: 2 -> 1 ranks read {sorted(ids)}"
    # world 1 -> 2
    shared = [None]
    if rank == 0:
        narrow = make_loader(
            data, kind, False, 1, epochs=1, indexed=True, dp_rank=0, dp_world_size=1
        )
        shared = [(consume(narrow, 3), narrow.state_dict())]
    dist.broadcast_object_list(shared, src=0)
    seen, state = shared[0]
    wide = make_loader(data, kind, False, 2, epochs=1, indexed=True)
    wide.load_state_dict(state)
    rests = [None, None]
    dist.all_gather_object(rests, consume(wide))
    consumed = state["position"]["distributor"]["consumed"]
    padding = [order[p % n] for p in range(n, epoch_end(n, consumed, 2, False))]
    ids = seen + rests[0] + rests[1]
    assert sorted(ids) == sorted([*range(n), *padding]), f"{kind}: 1 -> 2 ranks read {sorted(ids)}"


def check_packing_elastic(dataset, kind, rank) -> None:
    """Packing plans on the global order, so a state saved under one world size loads under
    another (exactly-once across 2 -> 3 -> 1 is test_shard_shuffle's), both ways."""
    packed = make_loader(dataset, kind, True, 0)
    next(iter(packed))
    narrow = make_loader(dataset, kind, True, 0, dp_rank=0, dp_world_size=1)
    narrow.load_state_dict(packed.state_dict())
    next(iter(narrow))
    make_loader(dataset, kind, True, 0).load_state_dict(narrow.state_dict())


def main(data: Path, out: Path) -> None:
    import torch.distributed as dist

    from tokenmill.training.dataset_factory import DatasetFactory

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    datasets = {
        kind: DatasetFactory.load(
            kind, data / kind, window_size=WINDOW, sample="window" if kind == "sft" else None
        )
        for kind in SOURCES
    }
    report = {"cells": 0, "elastic": 0, "packing_elastic": 0}
    for i, (kind, packing) in enumerate(product(SOURCES, (False, True))):
        if i % 2 == rank:  # world size 1: the two processes share these cells
            check_cell(datasets[kind], kind, packing, {"dp_rank": 0, "dp_world_size": 1})
            report["cells"] += 1
        check_cell(datasets[kind], kind, packing, {})  # world size 2 from torch.distributed
        report["cells"] += 1
    for kind in SOURCES:
        check_elastic(datasets[kind], kind, rank)
        report["elastic"] += 2
        check_packing_elastic(datasets[kind], kind, rank)
        report["packing_elastic"] += 2
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
