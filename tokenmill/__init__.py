"""tokenmill: exact tokens and loss masks from raw records, fed to PyTorch once each, resumably.

The public names resolve lazily, so preprocessing workers never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

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
    "DataflowLoader": "tokenmill.dataflow",
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
