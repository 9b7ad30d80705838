"""Object storage: where shards live when they are not on this machine. Never imports torch.

remote (the client: URLs, storage options, counted retries) -> bucket_lock (one writer per
bucket prefix) -> cache_files (a shard's files in the machine's cache, checked) -> cache (the
machine-wide shard cache) -> eviction (least recently used first) -> prefetch (downloads
ahead of the reads, and ahead of a sample order).
"""
