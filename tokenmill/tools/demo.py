"""`tokenmill demo`: the whole flow on the data shipped with tokenmill, end to end.

Preprocess every training type, inspect them, then train a tiny causal language
model on the CPU through DataflowLoader with packing; stop midway, resume from
the saved state, and check that the resumed run saw exactly the batches an
uninterrupted run sees: each sample (one whole prompt and response) once per epoch,
none twice, none skipped. Everything runs with the defaults a user gets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.tools.inspect import dataset_stats, format_stats
from tokenmill.training.dataset_factory import DatasetFactory

DATA = Path(__file__).resolve().parents[2] / "data"


INPUTS = {
    "seq": "pretrain_c4_300.jsonl",
    "instruction": "instruction_humaneval.jsonl",
    "sft": "chat_sharegpt_1000.jsonl",
    "dpo": "dpo_en_300.jsonl",
    "grpo": "grpo_from_dpo_300.jsonl",
}


WINDOW, BUDGET = 1024, 1024  # the longest sample, and the tokens of one packed batch


def preprocess_all(out: Path, log: Callable[[str], None], types: list[str] | None = None) -> None:
    tokenizer = DATA / "tokenizers" / "qwen2.5"
    for train_type in types or list(INPUTS):
        log(f"== preprocess {train_type}: data/{INPUTS[train_type]}")
        summary = Pipeline(
            default_config(train_type),
            [DATA / INPUTS[train_type]],
            out / train_type,
            tokenizer_path=tokenizer,
            overwrite=True,
        ).run()
        log(summary.format())
        log(format_stats(dataset_stats(out / train_type)))


class Indexed:
    """A dataset whose items carry their index, so the demo can check exactly-once."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        import torch

        return {**self.dataset[i], "sample_index": torch.tensor([i])}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)


def make_loader(dataset: Any, num_workers: int) -> Any:
    from tokenmill.dataflow import (
        DataflowLoader,
        MapDistributor,
        PackedCollator,
        SequentialPackingBatcher,
    )

    class IndexedPackedCollator(PackedCollator):
        def collate(self, samples: list[dict]) -> dict:
            batch = super().collate(samples)
            batch["sample_index"] = [int(s["sample_index"][0]) for s in samples]
            return batch

    return DataflowLoader(
        MapDistributor(Indexed(dataset), seed=0),
        batcher=SequentialPackingBatcher(BUDGET),
        collator=IndexedPackedCollator(),
        num_workers=num_workers,
    )


