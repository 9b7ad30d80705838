"""The training half: shards (or raw JSONL) -> stores -> datasets -> sample order.

store (the Store interface) -> mmap_store (shards, local or through storage/'s machine cache)
| jsonl_store -> factory -> datasets | record_datasets -> windows -> hf_names ->
dataset_factory -> state (order and resume helpers) -> order_ahead (shards fetched ahead of
the order) -> sampler. Reaches preprocessing only through the raw-JSONL route (jsonl_store,
dataset_factory).
"""
