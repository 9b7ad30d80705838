"""tokenmill: exact tokens and loss masks from raw records, fed to PyTorch once each, resumably.

The public names resolve lazily, so preprocessing workers never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The real types for type checkers (mypy, pyright): the same names from the same modules
# as _EXPORTS below (tests/test_public_api.py holds the two equal). At run time the
# block is skipped and __getattr__ imports each name on first use.
if TYPE_CHECKING:
    # isort: off
    from tokenmill.preprocess.config import PipelineConfig as PipelineConfig
    from tokenmill.preprocess.presets import default_config as default_config
    from tokenmill.preprocess.run.pipeline import Pipeline as Pipeline
    from tokenmill.preprocess.run.runlog import Summary as Summary
    from tokenmill.preprocess.inputs.records import RecordError as RecordError
    from tokenmill.preprocess.chat.tokenizer import load_tokenizer as load_tokenizer
    from tokenmill.preprocess.chat.spans import render_conversation as render_conversation
    from tokenmill.training.factory import (
        detect_format as detect_format,
        StoreFactory as StoreFactory,
    )
    from tokenmill.training.store import Store as Store
    from tokenmill.training.mmap_store import MmapStore as MmapStore
    from tokenmill.training.jsonl_store import JsonlStore as JsonlStore
    from tokenmill.shards.verify import verify_dataset as verify_dataset
    from tokenmill.training.dataset_factory import DatasetFactory as DatasetFactory
    from tokenmill.training.datasets import (
        SEQDataset as SEQDataset,
        SFTDataset as SFTDataset,
    )
    from tokenmill.training.record_datasets import (
        DPODataset as DPODataset,
        GRPODataset as GRPODataset,
        KTODataset as KTODataset,
    )
    from tokenmill.training.sampler import RDSampler as RDSampler
    from tokenmill.dataflow import (
        DataDistributor as DataDistributor,
        RawItemProcessor as RawItemProcessor,
        SampleBatcher as SampleBatcher,
        BatchCollator as BatchCollator,
        IterableDistributor as IterableDistributor,
        MapDistributor as MapDistributor,
        RankPartitionedDistributor as RankPartitionedDistributor,
        MixtureDistributor as MixtureDistributor,
        SimpleBatcher as SimpleBatcher,
        PoolPackingBatcher as PoolPackingBatcher,
        SequentialPackingBatcher as SequentialPackingBatcher,
        DefaultBatchCollator as DefaultBatchCollator,
        SFTPaddingCollator as SFTPaddingCollator,
        DPOPaddingCollator as DPOPaddingCollator,
        GRPOPaddingCollator as GRPOPaddingCollator,
        PackedCollator as PackedCollator,
        ContextParallelCollator as ContextParallelCollator,
        DataflowLoader as DataflowLoader,
    )
    from tokenmill.tools.recipe import (
        Recipe as Recipe,
        load_recipe as load_recipe,
        realised_mix as realised_mix,
    )
    # isort: on

_EXPORTS = {
    "PipelineConfig": "tokenmill.preprocess.config",
    "default_config": "tokenmill.preprocess.presets",
    "Pipeline": "tokenmill.preprocess.run.pipeline",
    "Summary": "tokenmill.preprocess.run.runlog",
    "RecordError": "tokenmill.preprocess.inputs.records",
    "load_tokenizer": "tokenmill.preprocess.chat.tokenizer",
    "render_conversation": "tokenmill.preprocess.chat.spans",
    "detect_format": "tokenmill.training.factory",
    "StoreFactory": "tokenmill.training.factory",
    "Store": "tokenmill.training.store",
    "MmapStore": "tokenmill.training.mmap_store",
    "JsonlStore": "tokenmill.training.jsonl_store",
    "verify_dataset": "tokenmill.shards.verify",
    "DatasetFactory": "tokenmill.training.dataset_factory",
    "SEQDataset": "tokenmill.training.datasets",
    "SFTDataset": "tokenmill.training.datasets",
    "DPODataset": "tokenmill.training.record_datasets",
    "GRPODataset": "tokenmill.training.record_datasets",
    "KTODataset": "tokenmill.training.record_datasets",
    "RDSampler": "tokenmill.training.sampler",
    "DataDistributor": "tokenmill.dataflow",
    "RawItemProcessor": "tokenmill.dataflow",
    "SampleBatcher": "tokenmill.dataflow",
    "BatchCollator": "tokenmill.dataflow",
    "IterableDistributor": "tokenmill.dataflow",
    "MapDistributor": "tokenmill.dataflow",
    "RankPartitionedDistributor": "tokenmill.dataflow",
    "MixtureDistributor": "tokenmill.dataflow",
    "SimpleBatcher": "tokenmill.dataflow",
    "PoolPackingBatcher": "tokenmill.dataflow",
    "SequentialPackingBatcher": "tokenmill.dataflow",
    "DefaultBatchCollator": "tokenmill.dataflow",
    "SFTPaddingCollator": "tokenmill.dataflow",
    "DPOPaddingCollator": "tokenmill.dataflow",
    "GRPOPaddingCollator": "tokenmill.dataflow",
    "PackedCollator": "tokenmill.dataflow",
    "ContextParallelCollator": "tokenmill.dataflow",
    "DataflowLoader": "tokenmill.dataflow",
    "Recipe": "tokenmill.tools.recipe",
    "load_recipe": "tokenmill.tools.recipe",
    "realised_mix": "tokenmill.tools.recipe",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
