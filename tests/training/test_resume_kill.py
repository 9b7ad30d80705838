"""SIGKILL a training loop at random steps and resume it from its last JSON checkpoint.

The loop runs in a child process (forked, so it starts without re-importing torch), with
0 or 2 DataLoader workers prefetching ahead. Over the whole run, no sample is consumed
twice or skipped, and every replayed step repeats exactly what the killed process got.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from resume import ToyDataset, roles, sample_ids

from tokenmill.dataflow import DataflowLoader, MapDistributor

pytestmark = pytest.mark.slow  # kills processes

SIZE, EPOCHS, EVERY = 48, 2, 3  # samples per epoch, epochs, steps between checkpoints
TRIALS = 50  # SIGKILLs at least


def make_loader(num_workers: int, packing: bool) -> DataflowLoader:
    batcher, collator = roles("sft", packing)
    distributor = MapDistributor(ToyDataset("sft", SIZE), seed=11, num_epochs=EPOCHS)
    return DataflowLoader(distributor, batcher=batcher, collator=collator, num_workers=num_workers)


def train(checkpoint: Path, num_workers: int, packing: bool, conn) -> None:
    """The training loop: resume if a checkpoint exists, save one every EVERY steps (write
    aside, then rename), report each step's sample ids and wait for the go-ahead. It leads
    its own process group, so one SIGKILL stops it and its DataLoader workers together."""
    os.setpgid(0, 0)
    torch.set_num_threads(
        1
    )  # as DataLoader workers do: a fork must not use the parent's OpenMP pool
    loader = make_loader(num_workers, packing)
    step = 0
    if checkpoint.exists():
        saved = json.loads(checkpoint.read_text())
        loader.load_state_dict(saved["loader"])
        step = saved["step"]
    for batch in loader:
        step += 1
        if step % EVERY == 0:
            aside = checkpoint.with_suffix(".tmp")
            aside.write_text(json.dumps({"step": step, "loader": loader.state_dict()}))
            os.replace(aside, checkpoint)
        conn.send((step, sample_ids(batch)))
        conn.recv()
    conn.send(None)


def run_once(
    checkpoint: Path, num_workers: int, packing: bool, kill_at: int | None, logged: dict
) -> bool:
    """One process: returns True when it finished, False when it was killed at `kill_at`."""
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    child = context.Process(target=train, args=(checkpoint, num_workers, packing, theirs))
    child.start()
    try:
        while True:
            if not ours.poll(120):
                raise AssertionError(
                    f"training process silent for 120 s (exit code {child.exitcode})"
                )
            message = ours.recv()
            if message is None:
                return True
            step, ids = message
            assert logged.setdefault(step, ids) == ids, f"step {step} replayed differently"
            if step == kill_at:
                os.killpg(child.pid, signal.SIGKILL)
                return False
            ours.send("go")
    finally:
        child.join()
        ours.close()


def test_sigkill_at_random_steps_loses_and_repeats_nothing(tmp_path):
    rng = random.Random(2024)
    kills = runs = 0
    while kills < TRIALS or runs < 4:
        packing = runs % 2 == 1
        reference = [sample_ids(batch) for batch in make_loader(0, packing)]
        checkpoint, logged = tmp_path / f"run{runs}.json", {}
        done = False
        while not done:
            start = json.loads(checkpoint.read_text())["step"] if checkpoint.exists() else 0
            ahead = range(start + 1, start + 2 * EVERY + 1)
            targets = [t for t in ahead if t % EVERY and t <= len(reference)]
            if ahead[-1] > len(reference):
                targets.append(None)  # near the end: sometimes let it finish
            kill_at = rng.choice(targets)
            done = run_once(checkpoint, rng.choice([0, 2]), packing, kill_at, logged)
            kills += not done
        consumed = [logged[step] for step in range(1, len(logged) + 1)]
        assert consumed == reference
        assert sorted(i for ids in consumed for i in ids) == sorted(list(range(SIZE)) * EPOCHS)
        if not packing:  # fixed groups: each epoch is exactly its own steps
            per_epoch = SIZE // 4
            for epoch in range(EPOCHS):
                ids = [
                    i
                    for step in consumed[epoch * per_epoch : (epoch + 1) * per_epoch]
                    for i in step
                ]
                assert sorted(ids) == list(range(SIZE)), f"epoch {epoch}"
        runs += 1
    assert kills >= TRIALS
