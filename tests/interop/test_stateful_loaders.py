"""Exactly once inside the loaders people resume with: torchdata's StatefulDataLoader (the one
torchtitan uses) around RDSampler, torchtitan's per-rank state protocol and Lightning's
fit/resume around DataflowLoader. Each is checked with the shared resume helper, and each
misuse that would repeat or lose samples raises."""

from __future__ import annotations

import pytest
import torch
from resume import check_resume, same
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from tokenmill.training.sampler import RDSampler

ITEMS, BATCH, EPOCHS = 22, 4, 2
pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")


class Indices(Dataset):
    """Item i is i: a batch says which samples it holds."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Loop:
    """The data side of a training loop as torchdata's docs write it: the loop's epoch and the
    StatefulDataLoader's state are the checkpoint; `set_epoch` starts each epoch."""

    def __init__(self, workers: int, advance: bool) -> None:
        self.sampler = RDSampler(Indices(), seed=3)
        self.loader = StatefulDataLoader(
            Indices(), batch_size=BATCH, sampler=self.sampler, num_workers=workers
        )
        self.advance, self.epoch = advance, 0

    def batches(self):
        for epoch in range(self.epoch, EPOCHS):
            self.epoch = epoch
            self.sampler.set_epoch(epoch)
            for batch in self.loader:
                if self.advance:
                    self.sampler.advance(len(batch))
                yield batch.tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.loader.load_state_dict(state["loader"])


@pytest.mark.slow  # DataLoader worker processes, twelve loaders
@pytest.mark.parametrize("advance", [False, True], ids=["no-advance", "advance"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_rdsampler_is_exact_once_under_torchdata_stateful_dataloader(workers, advance):
    per_epoch = -(-ITEMS // BATCH)
    full = check_resume(
        lambda: Loop(workers, advance),
        Loop.batches,
        points=[2, 3, per_epoch - 1, per_epoch, per_epoch + 1],
    )
    seen = sorted(i for batch in full for i in batch)
    assert seen == sorted(list(range(ITEMS)) * EPOCHS)


def test_a_plain_dataloader_state_without_advance_is_refused_at_resume():
    """Workers prefetch indices: a sampler that was never told what trained cannot resume."""
    sampler = RDSampler(Indices(), seed=3)
    batches = iter(DataLoader(Indices(), batch_size=BATCH, sampler=sampler, num_workers=2))
    next(batches)  # trained, but advance() not called
    state = sampler.state_dict()
    del batches
    resumed = RDSampler(Indices(), seed=3)
    resumed.load_state_dict(state)
    with pytest.raises(RuntimeError, match="never called advance"):
        list(DataLoader(Indices(), batch_size=BATCH, sampler=resumed))
    advanced = RDSampler(Indices(), seed=3)
    list(iter(advanced))
    advanced.advance(BATCH)
    again = RDSampler(Indices(), seed=3)
    again.load_state_dict(advanced.state_dict())
    assert same(list(again), list(iter(advanced)))