def tiny_model(vocab: int) -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        """Embedding + one causal attention block + MLP, attention kept inside each packed document."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, 64)
            self.pos = nn.Embedding(WINDOW, 64)
            self.attn = nn.MultiheadAttention(64, 2, batch_first=True)
            self.mlp = nn.Sequential(
                nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)
            )
            self.head = nn.Linear(64, vocab)

        def forward(
            self, ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
        ) -> torch.Tensor:
            x = self.embed(ids) + self.pos(position_ids.clamp(max=WINDOW - 1))
            doc = torch.bucketize(torch.arange(ids.shape[1]), cu_seqlens[1:].long(), right=True)
            causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
            allowed = causal & (doc[:, None] == doc[None, :])
            x = x + self.attn(x, x, x, attn_mask=~allowed, need_weights=False)[0]
            return self.head(x + self.mlp(x))

    torch.manual_seed(0)
    return TinyLM()


def train(
    dataset_dir: Path,
    work: Path,
    steps: int,
    stop_at: int,
    num_workers: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Train `stop_at` steps, save, stop; resume from the files and train to `steps`; check exactly-once."""
    import torch

    dataset = DatasetFactory.load("sft", dataset_dir, window_size=WINDOW, sample="record")
    store_ids = np.unique(dataset.store.fetch(0, dataset.store.token_count, "sequence").numpy())
    remap = np.zeros(int(store_ids.max()) + 1, dtype=np.int64)
    remap[store_ids] = np.arange(1, len(store_ids) + 1)  # 0 stays free for padding
    vocab = len(store_ids) + 1
    log(
        f"== train a tiny causal LM: {len(dataset)} whole samples of up to {WINDOW} tokens, packed to {BUDGET} "
        f"tokens per batch, vocabulary {vocab:,}, {steps} steps, stop at {stop_at} and resume"
    )

    def run(
        loader: Any, model: Any, optimizer: Any, first: int, last: int, seen: list
    ) -> list[float]:
        losses = []
        for step, batch in zip(range(first, last), loader, strict=False):
            ids = torch.from_numpy(remap[batch["input_ids"].clamp(min=0).numpy()])
            targets = torch.from_numpy(remap[batch["target_ids"].clamp(min=0).numpy()])
            keep = batch["loss_mask"] & (batch["target_ids"] >= 0)
            if keep.any():  # a batch of prompt tokens only has nothing to learn (its mean is nan)
                logits = model(ids, batch["position_ids"], batch["cu_seqlens"])
                loss = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            seen.append(batch["sample_index"])
            if (step + 1) % max(1, steps // 10) == 0 and losses:
                log(f"  step {step + 1:>4}  loss {np.mean(losses[-max(1, steps // 10) :]):.3f}")
        return losses

    seen: list[list[int]] = []
    model = tiny_model(vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = make_loader(dataset, num_workers)
    start = time.perf_counter()
    losses = run(loader, model, optimizer, 0, stop_at, seen)
    state_file = work / "loader_state.json"
    state_file.write_text(json.dumps(loader.state_dict()))
    save_weights(work / "model.npz", model, optimizer)
    del loader, model, optimizer
    log(
        f"== stopped at step {stop_at}; saved {state_file.name} and model.npz; resuming in a fresh loader"
    )

    model = tiny_model(vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    load_weights(work / "model.npz", model, optimizer)
    loader = make_loader(dataset, num_workers)
    loader.load_state_dict(json.loads(state_file.read_text()))
    losses += run(loader, model, optimizer, stop_at, steps, seen)
    seconds = time.perf_counter() - start

    reference: list[list[int]] = [
        b["sample_index"] for _, b in zip(range(steps), make_loader(dataset, 0), strict=False)
    ]
    check = exactly_once(seen, reference, len(dataset))
    first, last = np.mean(losses[: steps // 10]), np.mean(losses[-(steps // 10) :])
    log(f"== loss {first:.3f} -> {last:.3f} over {steps} steps ({seconds:.0f} s)")
    log(f"== exactly-once: {check['message']}")
    return {"losses": losses, "first_loss": first, "last_loss": last, **check}


def exactly_once(seen: list[list[int]], reference: list[list[int]], size: int) -> dict[str, Any]:
    """The stopped-and-resumed batches equal the uninterrupted ones; every epoch is a permutation."""
    flat = [i for batch in seen for i in batch]
    epochs = [flat[k : k + size] for k in range(0, len(flat), size)]
    duplicates = sum(len(e) - len(set(e)) for e in epochs)
    full = [e for e in epochs if len(e) == size]
    missing = sum(size - len(set(e)) for e in full)
    same = seen == reference
    ok = same and duplicates == 0 and missing == 0
    message = (
        f"{'PASSED' if ok else 'FAILED'}: {len(flat)} samples consumed over {len(full)} full epoch(s) "
        f"and a partial one; duplicates within an epoch {duplicates}, missing {missing}; "
        f"resumed stream {'identical to' if same else 'DIFFERENT from'} the uninterrupted one"
    )
    return {
        "ok": ok,
        "duplicates": duplicates,
        "missing": missing,
        "same_as_uninterrupted": same,
        "message": message,
    }


def save_weights(path: Path, model: Any, optimizer: Any) -> None:
    """Plain arrays (no pickle): parameters, and the optimizer's per-parameter tensors."""
    arrays = {f"model.{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for name, value in state.items():
            arrays[f"opt.{index}.{name}"] = value.numpy()
    arrays["opt_groups"] = np.frombuffer(json.dumps(opt["param_groups"]).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def load_weights(path: Path, model: Any, optimizer: Any) -> None:
    import torch

    with np.load(path, allow_pickle=False) as data:
        model.load_state_dict(
            {k[6:]: torch.from_numpy(data[k]) for k in data.files if k.startswith("model.")}
        )
        state: dict[int, dict[str, Any]] = {}
        for key in data.files:
            if key.startswith("opt."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = torch.from_numpy(data[key])
        groups = json.loads(bytes(data["opt_groups"]).decode())
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def run_demo(
    out: Path,
    steps: int = 300,
    stop_at: int = 150,
    num_workers: int = 2,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    preprocess_all(out, log)
    result = train(out / "instruction", out, steps, stop_at, num_workers, log)
    if not result["ok"]:
        raise RuntimeError(f"exactly-once check failed: {result['message']}")
    return result
