"""DataflowLoader under Lightning's fit and resume: the batches trained after a resume from a
mid-run checkpoint are exactly those an uninterrupted run trains, and the misuse that would
skip a batch (a loader without lookahead=1) raises when Lightning saves its state."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from resume import ToyDataset, roles

from tokenmill.dataflow import DataflowLoader, MapDistributor

STEPS, EVERY = 9, 4
pytestmark = pytest.mark.slow  # real Lightning fits


class Recorder(L.LightningModule):
    """A one-weight model that records the samples of every batch it trains."""

    def __init__(self, loader: DataflowLoader) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.loader, self.trained = loader, []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        starts = batch["cu_seqlens"][:-1].long() if "cu_seqlens" in batch else None
        first = ids[0][starts] if starts is not None else ids[:, 0]
        self.trained.append(first.tolist())  # toy samples start with their index
        return self.weight * ids.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataflowLoader:
        return self.loader


def make_loader(packing: bool, workers: int, lookahead: int = 1) -> DataflowLoader:
    batcher, collator = roles("sft", packing)
    distributor = MapDistributor(ToyDataset("sft", 20), seed=5)  # endless: Lightning stops it
    return DataflowLoader(
        distributor, batcher=batcher, collator=collator, num_workers=workers, lookahead=lookahead
    )


def fit(model: Recorder, root: Path, ckpt: Path | None = None) -> None:
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=EVERY, save_top_k=-1)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers and logging
        trainer.fit(model, ckpt_path=ckpt)


@pytest.mark.parametrize("packing, workers", [(False, 0), (True, 0), (False, 2), (True, 2)])
def test_lightning_resume_trains_exactly_the_batches_an_uninterrupted_run_trains(
    tmp_path, packing, workers
):
    whole = Recorder(make_loader(packing, workers))
    fit(whole, tmp_path / "whole")
    assert len(whole.trained) == STEPS
    resumed = Recorder(make_loader(packing, workers))
    fit(resumed, tmp_path / "resumed", tmp_path / "whole" / f"epoch=0-step={EVERY}.ckpt")
    assert resumed.trained == whole.trained[EVERY:]


def test_a_loader_without_lookahead_is_refused_when_lightning_saves_it(tmp_path):
    with pytest.raises(RuntimeError, match="lookahead=1"):
        fit(Recorder(make_loader(False, 0, lookahead=0)), tmp_path)
