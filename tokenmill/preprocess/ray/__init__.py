"""The Ray engine: the local engine's chunks, processed on a Ray cluster, same bytes out.

engine (RayEngine: the whole flow) -> results (the scan, and the Ray Data tasks that mask and
pack work units) | head_start (the driver's own share of the first task's chunks) -> merge
(chunks back on the driver, once each, in chunk order) -> writer (shards written by tasks).
"""
