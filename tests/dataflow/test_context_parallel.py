"""Context-parallel slices of packed batches: Megatron's / TransformerEngine's THD layout.

Each sequence of a packed row [1, T] is padded to a multiple of 2 * cp_size and cut into
2 * cp_size chunks; rank r keeps chunks r and 2 * cp_size - 1 - r. Pinned here: the exact
layout of a small batch; on real packed batches (shipped chats and shipped text, preprocessed
by the Pipeline, packed by the loader) and on random ones (hypothesis), the ranks' slices
gather back to the batch exactly and hold each of its tokens exactly once, each rank's
`cu_seqlens` and `position_ids` describe its own slice, every rank gets as many tokens and as
much causal-attention work as every other, and attention computed rank by rank from a slice
(its queries, every rank's keys) is the batch's attention.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DATA, QWEN
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.dataflow import (
    BatchCollator,
    ContextParallelCollator,
    DataflowLoader,
    MapDistributor,
    PackedCollator,
    PackedDPOCollator,
    SequentialPackingBatcher,
    context_parallel_gather,
    context_parallel_slice,
)
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory

BUDGET = 4096


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def item(length: int, first: int) -> dict:
    """An sft item of `length` tokens: ids first, first + 1, ..."""
    ids = torch.arange(first, first + length + 1)
    return {
        "input_ids": ids[:-1],
        "target_ids": ids[1:],
        "loss_mask": ids[1:] % 3 != 0,
        "position_ids": torch.arange(length),
    }


# --- real batches ----------------------------------------------------------------------


def preprocess(root: Path, train_type: str, source: str, lines: int) -> Path:
    with open(DATA / source, encoding="utf-8") as f:
        (root / "in.jsonl").write_text("".join(next(f) for _ in range(lines)))
    out = root / "out"
    Pipeline(
        default_config(train_type),
        [root / "in.jsonl"],
        output_dir=out,
        tokenizer_path=QWEN,
        workers=1,
        progress=False,
    ).run()
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preprocess(tmp_path_factory.mktemp("sft"), "sft", "chat_sharegpt_1000.jsonl", 40)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preprocess(tmp_path_factory.mktemp("seq"), "seq", "pretrain_c4_300.jsonl", 40)


def chat_loader(chats: Path, collator) -> DataflowLoader:
    rows = DatasetFactory.load("sft", chats, window_size=2048)
    return DataflowLoader(
        MapDistributor(rows, seed=3, num_epochs=1),
        batcher=SequentialPackingBatcher(BUDGET),
        collator=collator,
    )


def text_loader(text: Path, collator) -> DataflowLoader:
    windows = DatasetFactory.load("seq", text, window_size=250)
    return DataflowLoader(
        MapDistributor(windows, seed=3, num_epochs=1), batch_size=3, collator=collator
    )


@pytest.fixture(scope="module")
def batches(chats: Path, text: Path) -> list[dict]:
    """Real packed batches: chat rows of several conversations each (doc_lengths), the same
    padded to the budget (a padding segment), and windows of text cut where documents end."""
    found = list(chat_loader(chats, PackedCollator()))
    found += list(chat_loader(chats, PackedCollator(pad_id=7, pad_to=BUDGET)))[:2]
    found += list(text_loader(text, PackedCollator()))[:4]
    assert len(found) >= 8
    assert all(len(b["cu_seqlens"]) > 2 for b in found)  # several sequences in each
    return found


@pytest.mark.parametrize("cp_size", [2, 4])
def test_real_batches_gather_back_exactly(batches: list[dict], cp_size: int):
    for batch in batches:
        slices = [context_parallel_slice(batch, cp_size, r, pad_id=7) for r in range(cp_size)]
        assert_same(context_parallel_gather(slices), batch)
        check_slices(batch, slices, cp_size)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_the_collator_in_a_loader_gives_each_rank_its_slice(chats: Path, text: Path, cp_size: int):
    """Through a loader: packed rows (collate) and stored windows (collate_windows)."""
    for make, path in ((chat_loader, chats), (text_loader, text)):
        whole = list(make(path, PackedCollator()))
        ranks = [list(make(path, ContextParallelCollator(cp_size, r))) for r in range(cp_size)]
        assert all(len(r) == len(whole) for r in ranks)
        for step, batch in enumerate(whole):
            slices = [ranks[r][step] for r in range(cp_size)]
            for r, got in enumerate(slices):
                assert_same(got, context_parallel_slice(batch, cp_size, r))
            assert_same(context_parallel_gather(slices), batch)


# --- what every split must hold ----------------------------------------------------------


def check_slices(batch: dict, slices: list[dict], cp_size: int) -> None:
    """Exactly-once coverage, each rank's bounds and positions its own, the load balance."""
    bounds = batch["cu_seqlens"].long()
    lengths = bounds.diff()
    step = 2 * cp_size if cp_size > 1 else 1  # one rank: nothing to balance, nothing padded
    padded = (lengths + step - 1) // step * step
    padded_bounds = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    seen = torch.zeros(bounds[-1], dtype=torch.long)
    work = []
    for rank, part in enumerate(slices):
        local = part["cu_seqlens"]
        assert local.dtype == torch.int32
        assert torch.equal(local.long(), padded_bounds // cp_size)
        assert torch.equal(part["global_cu_seqlens"], batch["cu_seqlens"])
        assert torch.equal(part["global_cu_seqlens_padded"].long(), padded_bounds)
        assert part["max_seqlen"] == max((padded // cp_size).tolist(), default=0)
        size = int(local[-1])
        assert all(part[k].shape == (1, size) for k in ("input_ids", "target_ids", "position_ids"))
        real = 0
        for s in range(len(lengths)):
            a, c = int(local[s]), int(padded[s]) // (2 * cp_size)
            # chunk r, then chunk 2 * cp_size - 1 - r of sequence s, each token's own position
            offsets = torch.cat(
                [rank * c + torch.arange(c), (2 * cp_size - 1 - rank) * c + torch.arange(c)]
            )
            if cp_size == 1:
                offsets = torch.arange(int(lengths[s]))
            width = len(offsets)
            assert width == int(local[s + 1]) - a
            assert torch.equal(part["position_ids"][0, a : a + width], offsets)
            inside = offsets < lengths[s]
            source = bounds[s] + offsets[inside]
            seen[source] += 1
            for key in ("input_ids", "target_ids", "position_ids", "loss_mask"):
                if key in batch:
                    assert torch.equal(part[key][0, a : a + width][inside], batch[key][0, source])
            assert (part["target_ids"][0, a : a + width][~inside] == -100).all()
            if "loss_mask" in batch:
                assert not part["loss_mask"][0, a : a + width][~inside].any()
            real += int((source < batch["num_tokens"]).sum())
        assert part["num_tokens"] == real
        # causal attention work: each token attends to its position + 1 tokens
        work.append(
            [
                int((part["position_ids"][0, local[s] : local[s + 1]] + 1).sum())
                for s in range(len(lengths))
            ]
        )
    assert (seen == 1).all(), "every token of the batch on exactly one rank"
    assert sum(p["num_tokens"] for p in slices) == batch["num_tokens"]
    # load balance: every rank as many tokens, and as much causal work in every sequence
    assert len({int(p["cu_seqlens"][-1]) for p in slices}) == 1
    assert all(w == work[0] for w in work)


@st.composite
def packed_batches(draw) -> tuple[dict, int]:
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=8))
    cp_size = draw(st.integers(1, 5))
    pad = draw(st.sampled_from([None, 0, 13]))
    pad_to = None if pad is None else sum(lengths) + pad
    if pad_to == 0:
        pad_to = None
    samples = [item(n, 1000 * (i + 1)) for i, n in enumerate(lengths)]  # empty ones too
    return PackedCollator(pad_to=pad_to)(samples), cp_size


@settings(max_examples=300, deadline=None)
@given(packed_batches())
def test_random_batches_split_and_gather_back(case: tuple[dict, int]):
    batch, cp_size = case
    slices = [context_parallel_slice(batch, cp_size, r) for r in range(cp_size)]
    assert_same(context_parallel_gather(slices), batch)
    check_slices(batch, slices, cp_size)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), st.sampled_from([2, 3, 4]))
