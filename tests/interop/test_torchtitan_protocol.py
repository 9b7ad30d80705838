"""DataflowLoader in torchtitan's data-loader protocol, under two real torchrun ranks: its state
saved and loaded by torch.distributed.checkpoint (DCP), which merges equal keys across ranks.
With `rank_keyed=True` (torchtitan's {"dp_rank_R": ..., "world_size": W} layout) each rank
resumes exactly its own packing stream; without it, DCP hands every rank rank 0's state, which
every rank can load: packing is planned on the global order, so every rank saves the same
state."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
pytestmark = pytest.mark.slow  # torchrun
BATCHES, SAVED_AT = 8, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dcp_keeps_each_ranks_own_position_under_torchrun(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["resumed"] == report["whole"][SAVED_AT:], f"rank {rank}"
        assert report["streams_differ"]
    assert reports[0]["unkeyed"] == reports[1]["unkeyed"] == "loaded"


# --- what each of the two processes runs ------------------------------------------------
def main(out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from resume import ToyDataset, roles, sample_ids

    from tokenmill.dataflow import DataflowLoader, MapDistributor

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make(rank_keyed: bool = True) -> DataflowLoader:
        batcher, collator = roles("sft", True)  # packing: each rank's position is its own
        distributor = MapDistributor(ToyDataset("sft", 30), seed=2)
        return DataflowLoader(
            distributor, batcher=batcher, collator=collator, rank_keyed=rank_keyed
        )

    def take(loader: DataflowLoader, n: int) -> list:
        batches = iter(loader)
        return [sample_ids(next(batches)) for _ in range(n)]

    whole = take(make(), BATCHES)
    first = make()
    take(first, SAVED_AT)
    dcp.save({"dataloader": first}, checkpoint_id=str(out / "keyed"))
    second = make()
    dcp.load({"dataloader": second}, checkpoint_id=str(out / "keyed"))
    resumed = take(second, BATCHES - SAVED_AT)
    others = [None, None]
    dist.all_gather_object(others, whole)

    unkeyed = make(rank_keyed=False)
    take(unkeyed, SAVED_AT)
    dcp.save({"dataloader": unkeyed}, checkpoint_id=str(out / "unkeyed"))
    try:
        dcp.load({"dataloader": make(rank_keyed=False)}, checkpoint_id=str(out / "unkeyed"))
        outcome = "loaded"
    except Exception as err:  # DCP may wrap the loader's refusal: keep its text
        outcome = str(err)
    report = {
        "whole": whole,
        "resumed": resumed,
        "streams_differ": others[0] != others[1],
        "unkeyed": outcome,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
