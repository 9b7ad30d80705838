"""The modular loader: four roles in fixed order, run inside torch DataLoader workers.

DataDistributor (distributors.py) -> RawItemProcessor (processors.py) -> SampleBatcher
(batchers.py) -> BatchCollator (collators.py; packed_preferences: DPO, KTO and GRPO groups
packed in one row; context_parallel: a packed row split across context-parallel ranks), in
order per worker (roles.py), driven by DataflowLoader (loader.py, its
settings one LoaderOptions, its collator by default the one that fits the dataset's items:
fitting); provenance (the tokenizer a loader's data was made with). The hooks each role may
offer are declared on its base class, and what the loader may ask of a dataset are the
Protocols of contracts.py.
"""

from tokenmill.dataflow.batchers import (
    PoolPackingBatcher,
    SampleBatcher,
    SequentialPackingBatcher,
    SimpleBatcher,
)
from tokenmill.dataflow.collators import (
    BatchCollator,
    DefaultBatchCollator,
    DPOPaddingCollator,
    GRPOPaddingCollator,
    KTOPaddingCollator,
    PackedCollator,
    SFTPaddingCollator,
)
from tokenmill.dataflow.context_parallel import (
    ContextParallelCollator,
    context_parallel_gather,
    context_parallel_slice,
)
from tokenmill.dataflow.distributors import (
    DataDistributor,
    IterableDistributor,
    MapDistributor,
    MixtureDistributor,
    RankPartitionedDistributor,
)
from tokenmill.dataflow.loader import DataflowLoader, LoaderOptions
from tokenmill.dataflow.packed_preferences import (
    PackedDPOCollator,
    PackedGRPOCollator,
    PackedKTOCollator,
)
from tokenmill.dataflow.processors import IdentityProcessor, RawItemProcessor, TruncateProcessor

__all__ = [
    "DataDistributor",
    "IterableDistributor",
    "MapDistributor",
    "RankPartitionedDistributor",
    "MixtureDistributor",
    "RawItemProcessor",
    "IdentityProcessor",
    "TruncateProcessor",
    "SampleBatcher",
    "SimpleBatcher",
    "PoolPackingBatcher",
    "SequentialPackingBatcher",
    "BatchCollator",
    "DefaultBatchCollator",
    "SFTPaddingCollator",
    "DPOPaddingCollator",
    "KTOPaddingCollator",
    "GRPOPaddingCollator",
    "PackedCollator",
    "PackedDPOCollator",
    "PackedKTOCollator",
    "PackedGRPOCollator",
    "ContextParallelCollator",
    "context_parallel_slice",
    "context_parallel_gather",
    "DataflowLoader",
    "LoaderOptions",
]
