"""The shard-aware shuffle under real torchrun ranks (gloo): a loader state saved by 2 ranks
resumes on 3, whose state resumes on 1, and the epoch reads every sample exactly once, with
fixed groups and with packing; every rank saves the same state, which records the canonical
group count of the first run (2).

The test builds a real dataset of many shards with the Pipeline, then starts three
`torch.distributed.run` jobs in turn (2, 3 and 1 processes), each running this file as a
script; they hand the state and the indices they read over through files."""

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
WORLDS, STEPS = (2, 3, 1), (3, 2)  # batches per rank before each save; the last reads the rest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shard_shuffle_resumes_2_3_1_ranks_exactly_once_under_torchrun(tmp_path):
    from test_shard_shuffle import build

    data = build(tmp_path / "seq", "seq")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(Path(__file__).parent)])}
    for phase, world in enumerate(WORLDS):
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            __file__, str(data), str(tmp_path), str(phase),
        ]  # fmt: skip
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    from test_shard_shuffle import load

    n = len(load(data, "seq"))
    for packing in (False, True):
        seen = [
            index
            for phase, world in enumerate(WORLDS)
            for rank in range(world)
            for index in json.loads((tmp_path / f"seen_{packing}_{phase}_{rank}.json").read_text())
        ]
        assert sorted(seen) == list(range(n)), f"packing={packing}: {len(seen)} read of {n}"
        for phase in range(len(STEPS)):
            state = json.loads((tmp_path / f"state_{packing}_{phase}.json").read_text())
            assert state["dp_rank"] is None and state["dp_world_size"] == WORLDS[phase]
            assert state["position"]["distributor"]["canonical_groups"] == 2


# --- what each process runs ----------------------------------------------------------


def main(data: Path, out: Path, phase: int) -> None:
    import torch.distributed as dist
    from test_shard_shuffle import Indexed, load, make_loader

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = Indexed(load(data, "seq"))
    for packing in (False, True):
        loader = make_loader(dataset, packing, None, None, workers=phase % 2)  # ranks: from dist
        assert (loader.dp_rank, loader.dp_world_size) == (rank, world)
        if phase:
            loader.load_state_dict(
                json.loads((out / f"state_{packing}_{phase - 1}.json").read_text())
            )
        batches = iter(loader)
        if phase < len(STEPS):
            seen = [i for _ in range(STEPS[phase]) for i in next(batches)["index"].tolist()]
        else:
            seen = [i for batch in batches for i in batch["index"].tolist()]
        (out / f"seen_{packing}_{phase}_{rank}.json").write_text(json.dumps(seen))
        states: list = [None] * world
        dist.all_gather_object(states, loader.state_dict())
        assert all(s == states[0] for s in states), f"ranks saved different states: {states}"
        if rank == 0 and phase < len(STEPS):
            (out / f"state_{packing}_{phase}.json").write_text(json.dumps(states[0]))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
