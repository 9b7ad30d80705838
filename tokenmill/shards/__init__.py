"""The shard format, shared by both halves: numpy only, never torch.

format (names, dtypes, limits) -> buffers (records into columns) -> files (durable writes, file locks)
-> writer (shards published whole) -> reader (meta.json, memory maps) -> index (what
opening a dataset needs, in one mapped file) -> manifest (written last: the commit point) -> verify (sizes, checksums, offsets); schema (which keys
of an item hold tokens and masks, per training type). Object storage is
the storage/ room's.
"""