def test_attention_rank_by_rank_is_the_batch_attention(lengths: list[int], cp_size: int):
    """Causal attention inside each sequence, computed per rank from its slice alone (its
    queries; every rank's keys and values, as all-gather context parallelism has them), is
    the batch's attention at the rank's tokens."""
    batch = PackedCollator()([item(n, 100 * (i + 1)) for i, n in enumerate(lengths)])
    torch.manual_seed(0)
    embed = torch.randn(100 * (len(lengths) + 1) + 40, 8, dtype=torch.float64)
    whole = attention(embed[batch["input_ids"][0]], batch["position_ids"][0], batch["cu_seqlens"])
    slices = [context_parallel_slice(batch, cp_size, r) for r in range(cp_size)]
    # every rank's keys, in rank order, with their positions and sequences
    keys = torch.cat([embed[p["input_ids"][0]] for p in slices])
    key_positions = torch.cat([p["position_ids"][0] for p in slices])
    key_sequences = torch.cat([sequence_of(p["cu_seqlens"]) for p in slices])
    real_lengths = batch["cu_seqlens"].long().diff()
    covered = torch.zeros(len(whole), dtype=torch.long)
    for part in slices:
        queries = embed[part["input_ids"][0]]
        sequence, position = sequence_of(part["cu_seqlens"]), part["position_ids"][0]
        allowed = (sequence[:, None] == key_sequences[None, :]) & (
            key_positions[None, :] <= position[:, None]
        )
        out = softmax_attention(queries, keys, allowed)
        # CP padding sits after its sequence's tokens: no real token attends to it
        real = position < real_lengths[sequence]
        index = batch["cu_seqlens"].long()[sequence] + position
        torch.testing.assert_close(out[real], whole[index[real]])
        covered[index[real]] += 1
    assert (covered == 1).all()


