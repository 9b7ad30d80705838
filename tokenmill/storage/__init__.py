"""Object storage: where shards live when they are not on this machine. Never imports torch.

remote (the client: URLs, storage options, counted retries) -> location (a file or folder at
a path or a URL: inputs listed and opened, outputs checked, a dataset had as a local folder)
-> bucket_lock (one writer per bucket prefix) -> cache_files (a shard's files in the
machine's cache, checked) -> cache (the machine-wide shard cache) -> eviction (least recently
used first) -> prefetch (downloads ahead of the reads, and ahead of a sample order) -> source
(where a dataset's shards live, as a store reads them: a local folder) -> bucket_source (a
bucket, through the machine's cache).
"""
