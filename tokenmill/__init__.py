"""tokenmill: exact tokens and loss masks from raw records, fed to PyTorch once each, resumably.

The public names resolve lazily, so preprocessing workers never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "PipelineConfig": "tokenmill.config",
    "default_config": "tokenmill.config",
    "Pipeline": "tokenmill.pipeline",
    "Summary": "tokenmill.runlog",
    "RecordError": "tokenmill.records",
    "load_tokenizer": "tokenmill.templates",
    "render_conversation": "tokenmill.templates",
    "detect_format": "tokenmill.store",
    "StoreFactory": "tokenmill.store",
    "Store": "tokenmill.store",
    "MmapStore": "tokenmill.store",
    "JsonlStore": "tokenmill.jsonl_store",
    "verify_dataset": "tokenmill.verify",
    "DatasetFactory": "tokenmill.datasets",
    "SEQDataset": "tokenmill.datasets",
    "SFTDataset": "tokenmill.datasets",
    "DPODataset": "tokenmill.datasets",
    "GRPODataset": "tokenmill.datasets",
    "RDSampler": "tokenmill.sampler",
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
