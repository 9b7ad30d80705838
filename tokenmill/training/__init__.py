"""The training half: shards (or raw JSONL) -> stores -> datasets -> sample order.

store (the Store interface) -> mmap_store (a URL: cache + prefetch) | jsonl_store -> factory -> datasets ->
state (order and resume helpers) -> sampler. Reaches preprocessing only through the
raw-JSONL route (jsonl_store, datasets).
"""