def sequence_of(bounds: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds.long().diff())


def attention(x: torch.Tensor, positions: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    seq = sequence_of(bounds)
    allowed = (seq[:, None] == seq[None, :]) & (positions[None, :] <= positions[:, None])
    return softmax_attention(x, x, allowed)


def softmax_attention(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    scores = (q @ kv.T).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ kv


# --- exact layout, other collators, bad input ------------------------------------------


def test_the_layout_of_a_small_batch_is_pinned():
    """Sequences of 8, 5 and 11 tokens and a padding segment of 16 (pad_to=40), cp_size 2:
    padded to 8, 8, 12 and 16, chunks of 2, 2, 3 and 4."""
    batch = PackedCollator(pad_id=9, pad_to=40)([item(8, 100), item(5, 200), item(11, 300)])
    first, second = (context_parallel_slice(batch, 2, r, pad_id=9) for r in range(2))
    assert first["input_ids"].tolist() == [
        [100, 101, 106, 107, 200, 201, 9, 9, 300, 301, 302, 309, 310, 9] + [9] * 8
    ]
    assert second["input_ids"].tolist() == [
        [102, 103, 104, 105, 202, 203, 204, 9, 303, 304, 305, 306, 307, 308] + [9] * 8
    ]
    assert first["position_ids"].tolist() == [
        [0, 1, 6, 7, 0, 1, 6, 7, 0, 1, 2, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, 15]
    ]
    assert second["position_ids"].tolist() == [
        [2, 3, 4, 5, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 9, 10, 11]
    ]
    assert first["target_ids"][0, :8].tolist() == [101, 102, 107, 108, 201, 202, -100, -100]
    for part in (first, second):
        assert part["cu_seqlens"].tolist() == [0, 4, 8, 14, 22]
        assert part["global_cu_seqlens"].tolist() == [0, 8, 13, 24, 40]
        assert part["global_cu_seqlens_padded"].tolist() == [0, 8, 16, 28, 44]
        assert part["max_seqlen"] == 8
    assert (first["num_tokens"], second["num_tokens"]) == (11, 13)
    # one rank: the batch as it is, with its bounds named both ways
    alone = context_parallel_slice(batch, 1, 0)
    for key in ("global_cu_seqlens", "global_cu_seqlens_padded"):
        assert torch.equal(alone.pop(key), batch["cu_seqlens"])
    assert_same(alone, batch)


def test_per_sequence_keys_of_a_packed_preference_batch_stay_whole():
    pairs = [
        {"chosen": torch.arange(10, 19), "chosen_mask": torch.ones(9, dtype=torch.bool),
         "rejected": torch.arange(20, 26), "rejected_mask": torch.ones(6, dtype=torch.bool)},
        {"chosen": torch.arange(30, 34), "chosen_mask": torch.ones(4, dtype=torch.bool),
         "rejected": torch.arange(40, 51), "rejected_mask": torch.ones(11, dtype=torch.bool)},
    ]  # fmt: skip
    batch = PackedDPOCollator()(pairs)
    slices = [context_parallel_slice(batch, 2, r) for r in range(2)]
    for part in slices:
        assert part["chosen_index"] is batch["chosen_index"]
        assert part["rejected_index"] is batch["rejected_index"]
        assert len(part["cu_seqlens"]) == len(batch["cu_seqlens"])  # every sequence on each rank
    assert_same(context_parallel_gather(slices), batch)


def test_bad_input_is_refused_by_name():
    batch = PackedCollator()([item(5, 10)])
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, 2\\), got 2"):
        context_parallel_slice(batch, 2, 2)
    with pytest.raises(ValueError, match="cp_size must be a positive int, got 0"):
        ContextParallelCollator(0, 0)
    with pytest.raises(KeyError, match="lacks 'cu_seqlens'"):
        context_parallel_slice({"input_ids": batch["input_ids"]}, 2, 0)
    with pytest.raises(ValueError, match="one packed row \\[1, T\\], got \\[2, 5\\]"):
        context_parallel_slice({**batch, "input_ids": batch["input_ids"].repeat(2, 1)}, 2, 0)
    with pytest.raises(ValueError, match="must rise to the row's 5 tokens"):
        context_parallel_slice({**batch, "cu_seqlens": torch.tensor([0, 4])}, 2, 0)
    slices = [context_parallel_slice(batch, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="another cp_size than 3"):
        context_parallel_gather([*slices, slices[0]])
    other = context_parallel_slice(PackedCollator()([item(6, 10)]), 2, 1)
    with pytest.raises(ValueError, match="slice 1's global_cu_seqlens differs from slice 0's"):
        context_parallel_gather([slices[0], other])


# --- under torchrun: 2 data-parallel groups of 2 context-parallel ranks ------------------


@pytest.mark.slow  # torchrun
def test_context_parallel_ranks_under_torchrun_gather_their_groups_batches(
    chats: Path, tmp_path: Path
):
    """4 processes (gloo): data-parallel rank d = rank // 2 and context-parallel rank
    c = rank % 2. Each loads its group's batches through ContextParallelCollator; the two
    ranks of a group all-gather their slices and gather them: the batches one process reads
    for data-parallel rank d with PackedCollator, exactly, and the two groups' batches hold
    every row once."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
        "--master_addr=127.0.0.1", f"--master_port={port.getsockname()[1]}",
        __file__, str(chats), str(tmp_path),
    ]  # fmt: skip
    port.close()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    rows = []
    for dp_rank in range(2):
        want = list(torchrun_loader(chats, PackedCollator(), dp_rank))
        for cp_rank in range(2):
            got = load_batches(tmp_path / f"gathered_{dp_rank}_{cp_rank}.npz")
            assert len(got) == len(want) > 0
            for batch, expected in zip(got, want, strict=True):
                assert_same(batch, expected)
        rows += [i for b in want for i in b["index"].tolist()]
    assert sorted(rows) == list(range(len(DatasetFactory.load("sft", chats, window_size=2048))))


def torchrun_loader(chats: Path, collator, dp_rank: int) -> DataflowLoader:
    from torch.utils.data import Dataset

    class Indexed(Dataset):  # each row with its index, to count the rows read
        def __init__(self) -> None:
            self.rows = DatasetFactory.load("sft", chats, window_size=2048)

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict:
            return {**self.rows[i], "index": i}

    return DataflowLoader(
        MapDistributor(Indexed(), seed=5, num_epochs=1),
        batcher=SequentialPackingBatcher(BUDGET),
        collator=Indexes(collator),
        dp_rank=dp_rank,
        dp_world_size=2,
    )


class Indexes(BatchCollator):
    """`collator`'s batch of the rows, with their indices (`index` [rows])."""

    def __init__(self, collator: BatchCollator) -> None:
        self.collator = collator

    def collate(self, samples: list[dict]) -> dict:
        index = torch.tensor([s.pop("index") for s in samples])
        return {**self.collator.collate(samples), "index": index}


def save_batches(batches: list[dict], path: Path) -> None:
    """Batches of tensors as plain arrays (npz, no pickle): key `i/name`."""
    arrays = {
        f"{i}/{k}": torch.as_tensor(v).numpy() for i, b in enumerate(batches) for k, v in b.items()
    }
    np.savez(path, **arrays)


def load_batches(path: Path) -> list[dict]:
    batches: dict[int, dict] = {}
    with np.load(path, allow_pickle=False) as found:
        for name in found.files:
            i, key = name.split("/", 1)
            batches.setdefault(int(i), {})[key] = torch.from_numpy(found[name])
    return [batches[i] for i in sorted(batches)]


def torchrun_main(chats: Path, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp_rank, cp_rank = divmod(rank, 2)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    gathered = []
    for batch in torchrun_loader(chats, ContextParallelCollator(2, cp_rank), dp_rank):
        slices: list = [None, None]
        dist.all_gather_object(slices, batch, group=groups[dp_rank])
        gathered.append(context_parallel_gather(slices))
    save_batches(gathered, out / f"gathered_{dp_rank}_{cp_rank}.npz")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torchrun_main(Path(sys.argv[1]), Path(sys.argv[2]))
