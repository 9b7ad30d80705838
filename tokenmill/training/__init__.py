"""The training half: shards (or raw JSONL) -> stores -> datasets -> sample order.

open_views (views, and what a store holds open of them between reads) -> store (the Store
interface) -> mmap_store (shards, read through storage/'s shard source: a local folder, or a
bucket through the machine's cache) | jsonl_store -> factory -> datasets | record_datasets ->
windows -> hf_names (seq/sft items and batches for Hugging Face trainers) | trl_columns (dpo,
kto, grpo items for TRL's trainers) -> dataset_factory -> order (the sample order) -> state
(resume-state checks) -> order_prefetch (shards fetched ahead of the order) -> sampler. Reaches
preprocessing only through the raw-JSONL route (jsonl_store, dataset_factory).
"""
