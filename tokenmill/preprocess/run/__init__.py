"""The run: one preprocessing run, resumable after a crash, its output local or in a bucket.

pipeline (Pipeline: inputs -> engine -> shards -> manifest) -> runlog (Summary and the
resume Journal) -> upload (an output at a URL: parts uploaded, manifest last).
"""
